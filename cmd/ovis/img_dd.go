package main

import (
	"strings"

	"github.com/spf13/cobra"

	"github.com/ovis-storage/ovis/cmd/ovis/internal/img"
)

func newImgDDCmd() *cobra.Command {
	var (
		cfg        img.DDConfig
		forceShare bool
		imageOpts  bool
	)
	cmd := &cobra.Command{
		Use:   "dd [-f FMT] [-O FMT] [-U] [bs=BLOCK_SIZE] [count=BLOCKS] [skip=BLOCKS] if=INPUT of=OUTPUT",
		Short: "Copy part of an image into a new image, dd style",
		Long: "Copy INPUT, from block skip on and count blocks of bs bytes long (default 512),\n" +
			"into a new image OUTPUT of format -O (default raw), as qemu-img dd does. Every\n" +
			"byte is written: the output is fully allocated.",
		Args: cobra.ArbitraryArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			env := newEnv(cmd, forceShare)
			cfg.Operands = args
			// The input operand may be an option list (--image-opts), a
			// json: or a file: name.
			for i, a := range args {
				if spec, ok := strings.CutPrefix(a, "if="); ok {
					file, err := imageOptsArg(cmd, env, imageOpts, spec, &cfg.Format, "format")
					if err != nil {
						return err
					}
					cfg.Operands = append(append(append([]string(nil), args[:i]...), "if="+file), args[i+1:]...)
				}
			}
			warn, err := env.DD(cmd.Context(), cfg)
			if warn != nil {
				img.Report(cmd.ErrOrStderr(), warn)
			}
			return err
		},
	}
	f := cmd.Flags()
	f.StringVarP(&cfg.Format, "format", "f", "", "input format (default: probe)")
	f.StringVarP(&cfg.OutFormat, "output-format", "O", "raw", "output format: qcow2 or raw")
	f.BoolVarP(&forceShare, "force-share", "U", false, "open the input even if it is in use")
	addImageOpts(cmd.Flags(), &imageOpts)
	return cmd
}
