package qcow2

import (
	"encoding/binary"
	"fmt"

	"github.com/ovis-storage/ovis/block"
)

// refCounter tallies references to host clusters while walking the
// metadata. It bounds everything by the file size.
type refCounter struct {
	img  *Image
	refs []uint32
}

func (r *refCounter) add(off uint64, n int64, what string) error {
	if n <= 0 {
		return nil
	}
	cs := uint64(r.img.clusterSize)
	first, last := off/cs, (off+uint64(n)-1)/cs
	// References past the end of the file cannot be counted (there is
	// no cluster to count); check reports them, rebuild skips them.
	for i := first; i <= last && i < uint64(len(r.refs)); i++ {
		r.refs[i]++
	}
	return nil
}

// countL2 adds the clusters one L2 table maps, times refs references.
func (r *refCounter) countL2(buf []byte, times uint32) error {
	img := r.img
	for i := int64(0); i < img.l2Entries; i++ {
		m := img.readEntry(buf, i)
		if m.entry&flagCompressed != 0 {
			off, n := img.compressedRange(m.entry)
			for t := uint32(0); t < times; t++ {
				if err := r.add(off&^511, n+int64(off&511), "compressed cluster"); err != nil {
					return err
				}
			}
			continue
		}
		if img.hasDataFile {
			continue
		}
		if h, ok := img.host(m); ok {
			if h%uint64(img.clusterSize) != 0 {
				return corruptf("L2 entry %d: host offset %#x is not cluster aligned", i, h)
			}
			for t := uint32(0); t < times; t++ {
				if err := r.add(h, img.clusterSize, "data cluster"); err != nil {
					return err
				}
			}
		}
	}
	return nil
}

// countAllLocked computes every host cluster's refcount from the header,
// the active and snapshot L1/L2 tables, the snapshot table and the
// bitmaps. Tables are read directly from the file (dirty cached tables
// must have been written first).
func (img *Image) countAllLocked(fileSize int64) (*refCounter, error) {
	cs := img.clusterSize
	r := &refCounter{img: img, refs: make([]uint32, (fileSize+cs-1)/cs)}
	if err := r.add(0, cs, "header"); err != nil {
		return nil, err
	}
	l2refs := map[uint64]uint32{}
	addL1 := func(l1 []uint64, off uint64, what string) error {
		if err := r.add(off, int64(len(l1))*8, what); err != nil {
			return err
		}
		for _, e := range l1 {
			if o := e & l1OffsetMask; o != 0 {
				l2refs[o]++
			}
		}
		return nil
	}
	if err := addL1(img.l1, img.hdr.L1TableOffset, "L1 table"); err != nil {
		return nil, err
	}
	if len(img.snapshots) > 0 {
		if err := r.add(img.hdr.SnapshotsOffset, snapshotTableLen(img.snapshots), "snapshot table"); err != nil {
			return nil, err
		}
	}
	for i, s := range img.snapshots {
		l1, err := img.readL1(s.L1TableOffset, s.L1Size, fileSize)
		if err != nil {
			return nil, fmt.Errorf("snapshot %d: %w", i, err)
		}
		if err := addL1(l1, s.L1TableOffset, fmt.Sprintf("snapshot %d L1 table", i)); err != nil {
			return nil, err
		}
	}
	buf := make([]byte, cs)
	for off, times := range l2refs {
		if off%uint64(cs) != 0 {
			return nil, corruptf("L2 table offset %#x is not cluster aligned", off)
		}
		for t := uint32(0); t < times; t++ {
			if err := r.add(off, cs, "L2 table"); err != nil {
				return nil, err
			}
		}
		if err := block.ReadFull(img.file, buf, int64(off)); err != nil {
			return nil, fmt.Errorf("qcow2: reading L2 table at %#x: %w", off, err)
		}
		if err := r.countL2(buf, times); err != nil {
			return nil, fmt.Errorf("L2 table at %#x: %w", off, err)
		}
	}
	if err := img.countBitmaps(r, fileSize); err != nil {
		return nil, err
	}
	return r, nil
}

