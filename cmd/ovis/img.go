package main

import (
	"github.com/spf13/cobra"

	"github.com/ovis-storage/ovis/cmd/ovis/internal/img"
)

// newImgCmd is `ovis img`, qemu-img's verbs with qemu-img's syntax.
func newImgCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "img",
		Short: "Create, inspect and convert disk images (qemu-img compatible)",
		Long: "ovis img implements qemu-img 7.2's verbs for the qcow2 and raw formats, with\n" +
			"qemu-img's arguments, output, messages and exit codes.\n\n" +
			"--untrusted (an ovis addition) is for images from someone\n" +
			"else: a backing file or external data file must then be a regular file in the\n" +
			"image's own folder, after symlinks are resolved; anything else is refused.\n" +
			"Formats are not probed: the image's format must be given (-f), and a backing\n" +
			"file must have its format recorded in the image.",
	}
	cmd.PersistentFlags().Bool("untrusted", false, "refuse format probing (-f required), and backing and data files outside the image's folder or not regular files")
	cmd.PersistentPreRun = func(*cobra.Command, []string) { imgVerb.Store(true) }
	cmd.AddCommand(newImgCreateCmd(), newImgInfoCmd(), newImgConvertCmd(), newImgCheckCmd(), newImgMapCmd(), newImgCompareCmd(), newImgSnapshotCmd(), newImgResizeCmd(), newImgRebaseCmd(), newImgCommitCmd(), newImgMeasureCmd(), newImgBenchCmd(), newImgAmendCmd(), newImgDDCmd(), newImgBitmapCmd())
	return cmd
}

// newEnv is what the verb cmd runs on: the img command's --untrusted, the
// verb's -U (forceShare), and the command's writers. Each invocation gets
// its own.
func newEnv(cmd *cobra.Command, forceShare bool) *img.Env {
	// The img command's persistent flag, merged into the verb's flags.
	untrusted, _ := cmd.Flags().GetBool("untrusted")
	return &img.Env{
		Stdout:     cmd.OutOrStdout(),
		Stderr:     cmd.ErrOrStderr(),
		Untrusted:  untrusted,
		ForceShare: forceShare,
	}
}
