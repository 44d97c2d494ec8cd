package main

import (
	"github.com/spf13/cobra"

	"github.com/ovis-storage/ovis/cmd/ovis/internal/img"
)

func newImgMapCmd() *cobra.Command {
	var (
		cfg        img.MapConfig
		forceShare bool
	)
	var imageOpts bool
	cmd := &cobra.Command{
		Use:   "map [-f FMT] [--output=human|json] [--start-offset OFFSET] [--max-length LEN] [-U] FILENAME",
		Short: "Show where an image's data lives",
		Long: "Print the image's runs of data, zeros and holes, and the layer of the backing\n" +
			"chain and host offset that hold them, as qemu-img map does.",
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
			return env.Map(cmd.Context(), cfg)
		},
	}
	f := cmd.Flags()
	f.StringVarP(&cfg.Format, "format", "f", "", "image format (default: probe)")
	f.StringVar(&cfg.Output, "output", "human", "output format: human or json")
	f.StringVarP(&cfg.StartOffset, "start-offset", "s", "", "first byte to map")
	f.StringVarP(&cfg.MaxLength, "max-length", "l", "", "most bytes to map")
	f.BoolVarP(&forceShare, "force-share", "U", false, "open the image even if it is in use")
	addImageOpts(cmd.Flags(), &imageOpts)
	return cmd
}
