package block

import (
	"golang.org/x/sys/unix"
)

// NoWaitReader is implemented by devices and files that can sometimes
// serve a read at once, without waiting for a disk: from zero or
// unallocated ranges, holes, or the host page cache.
//
// ReadNoWait either fills all of p and returns true, or returns false
// (p's contents are then undefined) and the caller reads with ReadAt. It
// never waits for device I/O, so a server can call it on the goroutine
// that reads requests and answer at once, and hand only the reads that
// must wait to other goroutines. Every handoff between goroutines costs
// more CPU than a read served from memory.
type NoWaitReader interface {
	ReadNoWait(p []byte, off int64) bool
}

// ReadNoWait calls the ReadNoWait of d, or of the first device under d's
// wrappers that has one, else returns false.
func ReadNoWait(d any, p []byte, off int64) bool {
	if r, ok := d.(NoWaitReader); ok {
		return r.ReadNoWait(p, off)
	}
	if dev, ok := d.(Device); ok {
		if r, ok := As[NoWaitReader](dev); ok {
			return r.ReadNoWait(p, off)
		}
	}
	return false
}

// ReadNoWait reads p from the page cache with preadv2(RWF_NOWAIT), which
// fails with EAGAIN rather than wait for the disk. A short read (part of
// the range not cached, or the end of the file) returns false.
func (o *OSFile) ReadNoWait(p []byte, off int64) bool {
	if len(p) == 0 {
		return true
	}
	n, err := unix.Preadv2(int(o.f.Fd()), [][]byte{p}, off, unix.RWF_NOWAIT)
	return err == nil && n == len(p)
}

// ReadNoWait reads through the file's own ReadNoWait (the page cache),
// when it has one.
func (r *Raw) ReadNoWait(p []byte, off int64) bool {
	if r.begin(off, int64(len(p)), false) != nil {
		return false
	}
	defer r.mu.RUnlock()
	return ReadNoWait(r.f, p, off)
}
