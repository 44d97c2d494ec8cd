package img

import (
	"errors"
	"fmt"
	"io"

	"github.com/ovis-storage/ovis/qcow2"
)

// ExitError ends an `ovis img` verb with a status other than the usual 1,
// as qemu-img's check (2 corrupt, 3 leaks, 63 unsupported) and compare (1
// different, 2 open failure, 3 and 4 I/O failures) do. Err, when not nil,
// is reported first as any other error; a nil Err reports nothing, the
// verb having printed what it had to say.
type ExitError struct {
	Code int
	Err  error
}

func (e *ExitError) Error() string {
	if e.Err == nil {
		return fmt.Sprintf("exit status %d", e.Code)
	}
	return e.Err.Error()
}

func (e *ExitError) Unwrap() error { return e.Err }

// exitWith returns an ExitError for code that reports err (which may be
// nil).
func exitWith(code int, err error) error {
	return &ExitError{Code: code, Err: err}
}

// Exit reports err on w (Report) and returns the exit status of the
// `ovis img` verb it ended: 1, or the code an *ExitError carries (qemu-img
// check and compare have their own), whose nil Err reports nothing.
func Exit(w io.Writer, err error) int {
	var ee *ExitError
	if errors.As(err, &ee) {
		if ee.Err != nil {
			Report(w, ee.Err)
		}
		return ee.Code
	}
	Report(w, err)
	return 1
}

// Report prints err on w as qemu-img's error_report does, with "ovis: "
// for "qemu-img: ". An errors.Join of several errors is several reports,
// one prefixed line each; a usage error (ErrUsage) is followed by a
// pointer to --help, and a corruption event (*qcow2.CorruptionEvent) is
// preceded by QEMU's line for it, which QEMU prints when the event
// happens, before the operation fails.
func Report(w io.Writer, err error) {
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
	if errors.Is(err, ErrUsage) {
		fmt.Fprintln(w, "Try 'ovis --help' for more information")
	}
}
