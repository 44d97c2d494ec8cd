package qcow2

import (
	"context"
	"errors"
	"fmt"
	"slices"
)

// This file holds the internal snapshot operations (qemu-img snapshot -c,
// -d, -a; qemu-nbd -l): looking a snapshot up, writing the snapshot table,
// and creating, deleting, applying and loading snapshots, each inside
// exclusive except the read-only load.

// findSnapshot looks a snapshot up by ID first, then by name, as QEMU's
// find_snapshot_by_id_or_name does.
func (img *Image) findSnapshot(idOrName string) int {
	for i, s := range img.snapshots {
		if s.ID == idOrName {
			return i
		}
	}
	for i, s := range img.snapshots {
		if s.Name == idOrName {
			return i
		}
	}
	return -1
}

// ErrSnapshotStatus marks a DeleteSnapshot that failed updating the active
// tables' COPIED flags (QEMU: "Failed to update snapshot status in disk").
var ErrSnapshotStatus = errors.New("qcow2: updating the snapshot status")

// ErrSnapshotNotFound is returned for an unknown snapshot ID or name.
var ErrSnapshotNotFound = errors.New("qcow2: snapshot not found")

// writeSnapshotTableLocked writes a new snapshot table, switches the
// header to it and frees the old one.
func (img *Image) writeSnapshotTableLocked(snaps []Snapshot) error {
	var off uint64
	snaps = img.qemuSnapshotEntries(snaps)
	// Not padded past the last entry, as QEMU writes it.
	tbl := encodeSnapshotTable(snaps, img.hdr.Version)[:snapshotTableLen(snaps)]
	if len(snaps) > 0 {
		var err error
		if off, err = img.writeNewLocked("snapshot table", tbl); err != nil {
			return err
		}
	}
	// The table's clusters are counted, and it is written, before the
	// header points at it.
	if err := img.flushExclusiveLocked(); err != nil {
		return err
	}
	oldOff, oldLen := img.hdr.SnapshotsOffset, snapshotTableLen(img.snapshots)
	img.hdr.NbSnapshots = uint32(len(snaps))
	img.hdr.SnapshotsOffset = off
	if err := img.writeHeaderLocked(); err != nil {
		return err
	}
	if len(img.snapshots) > 0 {
		img.freeRangeLocked(oldOff, oldLen)
	}
	img.snapshots = snaps
	return nil
}

// qemuSnapshotEntries returns a copy of snaps as QEMU's
// qcow2_write_snapshots writes them: every entry with at least its 24
// bytes of extra data (an unknown icount as -1, an unknown disk size as
// the current one), Extra holding the bytes that will be on disk so that
// snapshotTableLen measures the written table.
func (img *Image) qemuSnapshotEntries(snaps []Snapshot) []Snapshot {
	out := make([]Snapshot, len(snaps))
	for i, s := range snaps {
		if !s.HasDiskSize {
			s.DiskSize, s.HasDiskSize = uint64(img.size), true
		}
		if len(s.Extra) < snapshotExtraQemu {
			s.Extra = append(append([]byte(nil), s.Extra...), make([]byte, snapshotExtraQemu-len(s.Extra))...)
		}
		s.Extra = s.encodeExtra(img.hdr.Version)
		out[i] = s
	}
	return out
}

// CreateSnapshot makes an internal snapshot of the active layer, as
// qemu-img snapshot -c does. id "" picks the next free numeric ID.
// dateSec and dateNsec stamp it.
func (img *Image) CreateSnapshot(ctx context.Context, id, name string, dateSec, dateNsec uint32) error {
	return img.exclusive(ctx, func() error {
		if img.hasDataFile {
			return fmt.Errorf("qcow2: internal snapshots are not supported with an external data file")
		}
		if id == "" {
			id = img.nextSnapshotID()
		}
		for _, s := range img.snapshots {
			if s.ID == id {
				return fmt.Errorf("qcow2: a snapshot with ID %q already exists", id)
			}
		}
		// ICount 0, not -1 (absent): qemu-img's snapshot -c zeroes its
		// record and so writes an icount of 0, and info lists it.
		sn := Snapshot{ID: id, Name: name, DateSec: dateSec, DateNsec: dateNsec, ICount: 0,
			DiskSize: uint64(img.size), HasDiskSize: img.v3, L1Size: uint32(len(img.l1))}
		if err := sn.checkEncodable(); err != nil {
			return err
		}
		// 0. Refuse before changing anything what would fail midway.
		fromZero, err := img.treeRefsFitLocked(img.l1, 1)
		if err != nil {
			return err
		}
		if err := img.createSnapshotLocked(&sn, fromZero); err != nil {
			// Best effort: flags set again from the refcounts, so that
			// a failure leaves at worst leaks, never COPIED errors.
			if rerr := img.refreshCopiedLocked(); rerr == nil {
				_ = img.flushExclusiveLocked()
			}
			return err
		}
		return nil
	})
}

