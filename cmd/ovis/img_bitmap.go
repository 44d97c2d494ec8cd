package main

import (
	"github.com/spf13/cobra"

	"github.com/ovis-storage/ovis/cmd/ovis/internal/img"
)

// bitmapActionFlag is one of qemu-img bitmap's action flags: each use
// appends an action, so that the actions keep their command-line order.
type bitmapActionFlag struct {
	acts *[]img.BitmapAction
	op   string
}

func (f bitmapActionFlag) Set(v string) error {
	a := img.BitmapAction{Op: f.op}
	if f.op == "merge" {
		a.Source = v
	}
	*f.acts = append(*f.acts, a)
	return nil
}

func (f bitmapActionFlag) String() string { return "" }

func (f bitmapActionFlag) Type() string {
	if f.op == "merge" {
		return "string"
	}
	return "bool"
}

func newImgBitmapCmd() *cobra.Command {
	var (
		cfg       img.BitmapConfig
		imageOpts bool
	)
	cmd := &cobra.Command{
		Use:   "bitmap (--add [-g SIZE] | --remove | --clear | --enable | --disable | --merge SOURCE [-b SRC_FILE [-F SRC_FMT]])... [-f FMT] FILE BITMAP",
		Short: "Add, remove, clear, enable, disable or merge persistent bitmaps",
		Long: "Change the persistent dirty bitmap BITMAP of a qcow2 image as qemu-img bitmap\n" +
			"does; the actions run in the order given. An enabled bitmap records every\n" +
			"write made through ovis (or QEMU) from then on.",
		Args: cobra.ArbitraryArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			env := newEnv(cmd, false)
			cfg.Args = args
			if len(args) == 2 { // an option list, json: or file: name
				file, err := imageOptsArg(cmd, env, imageOpts, args[0], &cfg.Format, "format")
				if err != nil {
					return err
				}
				cfg.Args = []string{file, args[1]}
			}
			return env.Bitmap(cmd.Context(), cfg)
		},
	}
	f := cmd.Flags()
	for _, a := range []struct{ op, help string }{
		{"add", "add BITMAP, enabled"},
		{"remove", "remove BITMAP"},
		{"clear", "clear every bit of BITMAP"},
		{"enable", "make BITMAP record writes"},
		{"disable", "stop BITMAP recording writes"},
	} {
		f.VarPF(bitmapActionFlag{&cfg.Actions, a.op}, a.op, "", a.help).NoOptDefVal = "true"
	}
	f.Var(bitmapActionFlag{&cfg.Actions, "merge"}, "merge", "merge the bits of bitmap SOURCE into BITMAP")
	f.StringVarP(&cfg.Granularity, "granularity", "g", "", "bytes per bit of an added bitmap (default: the cluster size, at least 4k)")
	f.StringVarP(&cfg.SourceFile, "source-file", "b", "", "image that holds merge's SOURCE (default: FILE)")
	f.StringVarP(&cfg.SourceFormat, "source-format", "F", "", "format of -b's image")
	f.StringVarP(&cfg.Format, "format", "f", "", "image format (default: probe)")
	addImageOpts(cmd.Flags(), &imageOpts)
	return cmd
}
