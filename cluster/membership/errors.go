package membership

import (
	"errors"
	"fmt"
)

// Errors callers test for with errors.Is. Every error a method returns
// wraps one of these or an etcd error, with context naming the key or
// value at fault.
var (
	// ErrClosed is returned by a Client or Registration used after Close
	// or Leave.
	ErrClosed = errors.New("membership: closed")
	// ErrNotFormatted means the cluster has no format record yet.
	ErrNotFormatted = errors.New("cluster is not formatted")
	// ErrFormatted means Format found a format record and force was not
	// given.
	ErrFormatted = errors.New("cluster is already formatted (use force to reformat)")
	// ErrNoEpoch means no node has ever joined, or the asked epoch was
	// never written or has been trimmed.
	ErrNoEpoch = errors.New("no such epoch")
	// ErrNoVDI means no VDI has the given name or id.
	ErrNoVDI = errors.New("no such vdi")
	// ErrVDIExists means a VDI already has the name.
	ErrVDIExists = errors.New("vdi already exists")
	// ErrInvalid marks a value refused by validation (a name, size,
	// copies or object size); nothing was changed.
	ErrInvalid = errors.New("invalid")
	// ErrDuplicateNode means a live node is registered under the ID.
	ErrDuplicateNode = errors.New("node id is already registered by a live node")
	// ErrFenced means the registration's lease is lost or could not be
	// renewed in time: the node must stop serving.
	ErrFenced = errors.New("registration fenced")
	// ErrNotLocked means the VDI has no lock, or the lock is no longer
	// the one the caller holds (broken, or expired with its lease).
	ErrNotLocked = errors.New("vdi is not locked by this holder")
	// ErrTakenOver means Relock found that another holder took the VDI's
	// lock after the caller's lock was lost.
	ErrTakenOver = errors.New("another holder took the vdi's lock meanwhile")
)

// LockedError is returned by Lock and DeleteVDI when another holder has
// the VDI's lock.
type LockedError struct {
	Name, Holder string
}

func (e *LockedError) Error() string { return fmt.Sprintf("vdi %q is locked by %s", e.Name, e.Holder) }
