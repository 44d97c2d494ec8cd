package main

import (
	"github.com/spf13/cobra"

	"github.com/ovis-storage/ovis/cmd/ovis/internal/img"
)

func newImgCompareCmd() *cobra.Command {
	var (
		cfg        img.CompareConfig
		forceShare bool
	)
	var imageOpts bool
	cmd := &cobra.Command{
		Use:   "compare [-f FMT] [-F FMT] [-T CACHE] [-p] [-q] [-s] [-U] FILENAME1 FILENAME2",
		Short: "Compare the content of two images",
		Long: "Compare two images as qemu-img compare does: exit 0 when they read the same,\n" +
			"1 when they differ (\"Content mismatch at offset N!\"), 2 when one cannot be\n" +
			"opened, 3 or 4 on an I/O error. Past the end of the smaller image the larger\n" +
			"must read as zeros; -s (strict) also fails on different sizes or allocation.",
		Args: cobra.ArbitraryArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			env := newEnv(cmd, forceShare)
			if len(args) != 2 {
				return img.UsageError("Expecting two image file names")
			}
			var err error
			// An image that cannot be opened exits 2 in compare.
			if cfg.Filename1, err = imageOptsArg(cmd, env, imageOpts, args[0], &cfg.Format1, "a-format", "b-format"); err != nil {
				return &img.ExitError{Code: 2, Err: err}
			}
			if cfg.Filename2, err = imageOptsArg(cmd, env, imageOpts, args[1], &cfg.Format2, "a-format", "b-format"); err != nil {
				return &img.ExitError{Code: 2, Err: err}
			}
			return env.Compare(cmd.Context(), cfg)
		},
	}
	f := cmd.Flags()
	f.StringVarP(&cfg.Format1, "a-format", "f", "", "format of the first image (default: probe)")
	f.StringVarP(&cfg.Format2, "b-format", "F", "", "format of the second image (default: probe)")
	f.BoolVarP(&cfg.Strict, "strict", "s", false, "fail on different sizes or allocation too")
	f.BoolVarP(&cfg.Progress, "progress", "p", false, "show progress on stdout")
	f.BoolVarP(&cfg.Quiet, "quiet", "q", false, "print nothing on stdout")
	f.StringVarP(&cfg.Cache, "cache", "T", "", "cache mode of both images (default writeback; none and directsync read with O_DIRECT)")
	f.BoolVarP(&forceShare, "force-share", "U", false, "open the images even if they are in use")
	addImageOpts(cmd.Flags(), &imageOpts)
	return cmd
}
