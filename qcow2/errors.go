package qcow2

import (
	"errors"
	"fmt"
)

// CorruptError reports an image whose metadata breaks the format's rules.
// Callers test for it with errors.As; it names the structure and offset.
type CorruptError struct {
	Msg string
}

func (e *CorruptError) Error() string { return "qcow2: corrupt image: " + e.Msg }

func corruptf(format string, args ...any) error {
	return &CorruptError{Msg: fmt.Sprintf(format, args...)}
}

// FormatError reports a file that is not a qcow2 image at all.
type FormatError struct {
	Msg string
}

func (e *FormatError) Error() string { return "qcow2: " + e.Msg }

// UnsupportedError reports a valid image that uses a feature ovis does not
// implement (encryption, unknown incompatible bits).
type UnsupportedError struct {
	Feature string
}

func (e *UnsupportedError) Error() string { return "qcow2: unsupported feature: " + e.Feature }

// IsCorrupt reports whether err is (or wraps) a *CorruptError.
func IsCorrupt(err error) bool {
	var c *CorruptError
	return errors.As(err, &c)
}

// ErrCorruptFlag is returned for writes to an image whose corrupt bit is
// set; such images open read-only.
var ErrCorruptFlag = errors.New("qcow2: image is marked corrupt; it can only be opened read-only")
