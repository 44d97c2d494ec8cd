package qcow2

import (
	"encoding/binary"
	"fmt"

	"github.com/ovis-storage/ovis/block"
)

// RepairMode selects what Check repairs (qemu-img check -r).
type RepairMode int

const (
	RepairNone  RepairMode = iota
	RepairLeaks            // -r leaks
	RepairAll              // -r all
)

// CheckResult is what Check found, with qemu-img check's counters.
type CheckResult struct {
	CheckErrors        int
	Corruptions        int
	Leaks              int
	CorruptionsFixed   int
	LeaksFixed         int
	ImageEndOffset     int64
	TotalClusters      int64
	AllocatedClusters  int64
	FragmentedClusters int64
	CompressedClusters int64
	// Messages are the lines qemu-img prints for each problem, in order.
	Messages []string
}

func (r *CheckResult) msg(format string, args ...any) {
	r.Messages = append(r.Messages, fmt.Sprintf(format, args...))
}

// checker walks the metadata as it is on disk, counting references and
// recording problems instead of failing on them.
type checker struct {
	img      *Image
	res      *CheckResult
	fileSize int64
	refs     []uint64 // computed references per host cluster
	// prevData is the host offset after the last data cluster of the
	// active L1, for the fragmentation count.
	prevData uint64
}

func (k *checker) inc(off uint64, n int64) {
	if n <= 0 {
		return
	}
	cs := uint64(k.img.clusterSize)
	first, last := off/cs, (off+uint64(n)-1)/cs
	for i := first; i <= last; i++ {
		if i >= uint64(len(k.refs)) {
			k.res.CheckErrors++
			k.res.msg("ERROR: counting reference for region exceeding the end of the file by one cluster or more: offset %#x size %#x", off, n)
			return
		}
		k.refs[i]++
	}
}

func (k *checker) readTable(off uint64, n int64) ([]byte, error) {
	buf := make([]byte, n)
	if err := block.ReadFull(k.img.file, buf, int64(off)); err != nil {
		return nil, err
	}
	return buf, nil
}

// l1 counts one L1 table and the L2 tables and data it maps. active
// selects the COPIED and fragmentation bookkeeping.
func (k *checker) l1(off uint64, size uint32, active bool) error {
	img := k.img
	cs := img.clusterSize
	if off%uint64(cs) != 0 || int64(off)+int64(size)*8 > k.fileSize {
		k.res.Corruptions++
		k.res.msg("ERROR: L1 table at %#x (%d entries) is misaligned or outside the image", off, size)
		return nil
	}
	k.inc(off, int64(size)*8)
	raw, err := k.readTable(off, int64(size)*8)
	if err != nil {
		return err
	}
	for i := uint32(0); i < size; i++ {
		e := binary.BigEndian.Uint64(raw[i*8:])
		l2off := e & l1OffsetMask
		if l2off == 0 {
			continue
		}
		if l2off%uint64(cs) != 0 {
			k.res.Corruptions++
			k.res.msg("ERROR l2_offset=%x: Table is not cluster aligned; L1 entry corrupted", l2off)
			continue
		}
		k.inc(l2off, cs)
		if int64(l2off)+cs > k.fileSize {
			continue
		}
		l2, err := k.readTable(l2off, cs)
		if err != nil {
			return err
		}
		k.l2(l2, active)
	}
	return nil
}

