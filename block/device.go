// Package block defines the block-device interface every ovis backend
// implements (qcow2 images, raw files, cluster VDIs) and that the NBD server
// serves, plus the raw-file backend and QEMU's cache modes.
//
// The package imports no other ovis package.
package block

import (
	"context"
	"errors"
	"fmt"
	"io"
)

// Device is a virtual disk of fixed size addressed in bytes.
//
// Offsets and lengths need not be aligned. A request that reaches past Size
// fails with ErrOutOfRange and transfers nothing.
//
// Every method that can wait takes a context first. A local backend may
// only check it where it waits for other requests (a lock, a cluster
// claim, a table load); a network backend gives up on its round trips
// when it is cancelled. A cancelled request returns an error that wraps
// ctx.Err() and may have been partly done, as a request interrupted by a
// crash may be: writes are never acknowledged unless they completed.
//
// Implementations are safe for concurrent use: requests may overlap in time
// and complete in any order. Release with Close.
type Device interface {
	// ReadAt reads len(p) bytes at off. It returns len(p) and nil, or an
	// error.
	ReadAt(ctx context.Context, p []byte, off int64) (int, error)

	// WriteAt writes p at off. With FUA the data (and the metadata
	// needed to read it back) is durable when WriteAt returns. A backend
	// may make other completed writes durable on the way, and ovis's do:
	// Raw fdatasyncs the whole file and qcow2 runs a full Flush.
	// NoUnmap and NoFallback have no meaning for a write and are ignored.
	WriteAt(ctx context.Context, p []byte, off int64, f Flags) (int, error)

	// WriteZeroes makes [off, off+n) read as zeros. Without NoUnmap the
	// device may deallocate the range; with it, the range stays
	// allocated (NBD's NO_HOLE). With NoFallback the device fails with
	// ErrNoFallback, having changed nothing, unless it can zero the range
	// without writing zeros (NBD's FAST_ZERO). FUA is as for WriteAt.
	WriteZeroes(ctx context.Context, off, n int64, f Flags) error

	// Discard hints that [off, off+n) is no longer needed. Afterwards the
	// range reads either as before or as zeros; backends document which.
	// With FUA the result is durable when Discard returns.
	Discard(ctx context.Context, off, n int64, f Flags) error

	// Flush makes every completed write durable.
	Flush(ctx context.Context) error

	// Extents appends to dst the runs of equal status that cover
	// [off, off+n), in order, and returns the extended slice. The runs
	// have positive lengths that add up to n; n == 0 appends nothing.
	// Neighbouring runs may share a status. The caller bounds n: a
	// device may return a run per cluster of the range.
	Extents(ctx context.Context, off, n int64, dst []Extent) ([]Extent, error)

	// Size is the virtual size in bytes.
	Size() int64

	// Close flushes and releases the device. A second Close returns
	// ErrClosed.
	Close() error
}

// Flags modify one request. They map one to one onto NBD's command flags
// (and onto the cluster's node-to-node write message), so that a request
// crosses every layer with its meaning intact.
type Flags uint8

const (
	// FUA makes the request durable before it completes
	// (NBD_CMD_FLAG_FUA).
	FUA Flags = 1 << iota
	// NoUnmap keeps a zeroed range allocated (NBD_CMD_FLAG_NO_HOLE).
	NoUnmap
	// NoFallback refuses a zero write the device could only do by
	// writing zeros (NBD_CMD_FLAG_FAST_ZERO): it fails with
	// ErrNoFallback instead, having changed nothing.
	NoFallback
)

// Has reports whether every flag of g is set in f.
func (f Flags) Has(g Flags) bool { return f&g == g }

// String names the set flags ("FUA|NoUnmap"), for logs.
func (f Flags) String() string {
	var s string
	for _, n := range []struct {
		f    Flags
		name string
	}{{FUA, "FUA"}, {NoUnmap, "NoUnmap"}, {NoFallback, "NoFallback"}} {
		if f&n.f != 0 {
			if s != "" {
				s += "|"
			}
			s += n.name
		}
	}
	if s == "" {
		return "0"
	}
	return s
}

// FUAIf returns FUA when fua is set, else no flags: for callers that
// decide durability with a boolean.
func FUAIf(fua bool) Flags {
	if fua {
		return FUA
	}
	return 0
}

// ReaderAt adapts d to io.ReaderAt for callers (io.SectionReader,
// comparison loops) that cannot pass a context: every read uses ctx.
func ReaderAt(ctx context.Context, d Device) io.ReaderAt { return readerAt{ctx, d} }

type readerAt struct {
	ctx context.Context
	d   Device
}

func (r readerAt) ReadAt(p []byte, off int64) (int, error) { return r.d.ReadAt(r.ctx, p, off) }

// FirstExtent returns the first run of [off, off+n), for callers that
// walk a device one status at a time; they bound n, since the device
// maps the whole range. It has the zero Extent when n is 0.
func FirstExtent(ctx context.Context, d Device, off, n int64) (Extent, error) {
	var buf [8]Extent
	runs, err := d.Extents(ctx, off, n, buf[:0])
	if err != nil || len(runs) == 0 {
		return Extent{}, err
	}
	return runs[0], nil
}

// AppendRuns builds Extents from a function that reports the run at off
// (at most n bytes), for devices that find their runs one at a time. A
// run of no length inside the range is a bug in next, reported as an
// error rather than looped on.
func AppendRuns(off, n int64, dst []Extent, next func(off, n int64) (Extent, error)) ([]Extent, error) {
	for end := off + n; off < end; {
		e, err := next(off, end-off)
		if err != nil {
			return dst, err
		}
		if e.Length <= 0 {
			return dst, fmt.Errorf("block: extent of length %d at %d", e.Length, off)
		}
		e.Length = min(e.Length, end-off)
		dst = AppendExtent(dst, e)
		off += e.Length
	}
	return dst, nil
}

// AppendExtent appends e to runs, merging it into the last run when the two
// have the same status.
func AppendExtent(runs []Extent, e Extent) []Extent {
	if k := len(runs) - 1; k >= 0 && runs[k].Status == e.Status && runs[k].Depth == e.Depth {
		runs[k].Length += e.Length
		return runs
	}
	return append(runs, e)
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
	// ErrNoFallback is returned by WriteZeroes with NoFallback when the
	// device could zero the range only by writing zeros.
	ErrNoFallback = errors.New("block: zeroing would need a slow fallback")
)

// CheckRange returns ErrOutOfRange unless [off, off+n) lies inside a device
// of the given size.
func CheckRange(off, n, size int64) error {
	if off < 0 || n < 0 || off > size || n > size-off {
		return ErrOutOfRange
	}
	return nil
}

// ZeroFlags returns the flags of a zero write decided with booleans:
// NoUnmap unless mayUnmap, FUA if fua.
func ZeroFlags(mayUnmap, fua bool) Flags {
	f := FUAIf(fua)
	if !mayUnmap {
		f |= NoUnmap
	}
	return f
}
