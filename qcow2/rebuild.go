package qcow2

import (
	"encoding/binary"
	"fmt"
)

// This file holds the one rebuild of the refcount structures (QEMU's
// rebuild_refcount_structure): new refcount blocks and a new refcount
// table for references counted by the tree walk (treewalk.go), placed in
// free clusters through an in-memory refcount table. Check -r uses it
// when the refcount structures cannot be repaired in place; the recovery
// of a lazy-refcounts image after an unclean shutdown and amend's change
// of the refcount width use it to write every refcount afresh.

// rebuildRefcountsLocked recomputes every refcount from the metadata and
// writes a new refcount table and blocks, then points the header at them;
// the old structures become free space. It also repairs COPIED flags in
// the active tables. Called with flushMu and mu held, before any other
// write (it does its I/O with mu held).
func (img *Image) rebuildRefcountsLocked() error {
	fileSize, err := img.file.Size()
	if err != nil {
		return err
	}
	refs, err := img.countRefsLocked(fileSize)
	if err != nil {
		return fmt.Errorf("qcow2: rebuilding refcounts: %w", err)
	}
	if _, _, err := img.rebuildStructureLocked(refs, false); err != nil {
		return err
	}
	return img.fixCopiedLocked(refs)
}

// countRefsLocked counts every host cluster's references from the
// header, the active and snapshot L1/L2 tables, the snapshot table and
// the bitmaps, bounded by the file size: the refcount structures are not
// counted. Damage a rebuild cannot count around (misaligned tables or
// clusters, snapshot tables outside the file) is an error.
func (img *Image) countRefsLocked(fileSize int64) ([]uint64, error) {
	cs := img.clusterSize
	refs := make([]uint64, (fileSize+cs-1)/cs)
	v := &treeVisitor{img: img, fileSize: fileSize, activeL1: img.l1}
	v.snapshot = func(i int, s Snapshot) (bool, error) {
		if err := checkTable("L1 table", s.L1TableOffset, uint64(s.L1Size)*8, cs, fileSize); err != nil {
			return false, fmt.Errorf("snapshot %d: %w", i, err)
		}
		return true, nil
	}
	v.ref = func(r hostRef) error {
		switch {
		case r.kind == refL2 && r.off%uint64(cs) != 0:
			return corruptf("L2 table offset %#x is not cluster aligned", r.off)
		case r.kind == refData && r.off%uint64(cs) != 0:
			return fmt.Errorf("L2 table at %#x: %w", r.table, corruptf("L2 entry %d: host offset %#x is not cluster aligned", r.index, r.off))
		case r.n <= 0:
			return nil
		}
		// References past the end of the file cannot be counted (there
		// is no cluster to count); check reports them, rebuild skips
		// them.
		first, last := img.refClusters(r)
		for i := first; i <= last && i < uint64(len(refs)); i++ {
			refs[i]++
		}
		return nil
	}
	if err := v.walk(); err != nil {
		return nil, err
	}
	return refs, nil
}

