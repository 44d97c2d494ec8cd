package main

import "github.com/spf13/cobra"

// newRootCmd builds the ovis command tree.
func newRootCmd() *cobra.Command {
	root := &cobra.Command{
		Use:           "ovis",
		Short:         "ovis: qcow2 engine, NBD server and replicated block storage",
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.AddCommand(newImgCmd(), newNBDCmd(), newUpCmd(), newNodeCmd(), newClusterCmd(), newVDICmd())
	return root
}
