package main

import (
	"errors"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/ovis-storage/ovis/cmd/ovis/internal/img"
)

// addImageOpts adds qemu-img's --image-opts to a verb.
func addImageOpts(f *pflag.FlagSet, on *bool) {
	f.BoolVar(on, "image-opts", false, "treat the image argument as an option list: driver=qcow2,file.filename=FILE,l2-cache-size=...")
}

// imageOptsArg resolves an image argument under --image-opts: it returns
// the file the option list names and sets *format to its driver, and
// records the list in env for the verb's opens. formatFlags are the
// verb's format flags, which the list replaces.
func imageOptsArg(cmd *cobra.Command, env *img.Env, on bool, arg string, format *string, formatFlags ...string) (string, error) {
	if !on {
		// file: and json: names, which qemu-img takes too.
		return env.ResolveFilename(arg, format)
	}
	for _, name := range formatFlags {
		if cmd.Flags().Changed(name) {
			return "", errors.New("--image-opts and --format are mutually exclusive")
		}
	}
	file, driver, err := env.UseImageOpts(arg)
	if err != nil {
		return "", err
	}
	if format != nil {
		*format = driver
	}
	return file, nil
}
