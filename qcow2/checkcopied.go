package qcow2

import (
	"context"
	"encoding/binary"
	"fmt"
)

// This file holds Check's pass over the COPIED flags (QEMU's
// check_oflag_copied) and the metadata overlap check, L1 entry writes and
// cluster zeroing its repairs use.

// checkCopiedLocked checks the COPIED flags of the active tables against
// the stored refcounts (QEMU's check_oflag_copied). RepairAll repairs
// them; RepairLeaks only when nothing else is wrong, as only then are the
// refcounts trustworthy.
func (img *Image) checkCopiedLocked(ctx context.Context, res *CheckResult, fix RepairMode) error {
	repair := fix == RepairAll ||
		(fix == RepairLeaks && res.CheckErrors == 0 && res.Corruptions == 0 && res.Leaks == 0)
	cs := uint64(img.clusterSize)
	live := img.liveRefcountsLocked(res)
	for i, e := range img.l1 {
		l2off := e & l1OffsetMask
		if l2off == 0 {
			continue
		}
		// Between tables: each table's flags are written at once.
		if err := ctx.Err(); err != nil {
			return img.stopCopied(fix, err)
		}
		if r, err := live.get(int64(l2off / cs)); err == nil && (r == 1) != (e&flagCopied != 0) {
			res.Corruptions++
			res.msg("%s OFLAG_COPIED L2 cluster: l1_index=%d l1_entry=%x refcount=%d", repairing(repair), i, e, r)
			if repair {
				ne := e &^ flagCopied
				if r == 1 {
					ne |= flagCopied
				}
				// QEMU's overlap check refuses this write when the L1
				// table is also the entry's L2 table, and fails the
				// check with the refcount repairs unwritten; ovis
				// wrote them already, and only this flag makes the
				// result consistent.
				if err := img.writeL1EntryLocked(i, ne); err != nil {
					res.CheckErrors++
					return err
				}
				res.Corruptions--
				res.CorruptionsFixed++
				res.Repairs = append(res.Repairs, Repair{Kind: RepairCopiedL1, Index: int64(i), Before: e, After: ne})
			}
		}
		buf, err := img.readZeroFilled(l2off, int64(cs))
		if err != nil {
			res.msg("ERROR: Could not read L2 table: %v", err)
			res.CheckErrors++
			return err
		}
		var changed []Repair
		for j := int64(0); j < img.l2Entries; j++ {
			m := img.readEntry(buf, j)
			h, has := img.host(m)
			if !has || m.entry&flagCompressed != 0 {
				continue
			}
			r := uint64(1)
			if !img.hasDataFile {
				if r, err = live.get(int64(h / cs)); err != nil {
					continue
				}
			}
			if (r == 1) == (m.entry&flagCopied != 0) {
				continue
			}
			res.Corruptions++
			res.msg("%s OFLAG_COPIED data cluster: l2_entry=%x refcount=%d", repairing(repair), m.entry, r)
			if repair {
				nm := m
				nm.entry &^= flagCopied
				if r == 1 {
					nm.entry |= flagCopied
				}
				img.writeEntry(buf, j, nm)
				changed = append(changed, Repair{Kind: RepairCopiedL2, Offset: l2off + uint64(j)*uint64(len(buf))/uint64(img.l2Entries), Before: m.entry, After: nm.entry})
			}
		}
		if len(changed) > 0 {
			// QEMU's overlap check: an L2 table a corrupt L1 entry
			// places on other metadata is never written.
			if what := img.overlapLocked(l2off, cs, "active L2 table"); what != "" {
				img.signalCorruptionLocked(res, "Preventing invalid write on metadata (overlaps with %s)", what)
				res.msg("ERROR: Could not write L2 table; metadata overlap check failed: Input/output error")
				res.CheckErrors++
				return img.stopCopied(fix, errIO)
			}
			img.forgetTableLocked(l2off)
			if _, err := img.file.WriteAt(buf, int64(l2off)); err != nil {
				res.msg("ERROR: Could not write L2 table: %v", err)
				res.CheckErrors++
				return fmt.Errorf("qcow2: writing L2 table at %#x: %w", l2off, err)
			}
			res.Corruptions -= len(changed)
			res.CorruptionsFixed += len(changed)
			res.Repairs = append(res.Repairs, changed...)
		}
	}
	if fix != RepairNone {
		if err := img.file.Sync(); err != nil {
			return fmt.Errorf("qcow2: syncing COPIED repairs: %w", err)
		}
	}
	return nil
}

