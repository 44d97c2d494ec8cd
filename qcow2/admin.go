package qcow2

import (
	"encoding/binary"
	"errors"
	"fmt"
	"slices"

	"github.com/ovis-storage/ovis/block"
)

// This file holds the operations that rewrite metadata wholesale:
// internal snapshots and resize. They run with Image.gate held
// exclusively (no I/O in flight) after a flush, holding flushMu and mu
// throughout; table loads still release mu, which is safe because nothing
// else can run.

// exclusive runs fn with no I/O in flight, the metadata flushed, and
// flushMu and mu held.
func (img *Image) exclusive(fn func() error) error {
	if img.ro {
		return errReadOnly
	}
	img.gate.Lock()
	defer img.gate.Unlock()
	if err := img.checkOpen(); err != nil {
		return err
	}
	if err := img.flush(); err != nil {
		return err
	}
	img.flushMu.Lock()
	defer img.flushMu.Unlock()
	img.mu.Lock()
	defer img.mu.Unlock()
	return fn()
}

// flushExclusiveLocked runs the ordered flush from inside exclusive.
func (img *Image) flushExclusiveLocked() error {
	img.mu.Unlock()
	defer img.mu.Lock()
	return img.flushLocked()
}

// retryExclusiveLocked runs fn until it stops asking for tables: a
// *needLoad is loaded (mu is released meanwhile, which is safe inside
// exclusive) and a *needGrow grows the refcount table (flushMu is held).
func (img *Image) retryExclusiveLocked(fn func() error) error {
	for {
		err := fn()
		if nl, ok := isNeedLoad(err); ok {
			e, err := nl.c.load(nl.off)
			if err != nil {
				return err
			}
			e.pins--
			continue
		}
		var ng *needGrow
		if errors.As(err, &ng) {
			if err := img.growRefTableLocked(ng.need); err != nil {
				return err
			}
			continue
		}
		return err
	}
}

// refAddLocked adds delta to host cluster idx's refcount, loading
// refcount blocks as needed. Only inside exclusive.
func (img *Image) refAddLocked(idx, delta int64) error {
	return img.retryExclusiveLocked(func() error { return img.addRefLocked(idx, delta) })
}

// refcountExclusiveLocked reads a refcount, loading as needed.
func (img *Image) refcountExclusiveLocked(idx int64) (rc uint64, err error) {
	err = img.retryExclusiveLocked(func() (err error) {
		rc, err = img.refcountLocked(idx)
		return err
	})
	return rc, err
}

// allocExclusiveLocked allocates n contiguous clusters inside exclusive.
func (img *Image) allocExclusiveLocked(n int64) (off uint64, err error) {
	err = img.retryExclusiveLocked(func() (err error) {
		off, err = img.allocRunLocked(n)
		return err
	})
	return off, err
}

// entryClusters returns the host clusters an L2 entry holds a reference
// to (none for data in an external data file).
func (img *Image) entryClusters(m mapping) []int64 {
	if img.hasDataFile {
		return nil
	}
	if m.entry&flagCompressed != 0 {
		off, n := img.compressedRange(m.entry)
		start := int64(off&^511) >> img.clusterBits
		end := (int64(off&^511) + n - 1) >> img.clusterBits
		var out []int64
		for i := start; i <= end; i++ {
			out = append(out, i)
		}
		return out
	}
	if h, ok := img.host(m); ok {
		return []int64{int64(h) >> img.clusterBits}
	}
	return nil
}

func (img *Image) readTableFile(off uint64, n int64) ([]byte, error) {
	buf := make([]byte, n)
	if err := block.ReadFull(img.file, buf, int64(off)); err != nil {
		return nil, fmt.Errorf("qcow2: reading table at %#x: %w", off, err)
	}
	return buf, nil
}

// addTreeRefsLocked adds delta to the refcount of every L2 table an L1
// table references and of every cluster those tables map.
func (img *Image) addTreeRefsLocked(l1 []uint64, delta int64) error {
	for _, e := range l1 {
		l2off := e & l1OffsetMask
		if l2off == 0 {
			continue
		}
		buf, err := img.readTableFile(l2off, img.clusterSize)
		if err != nil {
			return err
		}
		if err := img.refAddLocked(int64(l2off)>>img.clusterBits, delta); err != nil {
			return err
		}
		for j := int64(0); j < img.l2Entries; j++ {
			for _, c := range img.entryClusters(img.readEntry(buf, j)) {
				if err := img.refAddLocked(c, delta); err != nil {
					return fmt.Errorf("qcow2: L2 table at %#x entry %d: %w", l2off, j, err)
				}
			}
		}
	}
	return nil
}

