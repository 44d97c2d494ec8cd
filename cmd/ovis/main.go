// Command ovis is the single binary of the ovis block-storage stack: image
// tools (ovis img), and the node that serves disks (ovis up).
//
// Errors are printed to stderr as "ovis: <message>" and exit with status 1,
// as qemu-img does with "qemu-img: <message>".
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"

	"github.com/ovis-storage/ovis/cmd/ovis/internal/img"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := newRootCmd().ExecuteContext(ctx)
	stop()
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