// createSnapshotLocked is CreateSnapshot's work inside exclusive.
func (img *Image) createSnapshotLocked(sn *Snapshot, fromZero bool) error {
	// 1. Nothing in the active tables will be exclusively ours: clear
	// the COPIED flags first. A crash now leaves flags clear on
	// clusters with refcount 1, which only costs a needless copy
	// (qemu-img check counts it, and -r all fixes it); the other
	// order would leave flags set on shared clusters.
	if err := img.clearCopiedLocked(); err != nil {
		return err
	}
	if err := img.flushExclusiveLocked(); err != nil {
		return err
	}
	// 2. Count the new references, durably.
	if err := img.addTreeRefsLocked(img.l1, 1); err != nil {
		return err
	}
	if err := img.flushExclusiveLocked(); err != nil {
		return err
	}
	// A cluster counted from 0 (a corrupt refcount) is now 1: QEMU
	// flags it COPIED again.
	if fromZero {
		if err := img.refreshCopiedLocked(); err != nil {
			return err
		}
		if err := img.flushExclusiveLocked(); err != nil {
			return err
		}
	}
	// 3. The snapshot's copy of the L1 table.
	l1Bytes := int64(len(img.l1)) * 8
	if l1Bytes > 0 {
		// An entry with flags but no offset maps nothing: the copy
		// holds 0, so that check does not read the header as an L2
		// table once more for the snapshot.
		l1 := slices.Clone(img.l1)
		for i, e := range l1 {
			if e&l1OffsetMask == 0 {
				l1[i] = 0
			}
		}
		off, err := img.writeNewLocked("snapshot L1 table", encodeL1(l1, len(l1)))
		if err != nil {
			return err
		}
		sn.L1TableOffset = off
	}
	snaps := append(append([]Snapshot(nil), img.snapshots...), *sn)
	if err := img.writeSnapshotTableLocked(snaps); err != nil {
		return err
	}
	return img.flushExclusiveLocked()
}

func (img *Image) nextSnapshotID() string {
	max := 0
	for _, s := range img.snapshots {
		var n int
		if _, err := fmt.Sscanf(s.ID, "%d", &n); err == nil && n > max {
			max = n
		}
	}
	return fmt.Sprint(max + 1)
}

// DeleteSnapshot removes an internal snapshot (by ID or name) and
// releases what only it referenced.
func (img *Image) DeleteSnapshot(ctx context.Context, idOrName string) error {
	return img.exclusive(ctx, func() error {
		i := img.findSnapshot(idOrName)
		if i < 0 {
			return fmt.Errorf("%w: %q", ErrSnapshotNotFound, idOrName)
		}
		sn := img.snapshots[i]
		l1, err := img.readL1Exclusive(sn)
		if err != nil {
			return err
		}
		// The active tables' COPIED flags are rewritten last: refuse
		// first what QEMU fails there.
		if _, err := img.treeRefsFitLocked(img.l1, 0); err != nil {
			return fmt.Errorf("%w: %w", ErrSnapshotStatus, err)
		}
		snaps := append(append([]Snapshot(nil), img.snapshots[:i]...), img.snapshots[i+1:]...)
		if err := img.writeSnapshotTableLocked(snaps); err != nil {
			return err
		}
		// The header no longer reaches the snapshot: drop its references.
		// Refused before the first drop if one would fail, leaving the
		// snapshot's clusters leaked, as QEMU leaves them.
		if _, err := img.treeRefsFitLocked(l1, -1); err != nil {
			return err
		}
		if err := img.addTreeRefsLocked(l1, -1); err != nil {
			return err
		}
		img.freeRangeLocked(sn.L1TableOffset, int64(sn.L1Size)*8)
		if err := img.flushExclusiveLocked(); err != nil {
			return err
		}
		if err := img.refreshCopiedLocked(); err != nil {
			return err
		}
		return img.flushExclusiveLocked()
	})
}

