// Command ovis is the single binary of the ovis block-storage stack: image
// tools (ovis img), and the node that serves disks (ovis up).
//
// Errors are printed to stderr as "ovis: <message>" and exit with status 1,
// as qemu-img does with "qemu-img: <message>". An img verb stopped by
// SIGINT or SIGTERM exits with 128 plus the signal's number.
package main

import (
	"context"
	"errors"
	"os"

	"github.com/ovis-storage/ovis/cmd/ovis/internal/img"
)

func main() {
	in, ctx := notifyInterrupts(context.Background(), os.Stderr)
	err := newRootCmd().ExecuteContext(ctx)
	in.stop()
	if sig := in.signal(); sig != 0 && imgVerb.Load() && err != nil {
		// qemu-img dies of the signal; a shell reports 128 plus its number.
		if errors.Is(err, context.Canceled) && err.Error() == context.Canceled.Error() {
			err = context.Cause(ctx)
		}
		img.Report(os.Stderr, err)
		os.Exit(128 + int(sig))
	}
	if err != nil {
		os.Exit(img.Exit(os.Stderr, err))
	}
}
