package qcow2

import (
	"sort"

	"github.com/ovis-storage/ovis/block"
)

// A cluster the L2 table maps can still be a hole in the host file: after
// preallocation=metadata, or under a raw data file that was never written.
// Such a cluster reads as zeros, and saying so in block status lets an NBD
// read of it go out as a hole without reading the disk, as QEMU does.
//
// Finding out costs an lseek, which profiles of all-hit random reads put
// at a tenth of the server's CPU, so the runs found are remembered (as
// QEMU's block-status cache does, though QEMU keeps only one data run).
// There are many: a metadata-preallocated image has one hole per L2 table,
// between the table and the next. The set is copied on insert and read
// without a lock.
//
// A data run goes stale only when the open image itself punches or cuts
// its file (a shrinking resize; a discard with pass-discard-request on),
// and both clear the remembered runs afterwards. A hole run goes stale
// when a write fills part of it. Every write of guest data or compressed
// clusters goes through writeHost, which bumps hostGen before and after
// the write; hole runs are used only while hostGen is what it was before
// the lseeks that found them. Bumping before the write keeps a hole found
// during the write from being trusted after it (the lseek may or may not
// see the write); bumping after keeps one found just before the write
// from outliving it. A read overlapping an unfinished write may see
// either, as NBD allows.
//
// Metadata writes do not bump hostGen: a hole run is only consulted for
// clusters an L2 entry maps as data, and a cluster becomes data only
// through a data write, which bumps it.
type hostRun struct {
	lo, hi int64
	hole   bool
}

// hostRuns is an immutable set of runs, sorted by hi. Its hole runs hold
// while hostGen is gen.
type hostRuns struct {
	gen  uint64
	runs []hostRun
}

// maxHostRuns bounds the set; a full set starts over.
const maxHostRuns = 1024

// hostHole reports whether host offset off of the data file starts a hole
// and how long the hole, or the data run, is within n bytes.
func (img *Image) hostHole(off, n int64) (bool, int64) {
	gen := img.hostGen.Load()
	if rs := img.hostRuns.Load(); rs != nil {
		i := sort.Search(len(rs.runs), func(i int) bool { return rs.runs[i].hi > off })
		if i < len(rs.runs) && rs.runs[i].lo <= off {
			r := rs.runs[i]
			if !r.hole {
				return false, min(n, r.hi-off)
			}
			if rs.gen == gen {
				return true, min(n, r.hi-off)
			}
		}
	}
	img.hostLookups.Add(1)
	hole, end, ok := block.FileRun(img.data, off)
	if !ok {
		return false, n
	}
	img.addHostRun(hostRun{lo: off, hi: end, hole: hole}, gen)
	return hole, min(n, end-off)
}

// addHostRun remembers r, found by an lseek made while hostGen was gen.
func (img *Image) addHostRun(r hostRun, gen uint64) {
	img.hostRunsMu.Lock()
	defer img.hostRunsMu.Unlock()
	old := img.hostRuns.Load()
	next := &hostRuns{gen: gen}
	if old != nil {
		switch {
		case old.gen == gen:
			next.runs = old.runs
		case old.gen > gen:
			// A write came after this lookup began: r may be stale
			// if it is a hole, and the set is newer.
			if r.hole {
				return
			}
			next.gen = old.gen
			next.runs = old.runs
		default:
			// Writes came since the set was made: its holes are stale.
			for _, o := range old.runs {
				if !o.hole {
					next.runs = append(next.runs, o)
				}
			}
		}
	}
	runs := next.runs
	i := sort.Search(len(runs), func(i int) bool { return runs[i].hi >= r.hi })
	if i < len(runs) && runs[i].hi == r.hi && runs[i].hole == r.hole {
		// The same run, found from further down: lseek tells where a
		// run ends, not where it starts.
		if runs[i].lo <= r.lo {
			return
		}
	}
	out := make([]hostRun, 0, len(runs)+1)
	if len(runs) < maxHostRuns {
		out = append(out, runs[:i]...)
		out = append(out, r)
		if i < len(runs) && runs[i].hi == r.hi && runs[i].hole == r.hole {
			i++
		}
		out = append(out, runs[i:]...)
	} else {
		out = append(out, r)
	}
	next.runs = out
	img.hostRuns.Store(next)
}

// writeHost writes p at host offset off of f (the data file, or the image
// file for compressed clusters), bumping hostGen around the write.
func (img *Image) writeHost(f block.File, p []byte, off int64) (int, error) {
	img.hostGen.Add(1)
	n, err := f.WriteAt(p, off)
	img.hostGen.Add(1)
	return n, err
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
