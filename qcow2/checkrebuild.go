package qcow2

import (
	"encoding/binary"
	"fmt"
)

// This file holds Check's rebuild of the refcount structures (QEMU's
// rebuild_refcount_structure), placing a new refcount table and blocks in
// free clusters through an in-memory refcount table.

// rebuildInPlaceLocked writes new refcount blocks and a new refcount
// table for the computed references refs, in clusters refs shows free
// (QEMU's rebuild_refcount_structure), and points the header at them.
// The old structures stay as they are, counted but unreferenced: the
// caller frees them as leaks.
func (img *Image) rebuildInPlaceLocked(res *CheckResult, refs []uint64) error {
	cs := img.clusterSize
	// Work on a copy grown in whole refcount blocks, as the blocks are
	// written as slices of it.
	r := &imrt{refs: append([]uint64(nil), refs...)}
	r.reserveOldBlocks(img.refTable, cs)
	var table []uint64
	grown, err := img.writeRefblocksLocked(r, 0, int64(len(r.refs)), &table)
	if err != nil {
		return err
	}
	var tOff, tClusters int64
	for grown {
		tClusters = (int64(len(table))*8 + cs - 1) / cs
		var free int64
		tOff = r.alloc(tClusters, &free)
		// The table's own clusters changed refcounts that may already
		// be on disk: write their blocks again.
		if grown, err = img.writeRefblocksLocked(r, tOff, tOff+tClusters, &table); err != nil {
			return err
		}
	}
	buf := make([]byte, len(table)*8)
	for i, v := range table {
		binary.BigEndian.PutUint64(buf[i*8:], v)
	}
	if _, err := img.file.WriteAt(buf, tOff*cs); err != nil {
		return fmt.Errorf("qcow2: writing refcount table at %#x: %w", tOff*cs, err)
	}
	if err := img.file.Sync(); err != nil {
		return fmt.Errorf("qcow2: syncing rebuilt refcounts: %w", err)
	}
	img.hdr.RefcountTableOffset = uint64(tOff * cs)
	img.hdr.RefcountTableClusters = uint32(tClusters)
	if err := img.writeHeaderLocked(); err != nil {
		return err
	}
	img.refTable = table
	clear(img.rtDirty)
	img.rc = newTableCache(img.rc.name, img.file, int(cs), img.rc.capacity, PolicyLRU, &img.mu)
	res.Repairs = append(res.Repairs, Repair{Kind: RepairRebuild, Offset: uint64(tOff * cs), After: uint64(tClusters)})
	return nil
}

// imrt is an in-memory refcount table used to place rebuilt structures.
type imrt struct{ refs []uint64 }

// reserveOldBlocks marks used the clusters of every refcount block the
// old table names, even those check could not count (reserved bits set,
// misaligned). Until the header points at the new table the old one
// stays intact, never written over, as QEMU's overlap check demands of a
// rebuild; the clusters reserved only here are leaked by the rebuild and
// freed right after it.
func (r *imrt) reserveOldBlocks(table []uint64, cs int64) {
	for _, e := range table {
		// Unsigned: a corrupt entry may name any offset, even past
		// the largest int64.
		c := (e & refTableMask) / uint64(cs)
		if c == 0 {
			continue
		}
		if c < uint64(len(r.refs)) {
			r.refs[c] = max(r.refs[c], 1)
		}
		// A misaligned block spans two clusters.
		if e&refTableMask%uint64(cs) != 0 && c+1 < uint64(len(r.refs)) {
			r.refs[c+1] = max(r.refs[c+1], 1)
		}
	}
}

func (r *imrt) get(i int64) uint64 {
	if i < int64(len(r.refs)) {
		return r.refs[i]
	}
	return 0
}

// alloc finds n free clusters in a row from *first on, growing the table
// past the end of the image if needed, marks them used and returns the
// first. *first moves to the first free cluster seen.
func (r *imrt) alloc(n int64, first *int64) int64 {
	c, run, gap := *first, int64(0), true
	for ; c < int64(len(r.refs)) && run < n; c++ {
		if r.refs[c] == 0 {
			run++
			if gap {
				*first, gap = c, false
			}
		} else {
			run = 0
		}
	}
	if run < n {
		if end := c + n - run; end > int64(len(r.refs)) {
			r.refs = append(r.refs, make([]uint64, end-int64(len(r.refs)))...)
		}
	}
	c -= run
	for i := range n {
		r.refs[c+i] = 1
	}
	return c
}

// writeRefblocksLocked writes the refcount block of every block-sized
// range with a used cluster in [first, end), allocating the blocks not
// yet in table. It reports whether table had to grow.
func (img *Image) writeRefblocksLocked(r *imrt, first, end int64, table *[]uint64) (bool, error) {
	cs := img.clusterSize
	per := img.rcPerBlock
	var free int64
	grown := false
	buf := make([]byte, cs)
	for c := first; c < end; c++ {
		if r.get(c) == 0 {
			continue
		}
		b := c / per
		start := b * per
		var off int64
		if b < int64(len(*table)) && (*table)[b] != 0 {
			off = int64((*table)[b])
		} else {
			// Never place a block in a range already written.
			free = max(free, start)
			bc := r.alloc(1, &free)
			off = bc * cs
			if bc >= end {
				// The block holding this block's refcount must be
				// written too.
				end = bc + 1
			}
			if b >= int64(len(*table)) {
				n := ((b+1)*8 + cs - 1) / cs * cs / 8
				*table = append(*table, make([]uint64, n-int64(len(*table)))...)
				grown = true
			}
			(*table)[b] = uint64(off)
		}
		clear(buf)
		for i := range per {
			v := r.get(start + i)
			if v > img.maxRefcount() {
				return false, fmt.Errorf("qcow2: cluster %d has %d references, more than %d-bit refcounts hold", start+i, v, img.rcBits)
			}
			setRefcount(buf, i, img.rcBits, v)
		}
		if _, err := img.file.WriteAt(buf, off); err != nil {
			return false, fmt.Errorf("qcow2: writing refcount block at %#x: %w", off, err)
		}
		c = start + per - 1
	}
	return grown, nil
}
