package qcow2

import (
	"context"
	"errors"
	"fmt"
	"math/bits"
)

// AmendOptions are the image options qemu-img amend can change. Nil or
// zero fields are left alone.
type AmendOptions struct {
	// Compat "0.10" (or "v2") downgrades to version 2, "1.1" (or "v3")
	// upgrades to version 3.
	Compat string
	// Size is the new virtual size in bytes; 0 leaves it alone, as in
	// QEMU, and a negative size is refused. Shrinking drops the data past
	// the new end.
	Size int64
	// BackingFile and BackingFormat cannot be changed: giving either with
	// a value other than the image's own is refused with ErrAmendBacking.
	BackingFile, BackingFormat *string
	// DataFile renames the external data file ("" removes the name); only
	// for images that have one.
	DataFile *string
	// DataFileRaw can only be cleared, or set on an image that has it.
	DataFileRaw   *bool
	LazyRefcounts *bool
	// RefcountBits rewrites the refcount structures at a new width; 0
	// leaves the width alone and other values must be a power of two up
	// to 64.
	RefcountBits int
	// Progress, when not nil, is called as work is done with the work
	// done so far and the (projected) total, in QEMU's units, so that
	// 100*done/total is the figure qemu-img amend -p prints. It is called
	// with the image's locks held and must not use the image.
	Progress func(done, total int64)
}

// ErrAmendBacking is Amend's refusal to change the backing file or its
// format (qemu-img rebase does that).
var ErrAmendBacking = errors.New("Cannot amend the backing file")

// SetBacking rewrites the backing file name and format in the header (""
// removes the backing file), as qemu-img rebase -u does. The open backing
// device is not changed; reopen the image to use the new one.
func (img *Image) SetBacking(ctx context.Context, name, format string) error {
	return img.exclusive(ctx, func() error {
		if name != "" && img.dataFileRaw {
			return fmt.Errorf("qcow2: an image with data_file_raw cannot have a backing file")
		}
		old := img.hdr
		img.hdr.BackingFile, img.hdr.BackingFormat = name, format
		if name == "" {
			img.hdr.BackingFormat = ""
		}
		if _, err := img.hdr.Encode(); err != nil {
			img.hdr = old
			return err
		}
		return img.writeHeaderLocked()
	})
}

