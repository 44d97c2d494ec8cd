package main

import (
	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/ovis-storage/ovis/cmd/ovis/internal/img"
)

func newImgResizeCmd() *cobra.Command {
	var cfg img.ResizeConfig
	f := pflag.NewFlagSet("resize", pflag.ContinueOnError)
	f.StringVarP(&cfg.Format, "format", "f", "", "image format (default: probe)")
	f.StringVar(&cfg.Preallocation, "preallocation", "", "preallocation of the added range: off, metadata (qcow2), falloc or full")
	f.BoolVar(&cfg.Shrink, "shrink", false, "allow a smaller size, dropping the data past the new end")
	f.BoolVarP(&cfg.Quiet, "quiet", "q", false, "do not print \"Image resized.\"")
	help := f.BoolP("help", "h", false, "help for resize")
	var imageOpts bool
	// On f, which parses the arguments here (DisableFlagParsing).
	addImageOpts(f, &imageOpts)
	cmd := &cobra.Command{
		Use:   "resize [-f FMT] [--preallocation=PREALLOC] [--shrink] [-q] FILENAME [+ | -]SIZE",
		Short: "Change an image's virtual size",
		Long: "Set the image's virtual size to SIZE, or grow or shrink it by SIZE with a\n" +
			"leading + or -, as qemu-img resize does. Shrinking needs --shrink.",
		// As qemu-img, take SIZE off the end before parsing flags, so
		// that "-1G" is a size and not a flag.
		DisableFlagParsing: true,
		RunE: func(cmd *cobra.Command, args []string) error {
			env := newEnv(cmd, false)
			if len(args) < 2 {
				if len(args) == 1 && (args[0] == "-h" || args[0] == "--help") {
					return cmd.Help()
				}
				return img.UsageError("Not enough arguments")
			}
			cfg.Size = args[len(args)-1]
			if err := f.Parse(args[:len(args)-1]); err != nil {
				return img.UsageError("%v", err)
			}
			if *help {
				return cmd.Help()
			}
			if f.NArg() != 1 {
				return img.UsageError("Expecting image file name and size")
			}
			var err error
			if cfg.Filename, err = imageOptsArg(cmd, env, imageOpts, f.Arg(0), &cfg.Format, "format"); err != nil {
				return err
			}
			return env.Resize(cmd.Context(), cfg)
		},
	}
	cmd.Flags().AddFlagSet(f)
	return cmd
}
