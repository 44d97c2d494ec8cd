package img

import (
	"errors"
	"fmt"
	"io/fs"
	"strings"
	"syscall"

	"github.com/ovis-storage/ovis/block"
	"github.com/ovis-storage/ovis/qcow2"
)

// strerror renders an error the way C's strerror does where it can: the
// errno text with a capital first letter ("No such file or directory").
// Errors that carry no errno keep their own text.
func strerror(err error) string {
	var errno syscall.Errno
	if errors.As(err, &errno) {
		s := errno.Error()
		if s != "" {
			return strings.ToUpper(s[:1]) + s[1:]
		}
	}
	var pe *fs.PathError
	if errors.As(err, &pe) {
		return strerror(pe.Err)
	}
	return err.Error()
}

// openReason says why an image could not be opened, in QEMU's words where
// the cause is one QEMU reports too.
func openReason(err error) string {
	var pe *fs.PathError
	var fe *qcow2.FormatError
	var le *block.LockError
	var ue *qcow2.FeaturesError
	switch {
	case errors.As(err, &le):
		return le.Error()
	case errors.As(err, &ue):
		return "Unsupported qcow2 feature(s): " + ue.List
	case errors.As(err, &pe):
		return fmt.Sprintf("Could not open '%s': %s", pe.Path, strerror(pe.Err))
	case errors.As(err, &fe):
		return "Image is not in qcow2 format"
	}
	return err.Error()
}

// openError is qemu-img's message for an image it cannot open:
// "Could not open 'x': Could not open 'x': No such file or directory".
func (e *Env) openError(path string, err error) error {
	return wrapMsg(err, "Could not open '%s': %s", e.displayName(path), openReason(err))
}

// msgError carries QEMU's wording for a failure while keeping the cause
// for errors.Is and errors.As.
type msgError struct {
	msg string
	err error
}

func (e *msgError) Error() string { return e.msg }
func (e *msgError) Unwrap() error { return e.err }

// wrapMsg returns an error whose text is the formatted message alone and
// which unwraps to err.
func wrapMsg(err error, format string, args ...any) error {
	return &msgError{msg: fmt.Sprintf(format, args...), err: err}
}

// ErrUsage marks errors about the command line itself (a missing or extra
// argument); callers print a hint to read --help after them, as qemu-img
// does.
var ErrUsage = errors.New("usage error")

// UsageError returns a usage error with the given message.
func UsageError(format string, args ...any) error {
	return wrapMsg(ErrUsage, format, args...)
}
