// Package block defines the block-device interface every ovis backend
// implements (qcow2 images, raw files, cluster VDIs) and that the NBD server
// serves, plus the raw-file backend and QEMU's cache modes.
//
// The package imports no other ovis package.
package block

import (
	"errors"
	"io"
)

// Device is a virtual disk of fixed size addressed in bytes.
//
// Offsets and lengths need not be aligned. A request that reaches past Size
// fails with ErrOutOfRange and transfers nothing.
//
// Implementations are safe for concurrent use: requests may overlap in time
// and complete in any order. Release with Close.
type Device interface {
	io.ReaderAt

	// WriteAt writes p at off. With fua set, the data (and the metadata
	// needed to read it back) is durable when WriteAt returns. A backend
	// may make other completed writes durable on the way, and ovis's do:
	// Raw fdatasyncs the whole file and qcow2 runs a full Flush.
	WriteAt(p []byte, off int64, fua bool) (int, error)

	// WriteZeroes makes [off, off+n) read as zeros. With mayUnmap the
	// device may deallocate the range; without it, the range stays
	// allocated (NBD's NO_HOLE). fua is as for WriteAt.
	WriteZeroes(off, n int64, mayUnmap bool, fua bool) error

	// Discard hints that [off, off+n) is no longer needed. Afterwards the
	// range reads either as before or as zeros; backends document which.
	Discard(off, n int64) error

	// Flush makes every completed write durable.
	Flush() error

	// Extent describes the run of equal status that starts at off, at most
	// n bytes long. It never returns a zero Length for a range inside the
	// device.
	Extent(off, n int64) (Extent, error)

	// Size is the virtual size in bytes.
	Size() int64

	// Close flushes and releases the device. A second Close returns
	// ErrClosed.
	Close() error
}

// Status is the allocation state of a range, as NBD's base:allocation and
// qemu-img map report it.
type Status uint8

const (
	// StatusData: the range is allocated and holds data.
	StatusData Status = 0
	// StatusHole is set when the range holds no data in any layer: it is
	// unallocated, or a zero cluster (NBD_STATE_HOLE, as qemu-nbd reports
	// it). Depth tells the two apart.
	StatusHole Status = 1 << 0
	// StatusZero is set when the range reads as zeros (NBD_STATE_ZERO).
	StatusZero Status = 1 << 1
)

// Extent is one run of uniform status.
type Extent struct {
	Length int64
	Status Status
	// Depth is how many layers down the backing chain the data lives:
	// 1 for this image, 2 for its backing file, 0 when no layer has it
	// (qemu:allocation-depth).
	Depth int
}

var (
	// ErrOutOfRange is returned for requests beyond the end of the device.
	ErrOutOfRange = errors.New("block: request beyond end of device")
	// ErrReadOnly is returned for writes to a device opened read-only.
	ErrReadOnly = errors.New("block: device is read-only")
	// ErrClosed is returned by operations on a closed device.
	ErrClosed = errors.New("block: device is closed")
)

// CheckRange returns ErrOutOfRange unless [off, off+n) lies inside a device
// of the given size.
func CheckRange(off, n, size int64) error {
	if off < 0 || n < 0 || off > size || n > size-off {
		return ErrOutOfRange
	}
	return nil
}