func (img *Image) readL1(off uint64, n uint32, fileSize int64) ([]uint64, error) {
	if err := checkTable("L1 table", off, uint64(n)*8, img.clusterSize, fileSize); err != nil {
		return nil, err
	}
	buf := make([]byte, int64(n)*8)
	if err := block.ReadFull(img.file, buf, int64(off)); err != nil {
		return nil, err
	}
	l1 := make([]uint64, n)
	for i := range l1 {
		l1[i] = binary.BigEndian.Uint64(buf[i*8:])
	}
	return l1, nil
}

// countBitmaps counts the bitmap directory, bitmap tables and bitmap data
// clusters of the bitmaps extension.
//
// As QEMU's check, it counts them only when the image's bitmaps are valid
// (version 3, autoclear bit set); otherwise QEMU ignores the extension and
// the clusters are leaks.
func (img *Image) countBitmaps(r *refCounter, fileSize int64) error {
	if img.hdr.Version < 3 || img.hdr.AutoclearFeatures&AutoclearBitmaps == 0 {
		return nil
	}
	for _, e := range img.hdr.Extensions {
		if e.Type != extBitmaps || len(e.Data) < 24 {
			continue
		}
		be := binary.BigEndian
		dirSize := be.Uint64(e.Data[8:])
		dirOff := be.Uint64(e.Data[16:])
		if dirSize > 64<<20 || dirOff+dirSize > uint64(fileSize) {
			return corruptf("bitmap directory at %#x (%d bytes) is beyond the end of the file", dirOff, dirSize)
		}
		if err := r.add(dirOff, int64(dirSize), "bitmap directory"); err != nil {
			return err
		}
		dir := make([]byte, dirSize)
		if err := block.ReadFull(img.file, dir, int64(dirOff)); err != nil {
			return err
		}
		for p := 0; p+24 <= len(dir); {
			tOff := be.Uint64(dir[p:])
			tSize := be.Uint32(dir[p+8:])
			nameSize := int(be.Uint16(dir[p+18:]))
			extra := int(be.Uint32(dir[p+20:]))
			if err := checkTable("bitmap table", tOff, uint64(tSize)*8, img.clusterSize, fileSize); err != nil {
				return err
			}
			if err := r.add(tOff, int64(tSize)*8, "bitmap table"); err != nil {
				return err
			}
			tbl := make([]byte, int64(tSize)*8)
			if err := block.ReadFull(img.file, tbl, int64(tOff)); err != nil {
				return err
			}
			for i := 0; i < len(tbl); i += 8 {
				if d := be.Uint64(tbl[i:]) & l2OffsetMask; d != 0 {
					if err := r.add(d, img.clusterSize, "bitmap data"); err != nil {
						return err
					}
				}
			}
			p += (24 + extra + nameSize + 7) &^ 7
		}
	}
	return nil
}

