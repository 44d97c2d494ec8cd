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
	"fmt"
	"io"
	"os"

	"github.com/ovis-storage/ovis/cmd/ovis/internal/img"
	"github.com/ovis-storage/ovis/qcow2"
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
		report(os.Stderr, err)
		os.Exit(128 + int(sig))
	}
	if err != nil {
		os.Exit(exit(os.Stderr, err))
	}
}

// exit reports err and returns the process's exit status: 1, or the code
// an *img.ExitError carries (qemu-img check and compare have their own),
// whose nil Err reports nothing.
func exit(w io.Writer, err error) int {
	var ee *img.ExitError
	if errors.As(err, &ee) {
		if ee.Err != nil {
			report(w, ee.Err)
		}
		return ee.Code
	}
	report(w, err)
	return 1
}

// report prints err as qemu-img's error_report does, with "ovis: " for
// "qemu-img: ". An errors.Join of several errors is several reports, one
// prefixed line each; a usage error is followed by a pointer to --help.
func report(w io.Writer, err error) {
	// QEMU reports a corruption event (an allocation refused for
	// overlapping metadata) when it happens, before the operation fails.
	var ev *qcow2.CorruptionEvent
	if errors.As(err, &ev) {
		fmt.Fprintln(w, ev.Message())
	}
	if j, ok := err.(interface{ Unwrap() []error }); ok {
		for _, e := range j.Unwrap() {
			fmt.Fprintf(w, "ovis: %v\n", e)
		}
	} else {
		fmt.Fprintf(w, "ovis: %v\n", err)
	}
	if errors.Is(err, img.ErrUsage) {
		fmt.Fprintln(w, "Try 'ovis --help' for more information")
	}
}
