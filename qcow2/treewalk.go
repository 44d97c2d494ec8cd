package qcow2

import (
	"encoding/binary"
)

// This file holds the one walk of an image's metadata tree: every
// reference to a host cluster that the header, the L1 and L2 tables, the
// snapshot table, the refcount structures and the bitmaps hold. Check
// (qemu-img check), the refcount rebuild (lazy-refcounts recovery, amend
// of the refcount width) and the snapshot operations (counting or
// uncounting one L1 tree) all walk through it; what each does with a
// reference lives in its callbacks.
//
// Invariants of treeVisitor:
//
//   - What and in which order (walk): the header cluster; the active L1
//     table, then for each of its nonzero entries in order its L2 table
//     and then that table's entries in order; each snapshot's L1 table
//     and tree the same way, in snapshot table order; the snapshot
//     table; with refcounts, the refcount table; the bitmap directory,
//     then per bitmap its table and its data clusters (only for valid
//     bitmaps: version 3 with the autoclear bit, as QEMU); with
//     refcounts, each refcount table entry in order. tree visits one L1
//     tree alone, without its L1 table.
//   - An L2 table is visited once per L1 entry naming it: a table two
//     trees share is visited, and its clusters referenced, twice. A
//     reference is reported as the byte range the metadata names
//     (possibly unaligned, possibly past the end of the file): the
//     callback decides what to count, report or refuse.
//   - Clusters in an external data file (data, or compressed, which is
//     invalid there) are not references to the image file and are never
//     reported. Refcount blocks are reported as their table entries
//     (refblock), not read.
//   - Tables are read from the file each time (L1 and L2 tables through
//     read, bitmap structures in full), never from the caches: dirty
//     cached tables must have been written first. A callback may
//     rewrite an entry on disk (check's repairs); the visitor does not
//     read that table again.
//   - A callback returning an error stops the walk with that error.
//     Callbacks must not change the L1 slices or the snapshot list being
//     walked, nor the refcount table while refblock runs.
//   - Locking: the caller holds flushMu and mu, so that no metadata
//     changes under the walk (inside the exclusive gate, or before the
//     first write); the visitor does its I/O with mu held. A callback may
//     release mu to load a table only inside the exclusive gate
//     (addTreeRefsLocked's refcount updates).
type treeVisitor struct {
	img *Image
	// fileSize bounds the bitmap structures, as QEMU's check does.
	fileSize int64
	// refcounts also visits the refcount table and blocks, which check
	// counts; a rebuild leaves them out (they become free).
	refcounts bool
	// activeL1, if set, is the active L1 table as held in memory; nil
	// reads it from the file at the header's offset and size.
	activeL1 []uint64

	// read reads n bytes of table at off; nil reads them in full with
	// readTableFile.
	read func(k refKind, off uint64, n int64) ([]byte, error)
	// ref is called for every reference. It must be set.
	ref func(r hostRef) error
	// l1Entry is called for each nonzero L1 entry before its L2 table
	// is referenced, and says whether to visit it; nil visits entries
	// whose L2 offset is not zero.
	l1Entry func(i int, e uint64) bool
	// l2Entry is called for each L2 entry before its clusters are
	// referenced, and says whether to reference them; nil references
	// them all.
	l2Entry func(t *l2Visit, j int64, m mapping) (bool, error)
	// l2Done is called after an L2 table's entries; nil does nothing.
	l2Done func(t *l2Visit) error
	// snapshot is called before snapshot i's tree, and says whether to
	// visit it; nil visits every snapshot.
	snapshot func(i int, s Snapshot) (bool, error)
	// bitmapsDone is called with the bitmap walk's error (nil if none)
	// once the bitmaps are visited; nil stops the walk on that error.
	bitmapsDone func(err error) error
	// refblock is called for refcount table entry i, e, when refcounts
	// is set; it must be set then.
	refblock func(i int, e uint64) error
}

// refKind is what a reference is.
type refKind int

const (
	refHeader refKind = iota
	refL1
	refL2
	refData
	refCompressed
	refSnapshotTable
	refRefcountTable
	refBitmapDir
	refBitmapTable
	refBitmapData
)

