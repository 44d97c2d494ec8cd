package qcow2

import (
	"context"
)

// This file holds Check, the entry point of qemu-img check: it runs the
// snapshot table check, one pass of the refcount check (walk, compare,
// repair or rebuild, then COPIED) and updates the header's dirty and
// corrupt bits after a repair.

// Check is Check that stops once ctx is done, returning ctx's
// error with the result so far. It stops only between repairs, each of
// which leaves the image consistent: a refcount, an L2 table's COPIED
// flags, a whole refcount rebuild or snapshot table rewrite. A stop
// leaves what was not repaired yet as it was, and at worst leaks
// clusters (the old structures of a rebuild not freed yet).
func (img *Image) Check(ctx context.Context, repair RepairMode) (*CheckResult, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if repair != RepairNone && img.ro {
		return nil, errReadOnly
	}
	if err := img.lockGate(ctx); err != nil {
		return nil, err
	}
	defer img.gate.Unlock()
	if !img.ro {
		if err := img.flush(); err != nil {
			return nil, err
		}
	}
	img.flushMu.Lock()
	defer img.flushMu.Unlock()
	img.mu.Lock()
	defer img.mu.Unlock()
	cs := img.clusterSize
	res := &CheckResult{TotalClusters: (img.size + cs - 1) / cs}
	// The snapshot table's counters are kept apart until the end, as
	// QEMU keeps them (qcow2_co_check_locked).
	var sres CheckResult
	var err error
	if img.forCheck {
		err = img.checkReadSnapshotsLocked(res, &sres, repair)
	}
	if err == nil {
		err = ctx.Err()
	}
	if err == nil {
		err = img.checkRefcountsLocked(ctx, res, repair)
	}
	if repair != RepairNone {
		// Repairs went around the caches (which the flush left clean):
		// start them afresh.
		img.rc = newTableCache(img.rc.name, img.file, int(cs), img.rc.capacity, PolicyLRU, &img.mu)
		img.l2 = newTableCache(img.l2.name, img.file, img.l2.entrySize, img.l2.capacity, img.l2policyName, &img.mu)
		img.freeHint, img.runHint, img.compTail = 1, 0, 0
	}
	if err == nil && img.forCheck {
		if err = ctx.Err(); err == nil {
			err = img.checkFixSnapshotsLocked(res, &sres, repair)
		}
	}
	res.CheckErrors += sres.CheckErrors
	res.Corruptions += sres.Corruptions
	res.Leaks += sres.Leaks
	res.CorruptionsFixed += sres.CorruptionsFixed
	res.LeaksFixed += sres.LeaksFixed
	// A stopped repair keeps the dirty bit: the refcounts it did not
	// reach may still be too low, as a killed qemu-img leaves them.
	if repair != RepairNone && (err == nil || ctx.Err() == nil) {
		clean := err == nil && res.CheckErrors == 0 && res.Corruptions == 0
		if merr := img.markCheckedLocked(clean); err == nil {
			err = merr
		}
	}
	return res, err
}

// markCheckedLocked updates the header after a repair. QEMU clears the
// dirty bit whenever it closes a writable image, even when the repair
// failed, and the corrupt bit only when no corruption is left
// (qcow2_mark_clean, qcow2_mark_consistent). A dirty image that is still
// corrupt keeps needRebuild, so that ovis rebuilds before writing.
func (img *Image) markCheckedLocked(clean bool) error {
	bits := img.hdr.IncompatibleFeatures & IncompatDirty
	if clean {
		bits |= img.hdr.IncompatibleFeatures & IncompatCorrupt
		img.needRebuild = false
	}
	img.markedDirty = false
	if bits == 0 {
		return nil
	}
	img.hdr.IncompatibleFeatures &^= bits
	return img.writeHeaderLocked()
}

// checkRefcountsLocked is one pass of QEMU's qcow2_check_refcounts.
func (img *Image) checkRefcountsLocked(ctx context.Context, res *CheckResult, fix RepairMode) error {
	k, err := img.calculateLocked(ctx, res, fix)
	if err != nil {
		return err
	}
	// Without a rebuild, a repair compares again from these counters.
	pre := res.counters()
	highest, err := k.compare(RepairNone)
	if err != nil {
		return err
	}
	// The comparison repaired nothing yet.
	if err := ctx.Err(); err != nil {
		return err
	}
	switch {
	case k.rebuild && fix == RepairAll:
		old := res.counters()
		res.msg("Rebuilding refcount structure")
		tOff, tClusters, err := img.rebuildStructureLocked(k.refs, true)
		if err != nil {
			res.CheckErrors++
			return err
		}
		res.Repairs = append(res.Repairs, Repair{Kind: RepairRebuild, Offset: uint64(tOff * img.clusterSize), After: uint64(tClusters)})
		res.Corruptions, res.Leaks = 0, 0
		// The new table replaced the old one: count again. Stopping
		// from here on leaves the old structures leaked.
		k, err = img.calculateLocked(ctx, res, RepairNone)
		if err != nil {
			return err
		}
		// The old structures are leaked now; anything else that
		// leaks was made by the rebuild.
		saved := res.counters()
		res.setCounters(CheckResult{})
		highest, err = k.compare(RepairLeaks)
		if err != nil {
			return err
		}
		if k.rebuild {
			res.msg("ERROR rebuilt refcount structure is still broken")
		}
		fresh := res.Leaks
		res.setCounters(saved)
		if res.Corruptions < old.Corruptions {
			res.CorruptionsFixed += old.Corruptions - res.Corruptions
		}
		if res.Leaks < old.Leaks {
			res.LeaksFixed += old.Leaks - res.Leaks
		}
		res.Leaks += fresh
	case fix != RepairNone:
		if k.rebuild {
			res.msg("ERROR need to rebuild refcount structures")
			res.CheckErrors++
			return ErrNeedRebuild
		}
		if res.Leaks != 0 || res.Corruptions != 0 {
			res.setCounters(pre)
			if highest, err = k.compare(fix); err != nil {
				return err
			}
		}
	}
	if err := img.checkCopiedLocked(ctx, res, fix); err != nil {
		return err
	}
	res.ImageEndOffset = (highest + 1) * img.clusterSize
	return nil
}
