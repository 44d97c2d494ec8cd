package qcow2

import (
	"context"
	"encoding/binary"
	"fmt"
	"slices"

	"golang.org/x/sys/unix"

	"github.com/ovis-storage/ovis/block"
)

// Flush makes every completed write durable.
//
// Crash-safety ordering. One snapshot of the dirty metadata is taken under
// mu, so every L2 change in it has its refcount increments in it too. Then,
// without mu:
//
//  1. the data file is synced (data before the L2 entries mapping it);
//  2. refcount blocks are written and synced (a cluster is counted before
//     anything points at it);
//  3. refcount table entries for new blocks are written and synced (a
//     block exists before the table points at it);
//  4. L2 tables are written and synced (a table exists before L1 points
//     at it);
//  5. L1 entries are written and synced;
//  6. refcount drops recorded before the snapshot are applied: the L2
//     entries that referenced those clusters are gone on disk, so a
//     crash can only leak them. The blocks are written back (no sync
//     needed: a durable drop is only ever newer than a durable L2 change).
//
// A crash at any point leaves at most leaked clusters.
func (img *Image) Flush(context.Context) error {
	img.gate.RLock()
	defer img.gate.RUnlock()
	return img.flush()
}

func (img *Image) flush() error {
	if img.ro {
		return img.checkOpen()
	}
	img.flushMu.Lock()
	defer img.flushMu.Unlock()
	return img.flushLocked()
}