// hostRef is one reference to the host bytes [off, off+n).
type hostRef struct {
	kind refKind
	off  uint64
	n    int64
	// For refL2, the L1 entry's index; for refData and refCompressed,
	// the L2 entry's index in the table at table.
	index int64
	table uint64
}

// l2Visit is the L2 table being visited: its offset, its content as
// read, and whether the active L1 table names it.
type l2Visit struct {
	off    uint64
	buf    []byte
	active bool
}

// entryRef returns the reference an L2 entry holds in the image file: a
// compressed cluster's sectors or a standard cluster; none for an
// unallocated entry or for data in an external data file.
func (img *Image) entryRef(m mapping) (k refKind, off uint64, n int64, ok bool) {
	if img.hasDataFile {
		return 0, 0, 0, false
	}
	if m.entry&flagCompressed != 0 {
		off, n := img.compressedRange(m.entry)
		return refCompressed, off, n, true
	}
	if h, ok := img.host(m); ok {
		return refData, h, img.clusterSize, true
	}
	return 0, 0, 0, false
}

func (v *treeVisitor) readTable(k refKind, off uint64, n int64) ([]byte, error) {
	if v.read != nil {
		return v.read(k, off, n)
	}
	return v.img.readTableFile(off, n)
}

// walk visits the whole image, in the order the type's comment gives.
func (v *treeVisitor) walk() error {
	img := v.img
	if err := v.ref(hostRef{kind: refHeader, off: 0, n: img.clusterSize}); err != nil {
		return err
	}
	if v.activeL1 != nil {
		if err := v.ref(hostRef{kind: refL1, off: img.hdr.L1TableOffset, n: int64(len(v.activeL1)) * 8}); err != nil {
			return err
		}
		if err := v.tree(v.activeL1, true); err != nil {
			return err
		}
	} else if err := v.l1(img.hdr.L1TableOffset, img.hdr.L1Size, true); err != nil {
		return err
	}
	for i, s := range img.snapshots {
		visit := true
		if v.snapshot != nil {
			var err error
			if visit, err = v.snapshot(i, s); err != nil {
				return err
			}
		}
		if !visit {
			continue
		}
		if err := v.l1(s.L1TableOffset, s.L1Size, false); err != nil {
			return err
		}
	}
	// A check open keeps the table's size as the header gives it.
	var n int64
	if img.forCheck {
		n = img.checkSnapSize
	} else if len(img.snapshots) > 0 {
		n = snapshotTableLen(img.snapshots)
	}
	if err := v.ref(hostRef{kind: refSnapshotTable, off: img.hdr.SnapshotsOffset, n: n}); err != nil {
		return err
	}
	if v.refcounts {
		if err := v.ref(hostRef{kind: refRefcountTable, off: img.hdr.RefcountTableOffset, n: int64(len(img.refTable)) * 8}); err != nil {
			return err
		}
	}
	err := v.bitmaps()
	if v.bitmapsDone != nil {
		err = v.bitmapsDone(err)
	}
	if err != nil {
		return err
	}
	if v.refcounts {
		for i, e := range img.refTable {
			if err := v.refblock(i, e); err != nil {
				return err
			}
		}
	}
	return nil
}

// l1 visits the L1 table of size entries at off and its tree.
func (v *treeVisitor) l1(off uint64, size uint32, active bool) error {
	if size == 0 {
		return nil
	}
	if err := v.ref(hostRef{kind: refL1, off: off, n: int64(size) * 8}); err != nil {
		return err
	}
	raw, err := v.readTable(refL1, off, int64(size)*8)
	if err != nil {
		return err
	}
	return v.tree(parseL1(raw), active)
}

