package main

import (
	"github.com/spf13/cobra"

	"github.com/ovis-storage/ovis/cmd/ovis/internal/img"
)

func newImgCheckCmd() *cobra.Command {
	var (
		cfg        img.CheckConfig
		forceShare bool
	)
	var imageOpts bool
	cmd := &cobra.Command{
		Use:   "check [-f FMT] [-r leaks|all] [--output=human|json] [-q] [-T CACHE] [-U] FILENAME",
		Short: "Check an image's metadata, and repair it with -r",
		Long: "Check the image's metadata as qemu-img check does and exit 0 when it is clean,\n" +
			"2 when it is corrupt, 3 when it only leaks clusters, 1 when the check failed\n" +
			"and 63 for a format without checks (raw). -r leaks frees leaked clusters;\n" +
			"-r all also repairs refcounts and COPIED flags.",
		Args: cobra.ArbitraryArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			env := newEnv(cmd, forceShare)
			if cfg.Repair != "" {
				if err := img.ParseRepair(cfg.Repair); err != nil {
					return err
				}
			}
			if len(args) != 1 {
				return img.UsageError("Expecting one image file name")
			}
			var err error
			if cfg.Filename, err = imageOptsArg(cmd, env, imageOpts, args[0], &cfg.Format, "format"); err != nil {
				return err
			}
			return env.Check(cmd.Context(), cfg)
		},
	}
	f := cmd.Flags()
	f.StringVarP(&cfg.Format, "format", "f", "", "image format (default: probe)")
	f.StringVarP(&cfg.Repair, "repair", "r", "", "repair leaks, or all inconsistencies")
	f.StringVar(&cfg.Output, "output", "human", "output format: human or json")
	f.BoolVarP(&cfg.Quiet, "quiet", "q", false, "print nothing on stdout")
	f.StringVarP(&cfg.Cache, "cache", "T", "", "cache mode of the image (default writeback; none and directsync read with O_DIRECT)")
	f.BoolVarP(&forceShare, "force-share", "U", false, "open the image even if it is in use")
	addImageOpts(cmd.Flags(), &imageOpts)
	return cmd
}