func (img *Image) readL1Exclusive(sn Snapshot) ([]uint64, error) {
	fileSize, err := img.file.Size()
	if err != nil {
		return nil, err
	}
	return img.readL1(sn.L1TableOffset, sn.L1Size, fileSize)
}

// ApplySnapshot reverts the active layer to an internal snapshot (by ID
// or name), as qemu-img snapshot -a does.
func (img *Image) ApplySnapshot(ctx context.Context, idOrName string) error {
	return img.exclusive(ctx, func() error {
		i := img.findSnapshot(idOrName)
		if i < 0 {
			return fmt.Errorf("%w: %q", ErrSnapshotNotFound, idOrName)
		}
		sn := img.snapshots[i]
		if sn.HasDiskSize && int64(sn.DiskSize) != img.size {
			return fmt.Errorf("qcow2: snapshot %q has disk size %d, the image %d: applying across a resize is not supported", idOrName, sn.DiskSize, img.size)
		}
		if int(sn.L1Size) > len(img.l1) {
			return fmt.Errorf("qcow2: snapshot %q has a larger L1 table (%d entries) than the image (%d)", idOrName, sn.L1Size, len(img.l1))
		}
		l1, err := img.readL1Exclusive(sn)
		if err != nil {
			return err
		}
		// Refuse before changing anything what would fail midway.
		if _, err := img.treeRefsFitLocked(l1, 1); err != nil {
			return err
		}
		// 0. The whole disk may change: enabled bitmaps are flagged
		// in-use first and then mark everything (QEMU leaves them as
		// they were, which would let an incremental backup miss the
		// reverted clusters).
		if err := img.markAllBitmapsLocked(); err != nil {
			return err
		}
		// 1. Count the snapshot's tree once more, durably.
		if err := img.addTreeRefsLocked(l1, 1); err != nil {
			return err
		}
		if err := img.flushExclusiveLocked(); err != nil {
			return err
		}
		// 2. Point the active L1 table at it.
		newL1 := make([]uint64, len(img.l1))
		for j, e := range l1 {
			newL1[j] = e &^ flagCopied
		}
		if _, err := img.file.WriteAt(encodeL1(newL1, len(newL1)), int64(img.hdr.L1TableOffset)); err != nil {
			return fmt.Errorf("qcow2: writing L1 table: %w", err)
		}
		if err := img.file.Sync(); err != nil {
			return err
		}
		old := img.l1
		img.l1 = newL1
		clear(img.l1Dirty)
		img.l2 = newTableCache(img.l2.name, img.file, img.l2.entrySize, img.l2.capacity, img.l2policyName, &img.mu)
		// 3. Release the old active tree.
		if err := img.addTreeRefsLocked(old, -1); err != nil {
			return err
		}
		if err := img.flushExclusiveLocked(); err != nil {
			return err
		}
		if err := img.refreshCopiedLocked(); err != nil {
			return err
		}
		return img.flushExclusiveLocked()
	})
}

// LoadSnapshot makes a read-only image read as one of its internal
// snapshots from now on, as QEMU's qcow2_snapshot_load_tmp does for
// qemu-nbd -l: the snapshot's L1 table takes the active one's place,
// while the virtual size stays the image's (clusters past the snapshot's
// L1 table read as unallocated). The snapshot is the one whose ID is id
// and whose name is name; an empty id or name matches any, not both.
func (img *Image) LoadSnapshot(id, name string) error {
	if !img.ro {
		return errors.New("qcow2: loading a snapshot for reading needs a read-only image")
	}
	img.gate.Lock()
	defer img.gate.Unlock()
	if err := img.checkOpen(); err != nil {
		return err
	}
	img.mu.Lock()
	defer img.mu.Unlock()
	i := slices.IndexFunc(img.snapshots, func(s Snapshot) bool {
		return (id != "" || name != "") && (id == "" || s.ID == id) && (name == "" || s.Name == name)
	})
	if i < 0 {
		return ErrSnapshotNotFound
	}
	// Read with mu held: no I/O is in flight (gate) and this happens once.
	l1, err := img.readL1Exclusive(img.snapshots[i])
	if err != nil {
		return fmt.Errorf("qcow2: snapshot %q: %w", img.snapshots[i].Name, err)
	}
	img.l1 = l1
	return nil
}
