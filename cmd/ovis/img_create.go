package main

import (
	"github.com/spf13/cobra"

	"github.com/ovis-storage/ovis/cmd/ovis/internal/img"
)

func newImgCreateCmd() *cobra.Command {
	var cfg img.CreateConfig
	cmd := &cobra.Command{
		Use:   "create [-q] [-f FMT] [-b BACKING_FILE [-F BACKING_FMT]] [-u] [-o OPTIONS] FILENAME [SIZE]",
		Short: "Create a qcow2 or raw image",
		Long: "Create a new image, as qemu-img create does. SIZE takes k, M, G, T, P and E\n" +
			"suffixes (powers of 1024) and fractions (1.5G). OPTIONS is a comma list of\n" +
			"name=value (',,' is a literal comma); '-o help' lists the options.",
		Args: cobra.ArbitraryArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			env := newEnv(cmd, false)
			if len(args) > 0 {
				cfg.Filename = args[0]
			}
			if len(args) > 1 {
				cfg.Size = args[1]
			}
			if len(args) > 2 {
				return img.UsageError("Unexpected argument: %s", args[2])
			}
			cfg.BackingFileSet = cmd.Flags().Changed("backing")
			cfg.BackingFormatSet = cmd.Flags().Changed("backing-format")
			return env.Create(cfg)
		},
	}
	f := cmd.Flags()
	f.StringVarP(&cfg.Format, "format", "f", "raw", "image format: qcow2 or raw")
	f.StringArrayVarP(&cfg.Options, "options", "o", nil, "format options, name=value[,...] (repeatable; 'help' lists them)")
	f.StringVarP(&cfg.BackingFile, "backing", "b", "", "backing file of the new image")
	f.StringVarP(&cfg.BackingFormat, "backing-format", "F", "", "format of the backing file")
	f.BoolVarP(&cfg.Unsafe, "unsafe", "u", false, "do not open the backing file (SIZE is then required)")
	f.BoolVarP(&cfg.Quiet, "quiet", "q", false, "do not print the Formatting line")
	return cmd
}
