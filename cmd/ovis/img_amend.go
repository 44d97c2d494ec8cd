package main

import (
	"errors"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/ovis-storage/ovis/cmd/ovis/internal/img"
)

func newImgAmendCmd() *cobra.Command {
	var (
		cfg       img.AmendConfig
		imageOpts bool
	)
	cmd := &cobra.Command{
		Use:   "amend [--image-opts] [-p] [-q] [-f FMT] [-t CACHE] [--force] -o OPTIONS FILENAME",
		Short: "Change the options of an existing qcow2 image",
		Long: "Change the options of a qcow2 image in place, as qemu-img amend does: compat\n" +
			"(0.10 or 1.1, expanding zero clusters on downgrade), refcount_bits,\n" +
			"lazy_refcounts, data_file, data_file_raw and size. OPTIONS is a comma list of\n" +
			"name=value (',,' is a literal comma); '-o help' lists the options.",
		Args: cobra.ArbitraryArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			env := newEnv(cmd, false)
			cfg.Filenames = args
			if len(args) == 1 { // an option list, json: or file: name
				file, err := imageOptsArg(cmd, env, imageOpts, args[0], &cfg.Format, "format")
				if err != nil {
					return err
				}
				cfg.Filenames = []string{file}
			}
			return env.Amend(cmd.Context(), cfg)
		},
	}
	cmd.SetFlagErrorFunc(getoptError)
	f := cmd.Flags()
	f.StringVarP(&cfg.Format, "format", "f", "", "image format (default: probe)")
	f.StringArrayVarP(&cfg.Options, "options", "o", nil, "options to change, name=value[,...] (repeatable; 'help' lists them)")
	f.BoolVarP(&cfg.Progress, "progress", "p", false, "show progress on stdout")
	f.BoolVarP(&cfg.Quiet, "quiet", "q", false, "print no progress")
	f.StringVarP(&cfg.Cache, "cache", "t", "", "cache mode (accepted): writeback, writethrough, none, directsync or unsafe")
	f.BoolVar(&cfg.Force, "force", false, "accepted for qemu-img compatibility (it only matters for encryption)")
	addImageOpts(cmd.Flags(), &imageOpts)
	return cmd
}

// getoptError words a flag parsing error as qemu-img's getopt loop does:
// "unrecognized option '-x'" and "missing argument for option '-o'",
// naming the argument as typed.
func getoptError(_ *cobra.Command, err error) error {
	var unknown *pflag.NotExistError
	var missing *pflag.ValueRequiredError
	switch {
	case errors.As(err, &unknown) && unknown.GetSpecifiedShortnames() != "":
		return img.UsageError("unrecognized option '-%s'", unknown.GetSpecifiedShortnames())
	case errors.As(err, &unknown):
		return img.UsageError("unrecognized option '--%s'", unknown.GetSpecifiedName())
	case errors.As(err, &missing) && missing.GetSpecifiedShortnames() != "":
		return img.UsageError("missing argument for option '-%s'", missing.GetSpecifiedShortnames())
	case errors.As(err, &missing):
		return img.UsageError("missing argument for option '--%s'", missing.GetSpecifiedName())
	}
	return img.UsageError("%v", err)
}