// rebuildRefcountsLocked recomputes every refcount from the metadata and
// writes a new refcount table and blocks after the end of the file, then
// points the header at them; the old structures become free space. It
// also repairs COPIED flags in the active tables. Called with flushMu and
// mu held, before any other write (it does its I/O with mu held).
func (img *Image) rebuildRefcountsLocked() error {
	fileSize, err := img.file.Size()
	if err != nil {
		return err
	}
	r, err := img.countAllLocked(fileSize)
	if err != nil {
		return fmt.Errorf("qcow2: rebuilding refcounts: %w", err)
	}
	cs := img.clusterSize
	start := int64(len(r.refs))
	var tClusters, blocks int64 = 1, 1
	for {
		end := start + tClusters + blocks
		nb := (end + img.rcPerBlock - 1) / img.rcPerBlock
		nt := max((nb*8+cs-1)/cs, 1)
		if nb <= blocks && nt <= tClusters {
			break
		}
		blocks, tClusters = max(nb, blocks), max(nt, tClusters)
	}
	if tClusters*cs > maxRefcountTableBytes {
		return fmt.Errorf("qcow2: rebuilding refcounts: table of %d clusters exceeds %d bytes", tClusters, maxRefcountTableBytes)
	}
	end := start + tClusters + blocks
	refs := append(r.refs, make([]uint32, end-start)...)
	for i := start; i < end; i++ {
		refs[i] = 1
	}
	table := make([]uint64, tClusters*cs/8)
	blockStart := start + tClusters
	maxRC := img.maxRefcount()
	buf := make([]byte, cs)
	for b := int64(0); b < blocks; b++ {
		clear(buf)
		for i := int64(0); i < img.rcPerBlock; i++ {
			idx := b*img.rcPerBlock + i
			if idx >= end {
				break
			}
			if uint64(refs[idx]) > maxRC {
				return fmt.Errorf("qcow2: cluster %#x has %d references, more than %d-bit refcounts hold", idx*cs, refs[idx], img.rcBits)
			}
			setRefcount(buf, i, img.rcBits, uint64(refs[idx]))
		}
		off := (blockStart + b) * cs
		table[b] = uint64(off)
		if _, err := img.file.WriteAt(buf, off); err != nil {
			return fmt.Errorf("qcow2: writing refcount block at %#x: %w", off, err)
		}
	}
	tbuf := make([]byte, tClusters*cs)
	for i, v := range table {
		binary.BigEndian.PutUint64(tbuf[i*8:], v)
	}
	if _, err := img.file.WriteAt(tbuf, start*cs); err != nil {
		return fmt.Errorf("qcow2: writing refcount table at %#x: %w", start*cs, err)
	}
	if err := img.file.Sync(); err != nil {
		return err
	}
	img.hdr.RefcountTableOffset = uint64(start * cs)
	img.hdr.RefcountTableClusters = uint32(tClusters)
	if err := img.writeHeaderLocked(); err != nil {
		return err
	}
	img.refTable = table
	clear(img.rtDirty)
	img.rc = newTableCache(img.rc.name, img.file, int(cs), img.rc.capacity, PolicyLRU, &img.mu)
	img.freeHint, img.runHint, img.compTail = 1, 0, 0
	return img.fixCopiedLocked(refs)
}

// fixCopiedLocked sets the COPIED flags of the active L1 and L2 tables to
// match refcounts == 1 and writes the tables it changed.
func (img *Image) fixCopiedLocked(refs []uint32) error {
	cs := img.clusterSize
	one := func(off uint64) bool {
		i := off / uint64(cs)
		return i < uint64(len(refs)) && refs[i] == 1
	}
	l1Changed := false
	buf := make([]byte, cs)
	for i, e := range img.l1 {
		off := e & l1OffsetMask
		if off == 0 {
			continue
		}
		want := e &^ flagCopied
		if one(off) {
			want |= flagCopied
		}
		if want != e {
			img.l1[i] = want
			l1Changed = true
		}
		if err := block.ReadFull(img.file, buf, int64(off)); err != nil {
			return err
		}
		changed := false
		for j := int64(0); j < img.l2Entries; j++ {
			m := img.readEntry(buf, j)
			h, ok := img.host(m)
			if !ok || m.entry&flagCompressed != 0 {
				continue
			}
			nm := m
			nm.entry &^= flagCopied
			if img.hasDataFile || one(h) {
				nm.entry |= flagCopied
			}
			if nm != m {
				img.writeEntry(buf, j, nm)
				changed = true
			}
		}
		if changed {
			img.forgetTableLocked(off)
			if _, err := img.file.WriteAt(buf, int64(off)); err != nil {
				return fmt.Errorf("qcow2: writing L2 table at %#x: %w", off, err)
			}
		}
	}
	if l1Changed {
		l1 := make([]byte, len(img.l1)*8)
		for i, e := range img.l1 {
			binary.BigEndian.PutUint64(l1[i*8:], e)
		}
		if _, err := img.file.WriteAt(l1, int64(img.hdr.L1TableOffset)); err != nil {
			return fmt.Errorf("qcow2: writing L1 table: %w", err)
		}
	}
	return img.file.Sync()
}
