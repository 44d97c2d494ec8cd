package convert

import (
	"errors"
	"fmt"
)

// Op names the step of a copy that failed.
type Op string

// The steps of a copy.
const (
	OpBlockStatus     Op = "block status"     // querying the source's extents
	OpRead            Op = "read"             // reading the source
	OpWrite           Op = "write"            // writing or zeroing the output
	OpCompress        Op = "compress"         // compressing a cluster
	OpWriteCompressed Op = "write compressed" // storing a compressed cluster
	OpFlush           Op = "flush"            // flushing the output at the end
)

// Error is a failed step of a copy, at an offset of the source (the same
// offset on the output). Callers that print their own messages (the CLI
// prints qemu-img's) switch on Op.
type Error struct {
	Op Op
	// Off is the byte offset, or -1 for a step that has none (a flush,
	// or setting up compression).
	Off int64
	Err error
}

func (e *Error) Error() string {
	if e.Off < 0 {
		return fmt.Sprintf("convert: %s: %v", e.Op, e.Err)
	}
	return fmt.Sprintf("convert: %s at byte %d: %v", e.Op, e.Off, e.Err)
}

func (e *Error) Unwrap() error { return e.Err }

// Errors Copy returns before it copies anything.
var (
	// ErrCompressUnsupported: Options.Compress with an output that is
	// not a qcow2 image.
	ErrCompressUnsupported = errors.New("convert: compression needs a qcow2 output")
	// ErrOutputTooSmall: the output is shorter than the source.
	ErrOutputTooSmall = errors.New("convert: the output is smaller than the source")
)

// errEmptyExtent is a source whose block status covers nothing.
var errEmptyExtent = errors.New("empty extent")
