package qcow2

import "github.com/ovis-storage/ovis/block"

// A cluster the L2 table maps can still be a hole in the host file: after
// preallocation=metadata, or under a raw data file that was never written.
// Such a cluster reads as zeros, and saying so in block status lets an NBD
// read of it go out as a hole without reading the disk, as QEMU does.
//
// Finding out costs lseek calls. dataRun remembers the last run of the
// host file found to hold data, as QEMU's block-status cache does; it
// never goes stale because ovis never punches holes in, or shrinks, the
// files of an open image, so a run once data stays data. Holes are not
// remembered: a write can fill them at any time.
type dataRun struct{ lo, hi int64 }

// hostHole reports whether host offset off of the data file starts a hole
// and how long the hole, or the data run, is within n bytes.
func (img *Image) hostHole(off, n int64) (bool, int64) {
	if r := img.dataRun.Load(); r != nil && r.lo <= off && off+n <= r.hi {
		return false, n
	}
	hole, end, ok := block.FileRun(img.data, off)
	if !ok {
		return false, n
	}
	if !hole {
		img.dataRun.Store(&dataRun{lo: off, hi: end})
	}
	return hole, min(n, end-off)
}

var _ block.NoWaitReader = (*Image)(nil)

// ReadNoWait serves a read without waiting for a disk, or returns false
// (block.NoWaitReader). It succeeds when every L2 slice the range needs
// is cached and every piece is zeros, unallocated without a backing file
// (or with one that serves it likewise), a hole of the host file, or data
// the host file's ReadNoWait finds in the page cache. Compressed clusters
// and anything needing a table load fall back to ReadAt.
func (img *Image) ReadNoWait(p []byte, off int64) bool {
	if !img.gate.TryRLock() {
		return false
	}
	defer img.gate.RUnlock()
	if block.CheckRange(off, int64(len(p)), img.size) != nil || len(p) == 0 {
		return false
	}
	var segsBuf [4]segment
	img.mu.Lock()
	if img.closed {
		img.mu.Unlock()
		return false
	}
	segs, err := img.mapRangeLocked(off, int64(len(p)), segsBuf[:0])
	var total int64
	for _, s := range segs {
		total += s.n
	}
	if err != nil || total != int64(len(p)) {
		// A table to load (mapRangeLocked maps only what is cached
		// before it asks), or an error that ReadAt will report.
		img.mu.Unlock()
		return false
	}
	epoch := img.enterLocked()
	img.mu.Unlock()
	defer img.exit(epoch)

	done := int64(0)
	for _, s := range segs {
		q := p[done : done+s.n]
		switch s.kind {
		case kindZero:
			clear(q)
		case kindUnalloc:
			switch {
			case img.backing == nil || off+done >= img.backing.Size():
				clear(q)
			case off+done+s.n <= img.backing.Size():
				if !block.ReadNoWait(img.backing, q, off+done) {
					return false
				}
			default:
				return false
			}
		case kindData:
			if hole, l := img.hostHole(int64(s.host), s.n); hole && l == s.n {
				clear(q)
			} else if !block.ReadNoWait(img.data, q, int64(s.host)) {
				return false
			}
		default:
			return false
		}
		done += s.n
	}
	return true
}