func (k *checker) l2(buf []byte, active bool) {
	img := k.img
	cs := uint64(img.clusterSize)
	for j := int64(0); j < img.l2Entries; j++ {
		m := img.readEntry(buf, j)
		if m.entry&flagCompressed != 0 {
			if img.extL2 && m.bitmap != 0 {
				k.res.Corruptions++
				k.res.msg("ERROR compressed cluster %d with data file or non-zero subcluster allocation bitmap, entry=%#x", j, m.entry)
			}
			off, n := img.compressedRange(m.entry)
			k.inc(off&^511, n+int64(off&511))
			if active {
				k.res.AllocatedClusters++
				k.res.CompressedClusters++
				k.res.FragmentedClusters++
			}
			continue
		}
		h, has := img.host(m)
		if !has {
			continue
		}
		if img.extL2 && uint32(m.bitmap)&uint32(m.bitmap>>32) != 0 {
			k.res.Corruptions++
			k.res.msg("ERROR invalid cluster entry: %#x bitmap %#x (subcluster both allocated and zero)", m.entry, m.bitmap)
		}
		if h%cs != 0 {
			k.res.Corruptions++
			k.res.msg("ERROR offset=%x: Cluster is not properly aligned; L2 entry corrupted.", h)
			continue
		}
		if active {
			k.res.AllocatedClusters++
			if k.prevData != 0 && h != k.prevData {
				k.res.FragmentedClusters++
			}
			k.prevData = h + cs
		}
		if !img.hasDataFile {
			k.inc(h, int64(cs))
		}
	}
}

// Check verifies the image's metadata as qemu-img check does, and repairs
// it with RepairLeaks or RepairAll (the image must be open read-write).
// Dirty cached metadata is flushed first.
func (img *Image) Check(repair RepairMode) (*CheckResult, error) {
	if repair != RepairNone && img.ro {
		return nil, errReadOnly
	}
	img.gate.Lock()
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
	res, refs, stored, err := img.checkLocked()
	if err != nil || repair == RepairNone || (res.Corruptions == 0 && res.Leaks == 0) {
		return res, err
	}
	// Repair: rebuild from the computed references (RepairAll), or drop
	// only refcounts that are too high (RepairLeaks).
	fixed := &CheckResult{}
	if repair == RepairAll {
		if err := img.rebuildRefcountsLocked(); err != nil {
			return res, err
		}
		fixed.LeaksFixed, fixed.CorruptionsFixed = res.Leaks, res.Corruptions
	} else {
		for i, want := range refs {
			if stored[i] > want {
				e, err := img.refBlockForRepairLocked(int64(i))
				if err != nil {
					return res, err
				}
				setRefcount(e.buf, int64(i)%img.rcPerBlock, img.rcBits, want)
				img.rc.markDirtyLocked(e)
				img.freeHint = min(img.freeHint, int64(i))
				fixed.LeaksFixed++
			}
		}
		ts := img.rc.dirtyLocked()
		if err := img.rc.writeTables(ts); err != nil {
			return res, err
		}
		if err := img.file.Sync(); err != nil {
			return res, err
		}
		img.rc.cleanLocked(ts)
	}
	after, _, _, err := img.checkLocked()
	if err != nil {
		return res, err
	}
	after.LeaksFixed, after.CorruptionsFixed = fixed.LeaksFixed, fixed.CorruptionsFixed
	after.Messages = append(res.Messages, after.Messages...)
	return after, nil
}

// refBlockForRepairLocked reads the refcount block covering cluster i
// into the cache (with mu held; repair runs with everything stopped).
func (img *Image) refBlockForRepairLocked(i int64) (e *cacheEntry, err error) {
	err = img.retryExclusiveLocked(func() (err error) {
		e, err = img.refBlockLocked(i)
		return err
	})
	if err == nil && e == nil {
		return nil, fmt.Errorf("qcow2: no refcount block for cluster %d", i)
	}
	return e, err
}

