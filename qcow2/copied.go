package qcow2

// This file holds the upkeep of the COPIED flags (bit 63 of L1 and L2
// entries, set when the refcount is exactly one) after an operation that
// changes refcounts wholesale: refreshing them from the refcounts,
// clearing them, and setting them by a caller's rule.

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
