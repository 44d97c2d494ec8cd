package main

import (
	"github.com/spf13/cobra"

	"github.com/ovis-storage/ovis/block"
	"github.com/ovis-storage/ovis/cmd/ovis/internal/img"
)

func newImgRebaseCmd() *cobra.Command {
	var (
		cfg             img.RebaseConfig
		forceShare      bool
		cache, srcCache block.CacheMode
	)
	var imageOpts bool
	cmd := &cobra.Command{
		Use:   "rebase [-f FMT] [-F BACKING_FMT] [-u] [-p] [-q] -b BACKING_FILE FILENAME",
		Short: "Change an image's backing file",
		Long: "Point the image at another backing file as qemu-img rebase does. Without -u\n" +
			"the image keeps reading the same: what would read differently through the new\n" +
			"backing file is first copied into the image. -b \"\" removes the backing file.\n" +
			"-u only rewrites the header.",
		Args: cobra.ArbitraryArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			env := newEnv(cmd, false)
			cfg.ForceShare = forceShare
			cfg.HasBacking = cmd.Flags().Changed("backing")
			if len(args) != 1 {
				return img.UsageError("Expecting one image file name")
			}
			var err error
			if cfg.Filename, err = imageOptsArg(cmd, env, imageOpts, args[0], &cfg.Format, "format"); err != nil {
				return err
			}
			return env.Rebase(cmd.Context(), cfg)
		},
	}
	f := cmd.Flags()
	f.StringVarP(&cfg.Format, "format", "f", "", "image format (default: probe)")
	f.StringVarP(&cfg.Backing, "backing", "b", "", "new backing file (\"\" for none)")
	f.StringVarP(&cfg.BackingFormat, "backing-format", "F", "", "format of the new backing file")
	f.BoolVarP(&cfg.Unsafe, "unsafe", "u", false, "only rewrite the header")
	f.BoolVarP(&cfg.Progress, "progress", "p", false, "show progress on stdout")
	f.BoolVarP(&cfg.Quiet, "quiet", "q", false, "no progress")
	f.BoolVarP(&forceShare, "force-share", "U", false, "open the backing files even if they are in use")
	f.VarP(&cache, "cache", "t", "cache mode of the image (accepted)")
	f.VarP(&srcCache, "source-cache", "T", "cache mode of the backing files (accepted)")
	addImageOpts(cmd.Flags(), &imageOpts)
	return cmd
}
