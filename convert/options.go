package convert

import (
	"fmt"
	"runtime"
)

// Limits and defaults of Options, those of qemu-img convert.
const (
	// DefaultWorkers is how many requests run at once when
	// Options.Workers is 0 (qemu-img's -m default).
	DefaultWorkers = 8
	// MaxWorkers bounds Options.Workers (qemu-img's MAX_COROUTINES).
	MaxWorkers = 16
	// DefaultMinSparse is Options.MinSparse when it is 0: all-zero runs
	// of 4 KiB inside data are not written.
	DefaultMinSparse = 4096
	// MaxMinSparse bounds Options.MinSparse (qemu-img's
	// MAX_BUF_SECTORS, 16 MiB).
	MaxMinSparse = 32768 * 512
)

// Options says how Copy copies. The zero value is a valid, cautious copy:
// DefaultWorkers requests at once, writes in ascending order, zero
// detection with DefaultMinSparse, every zero range written, no limit.
type Options struct {
	// Workers is how many requests run at once, 1 to MaxWorkers. The
	// default (0) is DefaultWorkers. With Compress there is at least one
	// per CPU, so that every core compresses.
	Workers int
	// OutOfOrder lets the writes complete in any order. By default reads
	// (and zero detection and compression) run in parallel but the writes
	// are made one at a time in ascending offset order: a qcow2 output
	// gets its clusters in guest order, so that its layout does not
	// depend on timing, and an interrupted copy leaves a prefix of the
	// source. Out of order is faster.
	OutOfOrder bool
	// MinSparse is the length of the shortest all-zero run inside data
	// that is zeroed (maybe deallocated) instead of written: a multiple
	// of 512 up to MaxMinSparse. The default (0) is DefaultMinSparse. A
	// negative value turns zero detection off: every byte is written,
	// zero ranges of the source too, which allocates the whole output
	// (qemu-img's -S 0).
	MinSparse int64
	// TargetIsZero promises that the output reads as zeros already (a
	// new image with no backing file, say): the ranges the source
	// reports as zero are then not written. Ignored when MinSparse is
	// negative.
	TargetIsZero bool
	// TopOnly copies only the source's own layer (the extents of Depth
	// 1); what lies below it is left to the output's backing file, which
	// must hold what the source's backing chain holds.
	TopOnly bool
	// BackingEnd, when HasBackingEnd, is where the output's backing file
	// ends, in bytes: past it the output reads zeros where it holds
	// nothing, so the ranges the source reports as zero are left
	// unallocated there (zeros found inside data are still written).
	BackingEnd    int64
	HasBackingEnd bool
	// Compress writes every cluster compressed. The output must be a
	// qcow2 image (found with block.As), or Copy returns
	// ErrCompressUnsupported.
	Compress bool
	// CopyRange copies data between two raw files (*block.Raw) inside
	// the kernel with copy_file_range where it can, and through memory
	// where not (for good once the kernel refuses).
	CopyRange bool
	// Salvage reads what can be read: a range that fails to read is read
	// again sector by sector, and each sector that still fails is
	// written as zeros; a failed block status query is retried on a
	// shorter range, down to one sector, which is then taken as data.
	Salvage bool
	// Salvaged, if not nil, is told of each sector Salvage zeroed (an
	// *Error with Op OpRead) and of each block status query it gave up
	// (Op OpBlockStatus). Calls are serialized.
	Salvaged func(err *Error)
	// RateLimit caps the bytes written per second; 0 does not limit.
	// Zeroed ranges count by their length, compressed clusters by their
	// uncompressed length.
	RateLimit int64
	// Progress, if not nil, is called as the copy advances with the
	// bytes of the source done so far (written, zeroed, or found to need
	// no write) and the source's size. Calls are serialized, and done
	// never decreases.
	Progress func(done, total int64)
	// DataProgress, if not nil, is called with the data (the ranges
	// that are read, not those that are zero) handed to the workers so
	// far, and the total counted by a first pass over the source's
	// extents, both in bytes with each range rounded up to whole 512-byte
	// sectors. It is called once per buffer (2 MiB, or one cluster with
	// Compress), and a qcow2 source's data is cut where its clusters stop
	// being contiguous in the host file: the steps of qemu-img convert's
	// progress figure. Called from one goroutine.
	DataProgress func(queued, total int64)
}

// Validate reports the first option out of its bounds, naming its value.
func (o *Options) Validate() error {
	switch {
	case o.Workers < 0 || o.Workers > MaxWorkers:
		return fmt.Errorf("convert: Workers %d out of [0, %d]", o.Workers, MaxWorkers)
	case o.MinSparse > 0 && (o.MinSparse%512 != 0 || o.MinSparse > MaxMinSparse):
		return fmt.Errorf("convert: MinSparse %d is not a multiple of 512 up to %d", o.MinSparse, MaxMinSparse)
	case o.RateLimit < 0:
		return fmt.Errorf("convert: negative RateLimit %d", o.RateLimit)
	case o.HasBackingEnd && o.BackingEnd < 0:
		return fmt.Errorf("convert: negative BackingEnd %d", o.BackingEnd)
	}
	return nil
}

// workers is how many workers the copy runs.
func (o *Options) workers() int {
	n := o.Workers
	if n == 0 {
		n = DefaultWorkers
	}
	if o.Compress {
		n = max(n, runtime.NumCPU())
	}
	return n
}

// minSparse is the zero detection threshold, 0 for none.
func (o *Options) minSparse() int64 {
	switch {
	case o.MinSparse == 0:
		return DefaultMinSparse
	case o.MinSparse < 0:
		return 0
	}
	return o.MinSparse
}
