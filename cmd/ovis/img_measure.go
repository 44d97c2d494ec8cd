package main

import (
	"errors"

	"github.com/spf13/cobra"

	"github.com/ovis-storage/ovis/cmd/ovis/internal/img"
)

func newImgMeasureCmd() *cobra.Command {
	var (
		cfg        img.MeasureConfig
		forceShare bool
	)
	var imageOpts bool
	cmd := &cobra.Command{
		Use:   "measure [--output=human|json] [-O FMT] [-o OPTIONS] (--size SIZE | [-f FMT] [-l SNAPSHOT] FILENAME)",
		Short: "Compute the size an image needs",
		Long: "Print the file size a new image of format -O needs to hold SIZE bytes or the\n" +
			"content of FILENAME, as qemu-img measure does: the size required and the size\n" +
			"fully allocated (and, from a qcow2 image, the room its bitmaps take).",
		Args: cobra.ArbitraryArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			env := newEnv(cmd, forceShare)
			if len(args) > 1 {
				return errors.New("At most one filename argument is allowed.")
			}
			if len(args) == 1 {
				var err error
				if cfg.Filename, err = imageOptsArg(cmd, env, imageOpts, args[0], &cfg.Format, "format"); err != nil {
					return err
				}
			}
			return env.Measure(cmd.Context(), cfg)
		},
	}
	f := cmd.Flags()
	f.StringVarP(&cfg.Format, "format", "f", "", "source format (default: probe)")
	f.StringVarP(&cfg.OutFormat, "output-format", "O", "raw", "format of the new image: qcow2 or raw")
	f.StringArrayVarP(&cfg.Options, "options", "o", nil, "options of the new image, name=value[,...]")
	f.StringVarP(&cfg.Snapshot, "snapshot", "l", "", "measure an internal snapshot of FILENAME: snapshot.id=ID,snapshot.name=NAME or ID_OR_NAME")
	f.StringVar(&cfg.Size, "size", "", "virtual size of an empty new image")
	f.StringVar(&cfg.Output, "output", "human", "output format: human or json")
	f.BoolVarP(&forceShare, "force-share", "U", false, "open the image even if it is in use")
	addImageOpts(cmd.Flags(), &imageOpts)
	return cmd
}
