package main

import (
	"github.com/spf13/cobra"

	"github.com/ovis-storage/ovis/block"
	"github.com/ovis-storage/ovis/cmd/ovis/internal/img"
)

func newImgCommitCmd() *cobra.Command {
	var (
		cfg   img.CommitConfig
		cache block.CacheMode
	)
	var imageOpts bool
	cmd := &cobra.Command{
		Use:   "commit [-f FMT] [-b BASE] [-d] [-p] [-q] [-r RATE] FILENAME",
		Short: "Write an image's changes into its backing file",
		Long: "Copy what the image holds into its backing file (or into BASE, further down\n" +
			"the chain, with everything in between) as qemu-img commit does, then empty the\n" +
			"image unless -d (or -b) is given.",
		Args: cobra.ArbitraryArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			env := newEnv(cmd, false)
			if len(args) != 1 {
				return img.UsageError("Expecting one image file name")
			}
			var err error
			if cfg.Filename, err = imageOptsArg(cmd, env, imageOpts, args[0], &cfg.Format, "format"); err != nil {
				return err
			}
			return env.Commit(cmd.Context(), cfg)
		},
	}
	f := cmd.Flags()
	f.StringVarP(&cfg.Format, "format", "f", "", "image format (default: probe)")
	f.StringVarP(&cfg.Base, "base", "b", "", "image of the backing chain to commit into (implies -d)")
	f.BoolVarP(&cfg.Drop, "drop", "d", false, "leave the image as it is")
	f.BoolVarP(&cfg.Progress, "progress", "p", false, "show progress on stdout")
	f.BoolVarP(&cfg.Quiet, "quiet", "q", false, "print nothing on stdout")
	f.StringVarP(&cfg.RateLimit, "rate-limit", "r", "", "most bytes committed per second (k, M, G suffixes)")
	f.VarP(&cache, "cache", "t", "cache mode (accepted)")
	addImageOpts(cmd.Flags(), &imageOpts)
	return cmd
}