// tree visits the L2 tables an L1 table names and the clusters they map.
func (v *treeVisitor) tree(l1 []uint64, active bool) error {
	img := v.img
	for i, e := range l1 {
		if e == 0 {
			continue
		}
		l2off := e & l1OffsetMask
		if v.l1Entry != nil {
			if !v.l1Entry(i, e) {
				continue
			}
		} else if l2off == 0 {
			continue
		}
		if err := v.ref(hostRef{kind: refL2, off: l2off, n: img.clusterSize, index: int64(i)}); err != nil {
			return err
		}
		buf, err := v.readTable(refL2, l2off, img.clusterSize)
		if err != nil {
			return err
		}
		t := &l2Visit{off: l2off, buf: buf, active: active}
		for j := int64(0); j < img.l2Entries; j++ {
			m := img.readEntry(buf, j)
			count := true
			if v.l2Entry != nil {
				if count, err = v.l2Entry(t, j, m); err != nil {
					return err
				}
			}
			if k, off, n, ok := img.entryRef(m); ok && count {
				if err := v.ref(hostRef{kind: k, off: off, n: n, index: j, table: l2off}); err != nil {
					return err
				}
			}
		}
		if v.l2Done != nil {
			if err := v.l2Done(t); err != nil {
				return err
			}
		}
	}
	return nil
}

// bitmaps visits the bitmap directory, bitmap tables and bitmap data
// clusters of the bitmaps extension, only when the image's bitmaps are
// valid (version 3, autoclear bit set): otherwise QEMU ignores the
// extension and the clusters are leaks.
func (v *treeVisitor) bitmaps() error {
	img := v.img
	if img.hdr.Version < 3 || img.hdr.AutoclearFeatures&AutoclearBitmaps == 0 {
		return nil
	}
	be := binary.BigEndian
	for _, e := range img.hdr.Extensions {
		if e.Type != extBitmaps || len(e.Data) < 24 {
			continue
		}
		dirSize := be.Uint64(e.Data[8:])
		dirOff := be.Uint64(e.Data[16:])
		if dirSize > 64<<20 || dirOff+dirSize > uint64(v.fileSize) {
			return corruptf("bitmap directory at %#x (%d bytes) is beyond the end of the file", dirOff, dirSize)
		}
		if err := v.ref(hostRef{kind: refBitmapDir, off: dirOff, n: int64(dirSize)}); err != nil {
			return err
		}
		dir, err := img.readTableFile(dirOff, int64(dirSize))
		if err != nil {
			return err
		}
		for p := 0; p+24 <= len(dir); {
			tOff := be.Uint64(dir[p:])
			tSize := be.Uint32(dir[p+8:])
			nameSize := int(be.Uint16(dir[p+18:]))
			extra := int(be.Uint32(dir[p+20:]))
			if err := checkTable("bitmap table", tOff, uint64(tSize)*8, img.clusterSize, v.fileSize); err != nil {
				return err
			}
			if err := v.ref(hostRef{kind: refBitmapTable, off: tOff, n: int64(tSize) * 8}); err != nil {
				return err
			}
			tbl, err := img.readTableFile(tOff, int64(tSize)*8)
			if err != nil {
				return err
			}
			for i := 0; i < len(tbl); i += 8 {
				if d := be.Uint64(tbl[i:]) & l2OffsetMask; d != 0 {
					if err := v.ref(hostRef{kind: refBitmapData, off: d, n: img.clusterSize}); err != nil {
						return err
					}
				}
			}
			p += (24 + extra + nameSize + 7) &^ 7
		}
	}
	return nil
}

// refClusters returns the first and last host cluster of a reference.
func (img *Image) refClusters(r hostRef) (first, last uint64) {
	cs := uint64(img.clusterSize)
	return r.off / cs, (r.off + uint64(r.n) - 1) / cs
}

// readL1 reads the L1 table of n entries at off, which must lie inside a
// file of fileSize bytes.
func (img *Image) readL1(off uint64, n uint32, fileSize int64) ([]uint64, error) {
	if err := checkTable("L1 table", off, uint64(n)*8, img.clusterSize, fileSize); err != nil {
		return nil, err
	}
	buf, err := img.readTableFile(off, int64(n)*8)
	if err != nil {
		return nil, err
	}
	return parseL1(buf), nil
}

// parseL1 decodes an L1 table.
func parseL1(raw []byte) []uint64 {
	l1 := make([]uint64, len(raw)/8)
	for i := range l1 {
		l1[i] = binary.BigEndian.Uint64(raw[i*8:])
	}
	return l1
}
