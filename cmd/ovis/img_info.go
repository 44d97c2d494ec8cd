package main

import (
	"github.com/spf13/cobra"

	"github.com/ovis-storage/ovis/cmd/ovis/internal/img"
)

func newImgInfoCmd() *cobra.Command {
	var (
		cfg        img.InfoConfig
		forceShare bool
	)
	var imageOpts bool
	cmd := &cobra.Command{
		Use:   "info [-f FMT] [--output=human|json] [--backing-chain] [-U] FILENAME",
		Short: "Describe an image",
		Long: "Print what qemu-img info prints for the image: sizes, backing file, snapshots\n" +
			"and format-specific fields, as text or as JSON with the same keys and order.",
		Args: cobra.ArbitraryArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			env := newEnv(cmd, forceShare)
			if len(args) != 1 {
				return img.UsageError("Expecting one image file name")
			}
			var err error
			if cfg.Filename, err = imageOptsArg(cmd, env, imageOpts, args[0], &cfg.Format, "format"); err != nil {
				return err
			}
			return env.Info(cfg)
		},
	}
	f := cmd.Flags()
	f.StringVarP(&cfg.Format, "format", "f", "", "image format (default: probe)")
	f.StringVar(&cfg.Output, "output", "human", "output format: human or json")
	f.BoolVar(&cfg.BackingChain, "backing-chain", false, "describe every image of the backing chain")
	f.BoolVarP(&forceShare, "force-share", "U", false, "open the image even if it is in use")
	addImageOpts(cmd.Flags(), &imageOpts)
	return cmd
}