// Amend is Amend that stops between steps, and between L2 tables
// of a downgrade, once ctx is done, returning ctx's error. What was done
// stays done and consistent; Close flushes it. The refcount rewrite of a
// width change is one step and is not interrupted.
func (img *Image) Amend(ctx context.Context, o AmendOptions) error {
	p := &amendProgress{report: o.Progress}
	downgrade := false
	var grewFrom int64 = -1
	var zeroFrom int64 = -1 // grown over a longer backing file (resize.go)
	err := img.exclusive(ctx, func() error {
		if err := img.repairLocked(); err != nil {
			return err
		}
		version, newVersion, rcBits, err := img.checkAmendLocked(o)
		if err != nil {
			return err
		}
		if newVersion != version {
			p.total++
		}
		if rcBits != img.rcBits {
			p.total++
		}
		downgrade = newVersion < version
		if newVersion > version {
			if err := img.upgradeLocked(p); err != nil {
				return err
			}
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		if rcBits != img.rcBits {
			if newVersion < 3 && rcBits != 16 {
				return errors.New("Refcount widths other than 16 bits require compatibility level 1.1 or above (use compat=1.1 or greater)")
			}
			if err := img.changeRefcountWidthLocked(rcBits, p); err != nil {
				return err
			}
		}
		if err := img.amendHeaderLocked(o); err != nil {
			return err
		}
		if (o.BackingFile != nil || o.BackingFormat != nil) &&
			(!sameString(o.BackingFile, img.hdr.BackingFile) || !sameString(o.BackingFormat, img.hdr.BackingFormat)) {
			return ErrAmendBacking
		}
		if o.LazyRefcounts != nil && *o.LazyRefcounts != img.lazy {
			if err := img.setLazyLocked(*o.LazyRefcounts, newVersion); err != nil {
				return err
			}
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		if o.Size != 0 {
			old := img.size
			if err := img.amendSizeLocked(o.Size); err != nil {
				return err
			}
			if o.Size > old && img.dataFileRaw {
				grewFrom = old
			}
			if o.Size > old && img.backing != nil && img.backingSize > old {
				zeroFrom = old
			}
		}
		return nil
	})
	if err != nil {
		return err
	}
	// An image whose data file must stay a valid raw image maps all of it:
	// QEMU preallocates the metadata of what a resize adds.
	if grewFrom >= 0 {
		if err := img.preallocate(ctx, PreallocMetadata, grewFrom, false); err != nil {
			return fmt.Errorf("qcow2: amend: preallocating the grown range: %w", err)
		}
	}
	if zeroFrom >= 0 {
		if err := img.zeroGrown(ctx, zeroFrom, img.size); err != nil {
			return fmt.Errorf("Failed to zero out the new area: %w", err)
		}
	}
	if downgrade {
		if err := ctx.Err(); err != nil {
			return err
		}
		return img.exclusive(ctx, func() error { return img.downgradeLocked(ctx, p) })
	}
	return nil
}

// checkAmendLocked checks the options in the order of QEMU's option list,
// with its messages, and returns the image's version, the version asked
// for and the refcount width asked for.
func (img *Image) checkAmendLocked(o AmendOptions) (version, newVersion, rcBits int, err error) {
	version = 2
	if img.v3 {
		version = 3
	}
	newVersion, rcBits = version, img.rcBits
	switch o.Compat {
	case "":
	case "0.10", "v2":
		newVersion = 2
	case "1.1", "v3":
		newVersion = 3
	default:
		return 0, 0, 0, fmt.Errorf("Unknown compatibility level %s", o.Compat)
	}
	if o.DataFile != nil && !img.hasDataFile {
		return 0, 0, 0, errors.New("data-file can only be set for images that use an external data file")
	}
	if o.DataFileRaw != nil && *o.DataFileRaw && !img.dataFileRaw {
		return 0, 0, 0, errors.New("data-file-raw cannot be set on existing images")
	}
	if b := o.RefcountBits; b != 0 {
		if b < 0 || b > 64 || b&(b-1) != 0 {
			return 0, 0, 0, errors.New("Refcount width must be a power of two and may not exceed 64 bits")
		}
		rcBits = b
	}
	return version, newVersion, rcBits, nil
}

// repairLocked rebuilds the refcounts of an image left dirty by a crash
// with lazy refcounts, as the first write would (QEMU repairs it on open).
func (img *Image) repairLocked() error {
	if !img.needRebuild {
		return nil
	}
	if err := img.rebuildRefcountsLocked(); err != nil {
		return err
	}
	img.needRebuild = false
	img.hdr.IncompatibleFeatures &^= IncompatDirty
	return img.writeHeaderLocked()
}

// sameString reports whether an option that may be absent equals a header
// string, "" standing for an absent header field (QEMU's g_strcmp0 on
// possibly NULL strings): an absent option matches only an absent field,
// so giving the backing file alone fails for an image with a backing
// format.
func sameString(opt *string, hdr string) bool {
	if opt == nil {
		return hdr == ""
	}
	return hdr != "" && *opt == hdr
}

// Progress operations, as QEMU's Qcow2AmendOperation.
const (
	opNone = iota
	opUpgrade
	opRefcountWidth
	opDowngrade
)

// amendProgress turns the progress of each step into one figure for the
// whole amendment, as QEMU's qcow2_amend_helper_cb does: the steps not yet
// begun are projected to cost as much as the average step so far.
type amendProgress struct {
	report func(done, total int64)
	// total is the number of steps that report progress; completed counts
	// those finished.
	total, completed int
	last             int   // the step that reported last, opNone at first
	offsetCompleted  int64 // work of the completed steps
	lastWork         int64 // work of the step that reported last
}

// step reports that operation op has done off units of its work units.
func (p *amendProgress) step(op int, off, work int64) {
	if p.report == nil {
		return
	}
	if op != p.last {
		if p.last != opNone {
			p.offsetCompleted += p.lastWork
			p.completed++
		}
		p.last = op
	}
	p.lastWork = work
	current := p.offsetCompleted + work
	projected := current * int64(p.total-p.completed-1) / int64(p.completed+1)
	p.report(p.offsetCompleted+off, current+projected)
}

// upgradeLocked turns a version 2 image into version 3. Version 3 needs
// every snapshot to record its disk size, so the snapshot table is
// rewritten first when one does not.
func (img *Image) upgradeLocked(p *amendProgress) error {
	p.step(opUpgrade, 0, 2)
	rewrite := false
	for _, s := range img.snapshots {
		if !s.HasDiskSize {
			rewrite = true
		}
	}
	if rewrite {
		snaps := append([]Snapshot(nil), img.snapshots...)
		for i := range snaps {
			if !snaps[i].HasDiskSize {
				// QEMU's reading of an entry without one.
				snaps[i].DiskSize, snaps[i].HasDiskSize = uint64(img.size), true
			}
		}
		if err := img.writeSnapshotTableLocked(snaps); err != nil {
			return fmt.Errorf("Failed to update the snapshot table: %w", err)
		}
		if err := img.flushExclusiveLocked(); err != nil {
			return err
		}
	}
	p.step(opUpgrade, 1, 2)
	h := &img.hdr
	old := *h
	h.Version, h.HeaderLength, h.RefcountOrder = 3, 112, 4
	if img.clusterSize > 4096 {
		h.FeatureNames = defaultFeatureNames()
	}
	if err := img.writeHeaderLocked(); err != nil {
		img.hdr = old
		return fmt.Errorf("Failed to update the image header: %w", err)
	}
	img.v3 = true
	p.step(opUpgrade, 2, 2)
	return nil
}

// changeRefcountWidthLocked rewrites the refcount table and blocks with
// refcounts of the given width. A narrower width must hold every
// refcount: the first cluster (in host order) whose refcount does not fit
// is named in QEMU's words.
//
// Progress is reported as QEMU's three walks over the old refcount table
// (two that allocate the new structures, one that writes them), though
// ovis checks in the first and rebuilds in one pass before the third.
func (img *Image) changeRefcountWidthLocked(width int, p *amendProgress) error {
	n := int64(len(img.refTable))
	const walks = 3
	walk := func(w int, upTo int64) {
		for i := int64(0); i < upTo; i++ {
			p.step(opRefcountWidth, int64(w)*n+i, walks*n)
		}
	}
	if width < 64 {
		limit := uint64(1)<<width - 1
		for b := int64(0); b < n; b++ {
			if img.refTable[b]&refTableMask == 0 {
				continue
			}
			buf, err := img.refBlockExclusiveLocked(b)
			if err != nil {
				return err
			}
			for i := int64(0); i < img.rcPerBlock; i++ {
				if rc := getRefcount(buf, i, img.rcBits); rc > limit {
					walk(0, b+1)
					off := (b*img.rcPerBlock + i) << img.clusterBits
					return fmt.Errorf("Cannot decrease refcount entry width to %d bits: Cluster at offset %#x has a refcount of %d", width, off, rc)
				}
			}
		}
	}
	walkDone := func(w int) {
		walk(w, n)
		p.step(opRefcountWidth, int64(w+1)*n, walks*n)
	}
	walkDone(0)
	walkDone(1)
	if err := img.flushExclusiveLocked(); err != nil {
		return err
	}
	h := &img.hdr
	oldOrder, oldBits, oldPer := h.RefcountOrder, img.rcBits, img.rcPerBlock
	h.RefcountOrder = uint32(bits.TrailingZeros(uint(width)))
	img.rcBits = width
	img.rcPerBlock = img.clusterSize * 8 / int64(width)
	// The new table and blocks are written and synced before the header
	// that names them and their width.
	if err := img.rebuildRefcountsLocked(); err != nil {
		h.RefcountOrder, img.rcBits, img.rcPerBlock = oldOrder, oldBits, oldPer
		return fmt.Errorf("qcow2: amend: rewriting refcounts at %d bits: %w", width, err)
	}
	walkDone(2)
	return nil
}

// refBlockExclusiveLocked returns a copy of refcount block b of the
// refcount table, which must have one. Only inside exclusive.
func (img *Image) refBlockExclusiveLocked(b int64) ([]byte, error) {
	var buf []byte
	err := img.retryExclusiveLocked(func() error {
		e, err := img.refBlockLocked(b * img.rcPerBlock)
		if err != nil {
			return err
		}
		buf = append([]byte(nil), e.buf...)
		return nil
	})
	return buf, err
}

// amendHeaderLocked writes the data file options into the header, which
// QEMU rewrites at this step whether or not they changed.
func (img *Image) amendHeaderLocked(o AmendOptions) error {
	h := &img.hdr
	old := *h
	if o.DataFileRaw != nil {
		if *o.DataFileRaw {
			h.AutoclearFeatures |= AutoclearDataFileRaw
		} else {
			h.AutoclearFeatures &^= AutoclearDataFileRaw
		}
	}
	if o.DataFile != nil {
		h.DataFile = *o.DataFile
	}
	if err := img.writeHeaderLocked(); err != nil {
		img.hdr = old
		return fmt.Errorf("Failed to update the image header: %w", err)
	}
	img.dataFileRaw = h.DataFileRaw()
	return nil
}

// setLazyLocked switches lazy refcounts on (version 3 only) or off. The
// engine keeps refcounts exact either way, so turning them off only needs
// the dirty bit cleared.
func (img *Image) setLazyLocked(on bool, newVersion int) error {
	h := &img.hdr
	old := *h
	if on {
		if newVersion < 3 {
			return errors.New("Lazy refcounts only supported with compatibility level 1.1 and above (use compat=1.1 or greater)")
		}
		h.CompatibleFeatures |= CompatLazyRefcounts
	} else {
		h.CompatibleFeatures &^= CompatLazyRefcounts
		h.IncompatibleFeatures &^= IncompatDirty
	}
	if err := img.writeHeaderLocked(); err != nil {
		img.hdr = old
		return fmt.Errorf("Failed to update the image header: %w", err)
	}
	img.lazy = on
	if !on {
		img.markedDirty = false
	}
	return nil
}

// amendSizeLocked resizes the image as QEMU's qcow2_co_truncate does for
// amend: without preallocation, growing or shrinking, with snapshots too
// (but not in version 2).
func (img *Image) amendSizeLocked(size int64) error {
	switch {
	case size < 0:
		return errors.New("Image size cannot be negative")
	case size%512 != 0:
		return errors.New("The new size must be a multiple of 512")
	case len(img.snapshots) > 0 && !img.v3:
		return errors.New("Can't resize a v2 image which has snapshots")
	case size == img.size:
		return nil
	case size > img.size:
		need := l1EntriesFor(uint64(size), img.clusterBits, img.hdr.L2EntrySize())
		if need*8 > maxL1Bytes {
			return errors.New("Failed to grow the L1 table: File too large")
		}
		if img.backing != nil && img.backingSize > img.size && !img.v3 && img.zeroStepNeedsFlags(img.size, size, PreallocOff) {
			return errZeroNewClusters
		}
		return img.growLocked(size)
	}
	if err := img.unshareTailLocked(size); err != nil {
		return err
	}
	return img.shrinkLocked(size)
}

// unshareTailLocked gives the active layer its own copy of every L2 table
// that it shares with a snapshot and that a shrink to size would edit in
// place (a table that keeps some entries and loses others). Tables that
// are dropped whole are only dereferenced, which is safe when shared.
func (img *Image) unshareTailLocked(size int64) error {
	firstGone := (size + img.clusterSize - 1) >> img.clusterBits
	need := int(l1EntriesFor(uint64(size), img.clusterBits, img.hdr.L2EntrySize()))
	for i := 0; i < need && i < len(img.l1); i++ {
		e := img.l1[i]
		l2off := e & l1OffsetMask
		if l2off == 0 || e&flagCopied != 0 || int64(i+1)*img.l2Entries <= firstGone {
			continue
		}
		rc, err := img.refcountExclusiveLocked(int64(l2off) >> img.clusterBits)
		if err != nil {
			return err
		}
		if rc <= 1 {
			continue
		}
		buf, err := img.readTableFile(l2off, img.clusterSize)
		if err != nil {
			return err
		}
		// The copy maps the same clusters, which the snapshot's table
		// keeps referencing: their refcounts stay.
		off, err := img.allocExclusiveLocked(1)
		if err != nil {
			return err
		}
		if _, err := img.file.WriteAt(buf, int64(off)); err != nil {
			return fmt.Errorf("qcow2: writing L2 table copy at %#x: %w", off, err)
		}
		img.l1[i] = off | flagCopied
		img.l1Dirty[i] = struct{}{}
		img.pendingFree = append(img.pendingFree, l2off)
		img.forgetTableLocked(l2off)
	}
	return img.flushExclusiveLocked()
}

// downgradeLocked turns a version 3 image into version 2 as QEMU's
// qcow2_downgrade does: it refuses what version 2 cannot hold, turns zero
// clusters into clusters version 2 reads as zeros, in the active layer and
// in every snapshot, and leaves zstd only when nothing is compressed.
func (img *Image) downgradeLocked(ctx context.Context, p *amendProgress) error {
	h := &img.hdr
	if img.rcBits != 16 {
		return errors.New("compat=0.10 requires refcount_bits=16")
	}
	if img.hasDataFile {
		return errors.New("Cannot downgrade an image with a data file")
	}
	for _, s := range img.snapshots {
		if s.VMStateSize != 0 || (s.HasDiskSize && int64(s.DiskSize) != img.size) {
			return errors.New("Internal snapshots prevent downgrade of image")
		}
	}
	if img.markedDirty || h.IncompatibleFeatures&IncompatDirty != 0 {
		h.IncompatibleFeatures &^= IncompatDirty
		if err := img.writeHeaderLocked(); err != nil {
			return fmt.Errorf("Failed to make the image clean: %w", err)
		}
		img.markedDirty = false
	}
	if f := h.IncompatibleFeatures &^ IncompatCompression; f != 0 {
		return fmt.Errorf("Cannot downgrade an image with incompatible features %#x set", f)
	}
	if err := img.expandZeroClustersLocked(ctx, p); err != nil {
		return fmt.Errorf("Failed to turn zero into data clusters: %w", err)
	}
	if img.compression != CompressionDeflate {
		compressed, err := img.hasCompressedLocked()
		if err != nil {
			return fmt.Errorf("Failed to check block status: %w", err)
		}
		if compressed {
			return errors.New("Cannot downgrade an image with zstd compression type and existing compressed clusters")
		}
	}
	old := *h
	h.Version, h.HeaderLength = 2, v2HeaderLen
	h.FeatureNames, h.Trailing = nil, nil
	h.IncompatibleFeatures, h.CompatibleFeatures, h.AutoclearFeatures = 0, 0, 0
	h.CompressionType = CompressionDeflate
	if err := img.writeHeaderLocked(); err != nil {
		img.hdr = old
		return fmt.Errorf("Failed to update the image header: %w", err)
	}
	img.v3, img.lazy, img.dataFileRaw = false, false, false
	img.compression = CompressionDeflate
	return nil
}

// hasCompressedLocked reports whether the active layer maps a compressed
// cluster (QEMU looks no further).
func (img *Image) hasCompressedLocked() (bool, error) {
	for _, e := range img.l1 {
		l2off := e & l1OffsetMask
		if l2off == 0 {
			continue
		}
		buf, err := img.readTableFile(l2off, img.clusterSize)
		if err != nil {
			return false, err
		}
		for j := int64(0); j < img.l2Entries; j++ {
			if img.readEntry(buf, j).entry&flagCompressed != 0 {
				return true, nil
			}
		}
	}
	return false, nil
}

// expandZeroClustersLocked rewrites every zero cluster of the active layer
// and then of each snapshot so that version 2 reads it as zeros, reporting
// progress once per L1 entry as QEMU does. The active tables are done
// first and written to disk, so a table shared with a snapshot is found
// already expanded when the snapshot's turn comes.
func (img *Image) expandZeroClustersLocked(ctx context.Context, p *amendProgress) error {
	if err := img.flushExclusiveLocked(); err != nil {
		return err
	}
	total := int64(len(img.l1))
	for _, s := range img.snapshots {
		total += int64(s.L1Size)
	}
	var visited int64
	l1s := [][]uint64{img.l1}
	for _, s := range img.snapshots {
		l1, err := img.readL1Exclusive(s)
		if err != nil {
			return fmt.Errorf("snapshot %q: %w", s.Name, err)
		}
		l1s = append(l1s, l1)
	}
	for _, l1 := range l1s {
		for _, e := range l1 {
			if err := ctx.Err(); err != nil {
				return err // each table is expanded whole, so this is consistent
			}
			if l2off := e & l1OffsetMask; l2off != 0 {
				if err := img.expandZeroTableLocked(l2off); err != nil {
					return err
				}
			}
			visited++
			p.step(opDowngrade, visited, total)
		}
	}
	return nil
}

// expandZeroTableLocked expands the zero clusters of the L2 table at
// l2off, which as many L1 tables reference as its refcount says.
//
//   - A zero cluster with nothing allocated becomes unallocated when no
//     backing file shows through, else a new zeroed cluster.
//   - A preallocated zero cluster is zeroed in place, unless another table
//     references its host cluster too (a snapshot taken before the zero
//     write): that one is left alone and the entry gets a new cluster.
//
// New clusters are zeroed and counted durably before the table points at
// them, and clusters the table stops using are released after.
func (img *Image) expandZeroTableLocked(l2off uint64) error {
	l2rc, err := img.refcountExclusiveLocked(int64(l2off) >> img.clusterBits)
	if err != nil {
		return err
	}
	buf, err := img.readTableFile(l2off, img.clusterSize)
	if err != nil {
		return err
	}
	hasBacking := img.hdr.BackingFile != ""
	zero := make([]byte, img.clusterSize)
	var released []uint64
	changed := false
	for j := int64(0); j < img.l2Entries; j++ {
		m := img.readEntry(buf, j)
		if m.entry&flagZero == 0 || m.entry&flagCompressed != 0 {
			continue
		}
		changed = true
		host := m.entry & l2OffsetMask
		if host == 0 && !hasBacking {
			img.writeEntry(buf, j, mapping{})
			continue
		}
		fresh := host == 0
		if !fresh {
			rc, err := img.refcountExclusiveLocked(int64(host) >> img.clusterBits)
			if err != nil {
				return err
			}
			if rc > l2rc {
				fresh = true
				for k := uint64(0); k < l2rc; k++ {
					released = append(released, host)
				}
			}
		}
		if fresh {
			if host, err = img.allocExclusiveLocked(1); err != nil {
				return err
			}
			// Every L1 table that reaches this table reaches the cluster.
			if l2rc > 1 {
				if err := img.refAddLocked(int64(host)>>img.clusterBits, int64(l2rc-1)); err != nil {
					return err
				}
			}
		}
		if _, err := img.file.WriteAt(zero, int64(host)); err != nil {
			return fmt.Errorf("qcow2: zeroing cluster at %#x: %w", host, err)
		}
		entry := host
		if l2rc == 1 {
			entry |= flagCopied
		}
		img.writeEntry(buf, j, mapping{entry: entry})
	}
	if !changed {
		return nil
	}
	if err := img.flushExclusiveLocked(); err != nil {
		return err
	}
	if err := img.writeTableLocked(l2off, buf); err != nil {
		return err
	}
	if err := img.file.Sync(); err != nil {
		return err
	}
	img.pendingFree = append(img.pendingFree, released...)
	return img.flushExclusiveLocked()
}