// overlapLocked returns the name QEMU gives the metadata that a write of
// [off, off+n) would overlap, other than the kind ign the write is meant
// for, or "" (qcow2_check_metadata_overlap in QEMU's default "cached"
// mode, which leaves out inactive L2 tables; ranges are whole clusters).
func (img *Image) overlapLocked(off, n uint64, ign string) string {
	cs := uint64(img.clusterSize)
	start := off &^ (cs - 1)
	end := (off + n + cs - 1) &^ (cs - 1)
	hit := func(o, l uint64) bool { return l > 0 && o < end && start < o+l }
	h := &img.hdr
	if start < cs && ign != "qcow2_header" {
		return "qcow2_header"
	}
	if ign != "active L1 table" && hit(h.L1TableOffset, uint64(len(img.l1))*8) {
		return "active L1 table"
	}
	if ign != "active L2 table" {
		for _, e := range img.l1 {
			if o := e & l1OffsetMask; o != 0 && hit(o, cs) {
				return "active L2 table"
			}
		}
	}
	if ign != "refcount table" && hit(h.RefcountTableOffset, uint64(len(img.refTable))*8) {
		return "refcount table"
	}
	if ign != "refcount block" {
		for _, e := range img.refTable {
			if o := e & refTableMask; o != 0 && hit(o, cs) {
				return "refcount block"
			}
		}
	}
	snapLen := img.checkSnapSize
	if !img.forCheck {
		snapLen = snapshotTableLen(img.snapshots)
	}
	if ign != "snapshot table" && hit(h.SnapshotsOffset, uint64(max(snapLen, 0))) {
		return "snapshot table"
	}
	if ign != "inactive L1 table" {
		for _, sn := range img.snapshots {
			if hit(sn.L1TableOffset, uint64(sn.L1Size)*8) {
				return "inactive L1 table"
			}
		}
	}
	if ign != "bitmap directory" && h.Version >= 3 && h.AutoclearFeatures&AutoclearBitmaps != 0 {
		for _, e := range h.Extensions {
			if e.Type == extBitmaps && len(e.Data) >= 24 {
				be := binary.BigEndian
				if hit(be.Uint64(e.Data[16:]), be.Uint64(e.Data[8:])) {
					return "bitmap directory"
				}
			}
		}
	}
	return ""
}

// stopCopied syncs the COPIED repairs made so far and returns err, the
// context's error that stopped checkCopiedLocked.
func (img *Image) stopCopied(fix RepairMode, err error) error {
	if fix != RepairNone {
		if serr := img.file.Sync(); serr != nil {
			return fmt.Errorf("qcow2: syncing COPIED repairs: %w", serr)
		}
	}
	return err
}

// writeL1EntryLocked sets active L1 entry i in memory and on disk.
func (img *Image) writeL1EntryLocked(i int, e uint64) error {
	img.l1[i] = e
	var b [8]byte
	binary.BigEndian.PutUint64(b[:], e)
	off := int64(img.hdr.L1TableOffset) + int64(i)*8
	if _, err := img.file.WriteAt(b[:], off); err != nil {
		return fmt.Errorf("qcow2: writing L1 entry %d at %#x: %w", i, off, err)
	}
	return nil
}

// zeroClusterLocked overwrites host cluster i with zeros, up to the end
// of the file: like QEMU's discard, it never grows the file.
func (img *Image) zeroClusterLocked(i int64) error {
	off := i * img.clusterSize
	size, err := img.file.Size()
	if err != nil {
		return fmt.Errorf("qcow2: zeroing freed cluster at %#x: %w", off, err)
	}
	n := min(img.clusterSize, size-off)
	if n <= 0 {
		return nil
	}
	if _, err := img.file.WriteAt(make([]byte, n), off); err != nil {
		return fmt.Errorf("qcow2: zeroing freed cluster at %#x: %w", off, err)
	}
	return nil
}
