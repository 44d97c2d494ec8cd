package img

import "fmt"

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