// rebuildStructureLocked writes new refcount blocks and a new refcount
// table for the computed references refs, in clusters refs shows free
// (QEMU's rebuild_refcount_structure), and points the header at them. It
// returns the new table's first cluster and its length in clusters.
//
// Until the header names the new table the old structures stay intact,
// never written over, as QEMU's overlap check demands of a rebuild.
// counted says how refs holds them: check counts the old table and the
// blocks it could count, and the rebuild counts every old block once
// more, leaking them for the caller to free; otherwise (refs leaves them
// out) they are only kept clear of, and free once the header names the
// new table.
func (img *Image) rebuildStructureLocked(refs []uint64, counted bool) (tOff, tClusters int64, err error) {
	cs := img.clusterSize
	// Work on a copy grown in whole refcount blocks, as the blocks are
	// written as slices of it.
	r := &imrt{refs: append([]uint64(nil), refs...)}
	r.reserveOld(img, counted)
	var table []uint64
	grown, err := img.writeRefblocksLocked(r, 0, int64(len(r.refs)), &table)
	if err != nil {
		return 0, 0, err
	}
	for grown {
		tClusters = (int64(len(table))*8 + cs - 1) / cs
		var free int64
		tOff = r.alloc(tClusters, &free)
		// The table's own clusters changed refcounts that may already
		// be on disk: write their blocks again.
		if grown, err = img.writeRefblocksLocked(r, tOff, tOff+tClusters, &table); err != nil {
			return 0, 0, err
		}
	}
	if tClusters*cs > maxRefcountTableBytes {
		return 0, 0, fmt.Errorf("qcow2: rebuilding refcounts: table of %d clusters exceeds %d bytes", tClusters, maxRefcountTableBytes)
	}
	buf := make([]byte, len(table)*8)
	for i, v := range table {
		binary.BigEndian.PutUint64(buf[i*8:], v)
	}
	if _, err := img.file.WriteAt(buf, tOff*cs); err != nil {
		return 0, 0, fmt.Errorf("qcow2: writing refcount table at %#x: %w", tOff*cs, err)
	}
	if err := img.file.Sync(); err != nil {
		return 0, 0, fmt.Errorf("qcow2: syncing rebuilt refcounts: %w", err)
	}
	img.hdr.RefcountTableOffset = uint64(tOff * cs)
	img.hdr.RefcountTableClusters = uint32(tClusters)
	if err := img.writeHeaderLocked(); err != nil {
		return 0, 0, err
	}
	img.refTable = table
	clear(img.rtDirty)
	img.rc = newTableCache(img.rc.name, img.file, int(cs), img.rc.capacity, PolicyLRU, &img.mu)
	img.freeHint, img.runHint, img.compTail = 1, 0, 0
	return tOff, tClusters, nil
}

// imrt is an in-memory refcount table used to place rebuilt structures.
// held marks clusters that are in use though refs does not count them
// (the old structures of a rebuild that leaves them out).
type imrt struct {
	refs []uint64
	held []bool
}

// reserveOld keeps the old refcount structures from being written over.
// With counted, it marks used the clusters of every refcount block the
// old table names, even those check could not count (reserved bits set,
// misaligned): the clusters reserved only here are leaked by the rebuild
// and freed right after it. Without, it holds the old table's and
// blocks' clusters for the placement alone.
func (r *imrt) reserveOld(img *Image, counted bool) {
	cs := uint64(img.clusterSize)
	mark := func(c uint64) {
		switch {
		case c >= uint64(len(r.refs)):
		case counted:
			r.refs[c] = max(r.refs[c], 1)
		default:
			if r.held == nil {
				r.held = make([]bool, len(r.refs))
			}
			r.held[c] = true
		}
	}
	if !counted && len(img.refTable) > 0 {
		first := img.hdr.RefcountTableOffset / cs
		last := (img.hdr.RefcountTableOffset + uint64(len(img.refTable))*8 - 1) / cs
		for c := first; c <= last && c < uint64(len(r.refs)); c++ {
			mark(c)
		}
	}
	for _, e := range img.refTable {
		// Unsigned: a corrupt entry may name any offset, even past
		// the largest int64.
		c := (e & refTableMask) / cs
		if c == 0 {
			continue
		}
		mark(c)
		// A misaligned block spans two clusters.
		if e&refTableMask%cs != 0 {
			mark(c + 1)
		}
	}
}

// free reports whether cluster c may take a new structure.
func (r *imrt) free(c int64) bool {
	return r.refs[c] == 0 && (c >= int64(len(r.held)) || !r.held[c])
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
		if r.free(c) {
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

// fixCopiedLocked sets the COPIED flags of the active L1 and L2 tables to
// match refcounts == 1 (always, for clusters of an external data file),
// writes the tables it changed and syncs.
func (img *Image) fixCopiedLocked(refs []uint64) error {
	one := func(off uint64) (bool, error) {
		i := off >> img.clusterBits
		return i < uint64(len(refs)) && refs[i] == 1, nil
	}
	err := img.setCopiedLocked(one, func(m mapping) (bool, bool, error) {
		h, ok := img.host(m)
		if !ok || m.entry&flagCompressed != 0 {
			return false, false, nil
		}
		copied, _ := one(h)
		return copied || img.hasDataFile, true, nil
	})
	if err != nil {
		return err
	}
	// The L1 entries go to disk now, before the header is marked clean.
	for i := range img.l1Dirty {
		if err := img.writeL1EntryLocked(i, img.l1[i]); err != nil {
			return err
		}
	}
	clear(img.l1Dirty)
	return img.file.Sync()
}
