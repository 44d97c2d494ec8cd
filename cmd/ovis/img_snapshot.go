package main

import (
	"github.com/spf13/cobra"

	"github.com/ovis-storage/ovis/cmd/ovis/internal/img"
)

func newImgSnapshotCmd() *cobra.Command {
	var (
		cfg                img.SnapshotConfig
		list               bool
		apply, create, del string
		forceShare         bool
	)
	var imageOpts bool
	cmd := &cobra.Command{
		Use:   "snapshot [-l | -a SNAPSHOT | -c SNAPSHOT | -d SNAPSHOT] [-q] [-U] FILENAME",
		Short: "List, create, apply or delete internal snapshots",
		Long: "Manage the internal snapshots of a qcow2 image as qemu-img snapshot does: -l\n" +
			"lists them, -c creates one of the image as it is now, -a reverts the image to\n" +
			"one (by ID or name), -d deletes one (by name).",
		Args: cobra.ArbitraryArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			env := newEnv(cmd, forceShare)
			f := cmd.Flags()
			n := 0
			for _, a := range []struct {
				flag, action string
				name         *string
			}{{"list", img.SnapshotList, nil}, {"apply", img.SnapshotApply, &apply},
				{"create", img.SnapshotCreate, &create}, {"delete", img.SnapshotDelete, &del}} {
				if f.Changed(a.flag) {
					n++
					cfg.Action = a.action
					if a.name != nil {
						cfg.Name = *a.name
					}
				}
			}
			if n > 1 {
				return img.UsageError("Cannot mix '-l', '-a', '-c', '-d'")
			}
			if len(args) != 1 {
				return img.UsageError("Expecting one image file name")
			}
			var err error
			if cfg.Filename, err = imageOptsArg(cmd, env, imageOpts, args[0], nil); err != nil {
				return err
			}
			return env.Snapshot(cmd.Context(), cfg)
		},
	}
	f := cmd.Flags()
	f.BoolVarP(&list, "list", "l", false, "list the snapshots")
	f.StringVarP(&apply, "apply", "a", "", "revert the image to a snapshot")
	f.StringVarP(&create, "create", "c", "", "create a snapshot")
	f.StringVarP(&del, "delete", "d", "", "delete a snapshot")
	f.BoolVarP(&cfg.Quiet, "quiet", "q", false, "quiet (there is no output to hide but the list)")
	f.BoolVarP(&forceShare, "force-share", "U", false, "open the image even if it is in use")
	addImageOpts(cmd.Flags(), &imageOpts)
	return cmd
}
