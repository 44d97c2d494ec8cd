package qcow2

import (
	"errors"
	"fmt"
	"strings"
	"syscall"
)

// This file holds what Check reports: the repair modes, the repairs made,
// the result's counters and messages, and the error and number formatting
// (strerror words, C's %#x) and the corruption event that match qemu-img
// check's output.

// RepairMode selects what Check repairs (qemu-img check -r).
type RepairMode int

const (
	RepairNone  RepairMode = iota
	RepairLeaks            // -r leaks
	RepairAll              // -r all
)

// ErrNeedRebuild is returned by Check with RepairLeaks when the refcount
// structures are too broken to repair in place (QEMU fails with EIO and
// "ERROR need to rebuild refcount structures"; -r all rebuilds them).
var ErrNeedRebuild = fmt.Errorf("qcow2: refcount structures need a rebuild: %w", syscall.EIO)

// RepairKind says what one repair changed.
type RepairKind int

const (
	// RepairRefcount set cluster Cluster's refcount from Before to After.
	RepairRefcount RepairKind = iota + 1
	// RepairCopiedL1 rewrote L1 entry Index from Before to After (COPIED).
	RepairCopiedL1
	// RepairCopiedL2 rewrote an L2 entry from Before to After (COPIED);
	// Offset is the entry's position in the file.
	RepairCopiedL2
	// RepairMisaligned turned a misaligned preallocated zero entry at
	// Offset (Before) into a plain zero entry (After).
	RepairMisaligned
	// RepairRefblockOutside grew the file so that refcount block Index,
	// at Offset, lies inside it.
	RepairRefblockOutside
	// RepairRebuild wrote a new refcount table at Offset (After clusters)
	// and new refcount blocks in free clusters.
	RepairRebuild
)

// Repair is one change Check made to the image, in the order made.
type Repair struct {
	Kind          RepairKind
	Cluster       int64
	Index         int64
	Offset        uint64
	Before, After uint64
}

// CheckResult is what Check found, with qemu-img check's counters.
type CheckResult struct {
	CheckErrors        int
	Corruptions        int
	Leaks              int
	CorruptionsFixed   int
	LeaksFixed         int
	ImageEndOffset     int64
	TotalClusters      int64
	AllocatedClusters  int64
	FragmentedClusters int64
	CompressedClusters int64
	// Messages are the lines qemu-img prints on stderr for each problem
	// found or repaired, in order and in QEMU's wording.
	Messages []string
	// Repairs are the changes made to the image, in order.
	Repairs []Repair
}

func (r *CheckResult) msg(format string, args ...any) {
	r.Messages = append(r.Messages, fmt.Sprintf(format, args...))
}

// counters returns r without its message and repair lists: QEMU saves and
// restores its counters between passes, but what it printed stays printed.
func (r *CheckResult) counters() CheckResult {
	c := *r
	c.Messages, c.Repairs = nil, nil
	return c
}

func (r *CheckResult) setCounters(c CheckResult) {
	c.Messages, c.Repairs = r.Messages, r.Repairs
	*r = c
}

// repairing is QEMU's prefix for a problem that is being repaired.
func repairing(fixing bool) string {
	if fixing {
		return "Repairing"
	}
	return "ERROR"
}

// strerrorOf is err's errno as C's strerror words it, or err's text.
func strerrorOf(err error) string {
	var errno syscall.Errno
	if errors.As(err, &errno) {
		s := errno.Error()
		return strings.ToUpper(s[:1]) + s[1:]
	}
	return err.Error()
}

// errIO is EIO as qemu-img prints it; errors.Is(errIO, syscall.EIO).
var errIO error = ioError{}

type ioError struct{}

func (ioError) Error() string        { return "Input/output error" }
func (ioError) Is(target error) bool { return target == syscall.EIO }

// cHex formats v as C's %#x does: 0 has no prefix.
func cHex(v uint64) string {
	if v == 0 {
		return "0"
	}
	return fmt.Sprintf("%#x", v)
}

// signalCorruptionLocked reports a corruption event as QEMU's
// qcow2_signal_corruption does: only the first one is printed, and a
// writable image is marked corrupt on disk.
func (img *Image) signalCorruptionLocked(res *CheckResult, format string, args ...any) {
	if img.corruptSignalled {
		return
	}
	img.corruptSignalled = true
	what := fmt.Sprintf(format, args...)
	if img.ro {
		res.msg("qcow2: Image is corrupt: %s; further non-fatal corruption events will be suppressed", what)
		return
	}
	res.msg("qcow2: Marking image as corrupt: %s; further corruption events will be suppressed", what)
	img.hdr.IncompatibleFeatures |= IncompatCorrupt
	if err := img.writeHeaderLocked(); err != nil {
		res.CheckErrors++
		res.msg("ERROR: marking the image corrupt: %v", err)
	}
}