// checkLocked computes references and compares them with the stored
// refcounts. It returns the computed and stored counts per cluster.
func (img *Image) checkLocked() (*CheckResult, []uint64, []uint64, error) {
	fileSize, err := img.file.Size()
	if err != nil {
		return nil, nil, nil, err
	}
	cs := img.clusterSize
	res := &CheckResult{TotalClusters: (img.size + cs - 1) / cs}
	k := &checker{img: img, res: res, fileSize: fileSize, refs: make([]uint64, (fileSize+cs-1)/cs)}
	k.inc(0, cs)
	if err := k.l1(img.hdr.L1TableOffset, img.hdr.L1Size, true); err != nil {
		return nil, nil, nil, err
	}
	if len(img.snapshots) > 0 {
		k.inc(img.hdr.SnapshotsOffset, snapshotTableLen(img.snapshots))
	}
	for _, s := range img.snapshots {
		if err := k.l1(s.L1TableOffset, s.L1Size, false); err != nil {
			return nil, nil, nil, err
		}
	}
	k.inc(img.hdr.RefcountTableOffset, int64(img.hdr.RefcountTableClusters)*cs)
	bm := &refCounter{img: img, refs: make([]uint32, len(k.refs))}
	if err := img.countBitmaps(bm, fileSize); err != nil {
		res.Corruptions++
		res.msg("ERROR bitmaps: %v", err)
	}
	for i, n := range bm.refs {
		k.refs[i] += uint64(n)
	}
	// Refcount blocks.
	rt, err := k.readTable(img.hdr.RefcountTableOffset, int64(img.hdr.RefcountTableClusters)*cs)
	if err != nil {
		return nil, nil, nil, err
	}
	blocks := make([]uint64, len(rt)/8)
	for i := range blocks {
		off := binary.BigEndian.Uint64(rt[i*8:]) & refTableMask
		if off == 0 {
			continue
		}
		if off%uint64(cs) != 0 {
			res.Corruptions++
			res.msg("ERROR refcount block %d is not cluster aligned; refcount table entry corrupted", i)
			continue
		}
		if int64(off) >= fileSize {
			res.Corruptions++
			res.msg("ERROR refcount block %d is outside image", i)
			continue
		}
		blocks[i] = off
		k.inc(off, cs)
	}
	// Compare with the stored refcounts.
	stored := make([]uint64, len(k.refs))
	var blk []byte
	var blkOff uint64
	highest := int64(-1)
	for i := range k.refs {
		b := int64(i) / img.rcPerBlock
		var rc uint64
		if b < int64(len(blocks)) && blocks[b] != 0 {
			if blkOff != blocks[b] {
				if blk, err = k.readTable(blocks[b], cs); err != nil {
					return nil, nil, nil, err
				}
				blkOff = blocks[b]
			}
			rc = getRefcount(blk, int64(i)%img.rcPerBlock, img.rcBits)
		}
		stored[i] = rc
		ref := k.refs[i]
		if rc > 0 || ref > 0 {
			highest = int64(i)
		}
		switch {
		case rc < ref:
			res.Corruptions++
			res.msg("ERROR cluster %d refcount=%d reference=%d", i, rc, ref)
		case rc > ref:
			res.Leaks++
			res.msg("Leaked cluster %d refcount=%d reference=%d", i, rc, ref)
		}
	}
	res.ImageEndOffset = (highest + 1) * cs
	img.checkCopiedLocked(res, stored)
	return res, k.refs, stored, nil
}

// checkCopiedLocked reports COPIED flags of the active tables that
// disagree with the stored refcounts.
func (img *Image) checkCopiedLocked(res *CheckResult, stored []uint64) {
	cs := uint64(img.clusterSize)
	rc := func(off uint64) uint64 {
		if i := off / cs; i < uint64(len(stored)) {
			return stored[i]
		}
		return 0
	}
	for i, e := range img.l1 {
		l2off := e & l1OffsetMask
		if l2off == 0 || l2off%cs != 0 || l2off+cs > uint64(len(stored))*cs {
			continue
		}
		if r := rc(l2off); (r == 1) != (e&flagCopied != 0) {
			res.Corruptions++
			res.msg("ERROR OFLAG_COPIED L2 cluster: l1_index=%d l1_entry=%x refcount=%d", i, e, r)
		}
		buf := make([]byte, cs)
		if err := block.ReadFull(img.file, buf, int64(l2off)); err != nil {
			continue
		}
		for j := int64(0); j < img.l2Entries; j++ {
			m := img.readEntry(buf, j)
			h, has := img.host(m)
			if !has || m.entry&flagCompressed != 0 || img.hasDataFile || h%cs != 0 {
				continue
			}
			if r := rc(h); (r == 1) != (m.entry&flagCopied != 0) {
				res.Corruptions++
				res.msg("ERROR OFLAG_COPIED data cluster: l2_entry=%x refcount=%d", m.entry, r)
			}
		}
	}
}