// flushLocked runs Flush with flushMu held.
func (img *Image) flushLocked() error {
	img.mu.Lock()
	if img.closed {
		img.mu.Unlock()
		return nil
	}
	rcs := img.rc.dirtyLocked()
	rts := make(map[int]uint64, len(img.rtDirty))
	for i := range img.rtDirty {
		rts[i] = img.refTable[i]
	}
	clear(img.rtDirty)
	l2s := img.l2.dirtyLocked()
	l1s := make(map[int]uint64, len(img.l1Dirty))
	for i := range img.l1Dirty {
		l1s[i] = img.l1[i]
	}
	clear(img.l1Dirty)
	frees := img.pendingFree
	img.pendingFree = nil
	punch := img.pendingPunch
	img.pendingPunch = nil
	rtOff, l1Off := img.hdr.RefcountTableOffset, img.hdr.L1TableOffset
	img.mu.Unlock()

	restore := func() {
		img.mu.Lock()
		for i := range rts {
			img.rtDirty[i] = struct{}{}
		}
		for i := range l1s {
			img.l1Dirty[i] = struct{}{}
		}
		img.pendingFree = append(img.pendingFree, frees...)
		img.keepPunchLocked(punch)
		img.mu.Unlock()
	}
	if err := img.flushSteps(rcs, rts, l2s, l1s, rtOff, l1Off); err != nil {
		restore()
		return err
	}
	img.mu.Lock()
	img.rc.cleanLocked(rcs)
	img.l2.cleanLocked(l2s)
	img.mu.Unlock()

	if len(frees) == 0 {
		return nil
	}
	// Data I/O that mapped a freed cluster before its L2 entry changed
	// may still be running: let it finish before the cluster can be
	// reused.
	img.mu.Lock()
	img.waitUsersLocked()
	img.mu.Unlock()
	if len(punch) > 0 {
		if err := img.punchFreedClusters(frees, punch); err != nil {
			return err
		}
	}
	i := 0
	err := img.withMetadata(context.Background(), func() error {
		for ; i < len(frees); i++ {
			if err := img.addRefLocked(int64(frees[i]>>img.clusterBits), -1); err != nil {
				return err
			}
			// A freed table must not be served from the cache once its
			// cluster is reused.
			img.forgetTableLocked(frees[i])
			img.rc.forgetLocked(frees[i])
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("qcow2: releasing clusters: %w", err)
	}
	img.mu.Lock()
	rcs = img.rc.dirtyLocked()
	img.mu.Unlock()
	if err := img.rc.writeTables(rcs); err != nil {
		return err
	}
	img.mu.Lock()
	img.rc.cleanLocked(rcs)
	img.mu.Unlock()
	return img.file.Sync()
}

// keepPunchLocked puts back clusters to punch that a failed flush took.
func (img *Image) keepPunchLocked(punch map[uint64]struct{}) {
	if len(punch) == 0 {
		return
	}
	if img.pendingPunch == nil {
		img.pendingPunch = make(map[uint64]struct{})
	}
	for off := range punch {
		img.pendingPunch[off] = struct{}{}
	}
}

// punchFreedClusters punches the clusters of punch whose refcount the
// drops in frees are about to take to 0, as QEMU passes a discard down
// once a guest discard frees a cluster. It runs after the L2 entries that
// referenced them are gone on disk and the I/O that mapped them has
// drained, and before the drops: until then their refcount keeps them
// from being allocated again, so no new data can be punched. A cluster
// still referenced elsewhere (a snapshot, other compressed data) keeps
// its space. Best effort, as QEMU's discards: the clusters are free
// either way.
func (img *Image) punchFreedClusters(frees []uint64, punch map[uint64]struct{}) error {
	of, ok := img.file.(*block.OSFile)
	if !ok {
		return nil
	}
	count := make(map[uint64]uint64, len(punch))
	for _, off := range frees {
		if _, ok := punch[off]; ok {
			count[off]++
		}
	}
	var runs []uint64
	err := img.withMetadata(context.Background(), func() error {
		runs = runs[:0]
		for off, n := range count {
			rc, err := img.refcountLocked(int64(off >> img.clusterBits))
			if err != nil {
				return err
			}
			if rc == n {
				runs = append(runs, off)
			}
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("qcow2: finding freed clusters to punch: %w", err)
	}
	slices.Sort(runs)
	cs := uint64(img.clusterSize)
	for i := 0; i < len(runs); {
		j := i + 1
		for j < len(runs) && runs[j] == runs[j-1]+cs {
			j++
		}
		_ = unix.Fallocate(int(of.Fd()), unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, int64(runs[i]), int64(uint64(j-i)*cs))
		i = j
	}
	if len(runs) > 0 {
		// Host runs found before may now be holes (hostholes.go).
		img.hostRuns.Store(nil)
		img.hostGen.Add(1)
	}
	return nil
}

// testBreakOrdering makes Flush write L2 tables before the refcount
// blocks they depend on. Only the crash harness's self-test sets it, to
// show that the harness catches a broken ordering rule.
var testBreakOrdering bool

func (img *Image) flushSteps(rcs []dirtyTable, rts map[int]uint64, l2s []dirtyTable, l1s map[int]uint64, rtOff, l1Off uint64) error {
	if testBreakOrdering {
		if err := img.l2.writeTables(l2s); err != nil {
			return err
		}
		if err := writeEntries(img, l1Off, l1s, "L1 table"); err != nil {
			return err
		}
		if err := img.file.Sync(); err != nil {
			return err
		}
	}
	if img.data != img.file {
		if err := img.data.Sync(); err != nil {
			return err
		}
	}
	if err := img.rc.writeTables(rcs); err != nil {
		return err
	}
	if err := img.file.Sync(); err != nil {
		return err
	}
	if len(rts) > 0 {
		if err := writeEntries(img, rtOff, rts, "refcount table"); err != nil {
			return err
		}
		if err := img.file.Sync(); err != nil {
			return err
		}
	}
	if len(l2s) > 0 {
		if err := img.l2.writeTables(l2s); err != nil {
			return err
		}
		if len(l1s) > 0 {
			if err := img.file.Sync(); err != nil {
				return err
			}
		}
	}
	if len(l1s) > 0 {
		if err := writeEntries(img, l1Off, l1s, "L1 table"); err != nil {
			return err
		}
	}
	if len(l2s) > 0 || len(l1s) > 0 {
		return img.file.Sync()
	}
	return nil
}

// writeEntries writes single 8-byte table entries.
func writeEntries(img *Image, tableOff uint64, entries map[int]uint64, what string) error {
	var b [8]byte
	for i, v := range entries {
		binary.BigEndian.PutUint64(b[:], v)
		off := int64(tableOff) + int64(i)*8
		if _, err := img.file.WriteAt(b[:], off); err != nil {
			return fmt.Errorf("qcow2: writing %s entry %d at %#x: %w", what, i, off, err)
		}
	}
	return nil
}

// markClean clears the dirty bit of a lazy-refcounts image after a final
// flush.
func (img *Image) markClean() error {
	img.flushMu.Lock()
	defer img.flushMu.Unlock()
	img.mu.Lock()
	defer img.mu.Unlock()
	if !img.markedDirty {
		return nil
	}
	img.hdr.IncompatibleFeatures &^= IncompatDirty
	img.markedDirty = false
	return img.writeHeaderLocked()
}
