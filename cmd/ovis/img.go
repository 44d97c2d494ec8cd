package main

import "github.com/spf13/cobra"

// newImgCmd is `ovis img`, qemu-img's verbs with qemu-img's syntax.
func newImgCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "img",
		Short: "Create, inspect and convert disk images (qemu-img compatible)",
		Long: "ovis img implements qemu-img's create, info and convert for the qcow2 and raw\n" +
			"formats, with qemu-img 7.2's arguments, output and messages.",
	}
	cmd.AddCommand(newImgCreateCmd(), newImgInfoCmd(), newImgConvertCmd(), newImgCheckCmd(), newImgMapCmd(), newImgCompareCmd(), newImgSnapshotCmd(), newImgResizeCmd(), newImgRebaseCmd(), newImgCommitCmd(), newImgMeasureCmd(), newImgBenchCmd())
	return cmd
}