// refreshCopiedLocked sets the COPIED flags of the active L1 table and of
// the L2 tables it owns from the refcounts, writing what changed.
func (img *Image) refreshCopiedLocked() error {
	refcountIsOne := func(off uint64) (bool, error) {
		rc, err := img.refcountExclusiveLocked(int64(off) >> img.clusterBits)
		return rc == 1, err
	}
	return img.setCopiedLocked(refcountIsOne, func(m mapping) (bool, bool, error) {
		h, ok := img.host(m)
		if !ok || m.entry&flagCompressed != 0 || img.hasDataFile {
			return false, false, nil
		}
		copied, err := refcountIsOne(h)
		return copied, true, err
	})
}

// clearCopiedLocked clears the COPIED flags of the active L1 table and
// of every entry of the L2 tables it references.
func (img *Image) clearCopiedLocked() error {
	return img.setCopiedLocked(
		func(uint64) (bool, error) { return false, nil },
		func(m mapping) (bool, bool, error) { return false, m.entry&flagCompressed == 0, nil })
}

// setCopiedLocked sets the COPIED flag of every active L1 entry to what
// l1Copied says for its L2 table, and of every entry of those tables to
// what l2Copied says (leaving it alone when l2Copied's second result is
// false), writing the tables that changed. Entries of a table shared with
// a snapshot are updated in place too: flags only matter as seen from the
// active L1, and the data they map is shared as well.
func (img *Image) setCopiedLocked(l1Copied func(l2off uint64) (bool, error), l2Copied func(mapping) (copied, ok bool, err error)) error {
	for i, e := range img.l1 {
		l2off := e & l1OffsetMask
		if l2off == 0 {
			continue
		}
		copied, err := l1Copied(l2off)
		if err != nil {
			return err
		}
		if want := withCopied(e, copied); want != e {
			// QEMU rewrites a changed L1 entry as its offset and
			// flag only, dropping reserved bits.
			img.l1[i] = withCopied(e&l1OffsetMask, copied)
			img.l1Dirty[i] = struct{}{}
		}
		if err := img.setCopiedL2Locked(l2off, l2Copied); err != nil {
			return err
		}
	}
	return nil
}

// setCopiedL2Locked is setCopiedLocked for the entries of the L2 table at
// l2off.
func (img *Image) setCopiedL2Locked(l2off uint64, l2Copied func(mapping) (copied, ok bool, err error)) error {
	buf, err := img.readTableFile(l2off, img.clusterSize)
	if err != nil {
		return err
	}
	changed := false
	for j := int64(0); j < img.l2Entries; j++ {
		m := img.readEntry(buf, j)
		copied, ok, err := l2Copied(m)
		if err != nil {
			return err
		}
		if want := withCopied(m.entry, copied); ok && want != m.entry {
			m.entry = want
			img.writeEntry(buf, j, m)
			changed = true
		}
	}
	if !changed {
		return nil
	}
	return img.writeTableLocked(l2off, buf)
}

// withCopied returns the table entry e with its COPIED flag set to copied.
func withCopied(e uint64, copied bool) uint64 {
	if copied {
		return e | flagCopied
	}
	return e &^ flagCopied
}

// writeTableLocked writes a whole L2 table and drops its cached slices.
func (img *Image) writeTableLocked(off uint64, buf []byte) error {
	img.forgetTableLocked(off)
	if _, err := img.file.WriteAt(buf, int64(off)); err != nil {
		return fmt.Errorf("qcow2: writing L2 table at %#x: %w", off, err)
	}
	return nil
}

// writeNewLocked writes buf to newly allocated clusters and returns
// their offset. Only inside exclusive.
func (img *Image) writeNewLocked(what string, buf []byte) (uint64, error) {
	off, err := img.allocExclusiveLocked(img.clustersFor(int64(len(buf))))
	if err != nil {
		return 0, err
	}
	if _, err := img.file.WriteAt(buf, int64(off)); err != nil {
		return 0, fmt.Errorf("qcow2: writing %s at %#x: %w", what, off, err)
	}
	return off, nil
}

func encodeL1(l1 []uint64, n int) []byte {
	buf := make([]byte, n*8)
	for i := 0; i < len(l1) && i < n; i++ {
		binary.BigEndian.PutUint64(buf[i*8:], l1[i])
	}
	return buf
}

func (img *Image) clustersFor(n int64) int64 { return (n + img.clusterSize - 1) / img.clusterSize }

func (img *Image) freeRangeLocked(off uint64, n int64) {
	for i := int64(0); i < img.clustersFor(n); i++ {
		img.pendingFree = append(img.pendingFree, off+uint64(i*img.clusterSize))
	}
}

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
func (img *Image) CreateSnapshot(id, name string, dateSec, dateNsec uint32) error {
	return img.exclusive(func() error {
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
func (img *Image) DeleteSnapshot(idOrName string) error {
	return img.exclusive(func() error {
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
func (img *Image) ApplySnapshot(idOrName string) error {
	return img.exclusive(func() error {
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
