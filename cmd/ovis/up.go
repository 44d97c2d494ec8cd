package main

import (
	"github.com/spf13/cobra"

	"github.com/ovis-storage/ovis/cmd/ovis/internal/img"
)

func newUpCmd() *cobra.Command {
	cfg := img.UpConfig{Dir: "ovis-data", Size: "20G"}
	cmd := &cobra.Command{
		Use:   "up",
		Short: "Prepare a local disk image (NBD serving arrives with `ovis nbd`)",
		Long: "up creates DIR/disk0.qcow2 (a sparse qcow2 image of SIZE) if it is missing and\n" +
			"prints its path. It does not serve the disk yet: NBD serving arrives with the\n" +
			"NBD server (`ovis nbd`, issue 3).",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			return img.Up(cfg, cmd.OutOrStdout())
		},
	}
	cmd.Flags().StringVar(&cfg.Dir, "dir", cfg.Dir, "folder that holds the disk images")
	cmd.Flags().StringVar(&cfg.Size, "size", cfg.Size, "virtual size of a new disk")
	return cmd
}
