package store

import "errors"

// Errors a Store returns. Returned errors wrap them with the object or
// VDI they concern; test with errors.Is.
var (
	// ErrNotFound: the object does not exist on this node.
	ErrNotFound = errors.New("store: object not found")
	// ErrSuspect: this node's copy may be torn or stale after a crash or
	// an I/O error, and must be repaired from a peer (Put) or cleared
	// (ClearSuspect) before it is served or written again.
	ErrSuspect = errors.New("store: copy suspect, needs repair")
	// ErrStaleToken: the request's fencing token is lower than the
	// highest this node has seen for the VDI. Nothing was changed.
	ErrStaleToken = errors.New("store: stale fencing token")
	// ErrNoSpace: the write would leave less than Options.Reserve bytes
	// free, or the file system returned ENOSPC. It wraps unix.ENOSPC.
	ErrNoSpace = errors.New("store: no space")
	// ErrClosed: the Store was closed.
	ErrClosed = errors.New("store: closed")
	// ErrRange: an offset or length lies outside an object of
	// MaxObjectSize bytes, or is negative, or the id names VDI 0.
	ErrRange = errors.New("store: range outside object")
	// ErrNotNewer: Put or PutTombstone was given a version no newer than
	// the copy this node holds, which is neither missing nor suspect.
	// Nothing was changed.
	ErrNotNewer = errors.New("store: copy held is not older")
	// ErrCorrupt: a file of the store does not have the expected format.
	ErrCorrupt = errors.New("store: corrupt")
)
