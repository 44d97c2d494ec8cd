package qcow2

import (
	"fmt"
	"math"
)

// This file holds the comparison of the counted references with the
// refcounts on disk (QEMU's compare_refcounts), and the in-place refcount
// repairs it makes through the live refcount table.

// liveRefcounts reads and writes the refcounts stored in the image
// through the in-memory refcount table, writing through to the file.
// A misaligned refcount block is a corruption event reported on res.
type liveRefcounts struct {
	img    *Image
	res    *CheckResult
	blocks map[uint64][]byte
}

func (img *Image) liveRefcountsLocked(res *CheckResult) *liveRefcounts {
	return &liveRefcounts{img: img, res: res, blocks: make(map[uint64][]byte)}
}

// block returns the refcount block covering cluster i, or nil if none.
func (l *liveRefcounts) block(i int64) (uint64, []byte, error) {
	img := l.img
	b := i / img.rcPerBlock
	if b >= int64(len(img.refTable)) {
		return 0, nil, nil
	}
	off := img.refTable[b] & refTableMask
	if off == 0 {
		return 0, nil, nil
	}
	if off%uint64(img.clusterSize) != 0 {
		img.signalCorruptionLocked(l.res, "Refblock offset %s unaligned (reftable index: %s)", cHex(off), cHex(uint64(b)))
		return 0, nil, errIO
	}
	if buf, ok := l.blocks[off]; ok {
		return off, buf, nil
	}
	// QEMU's block layer refuses a request past the largest int64 with
	// EIO; short of that, bytes past the end of the file read as zeros.
	if off > math.MaxInt64-uint64(img.clusterSize) {
		return 0, nil, errIO
	}
	buf, err := img.readZeroFilled(off, img.clusterSize)
	if err != nil {
		return 0, nil, err
	}
	l.blocks[off] = buf
	return off, buf, nil
}

func (l *liveRefcounts) get(i int64) (uint64, error) {
	_, buf, err := l.block(i)
	if buf == nil || err != nil {
		return 0, err
	}
	return getRefcount(buf, i%l.img.rcPerBlock, l.img.rcBits), nil
}

func (l *liveRefcounts) set(i int64, v uint64) error {
	off, buf, err := l.block(i)
	if err != nil {
		return err
	}
	if buf == nil {
		return fmt.Errorf("qcow2: no refcount block for cluster %d", i)
	}
	setRefcount(buf, i%l.img.rcPerBlock, l.img.rcBits, v)
	if _, err := l.img.file.WriteAt(buf, int64(off)); err != nil {
		return fmt.Errorf("qcow2: writing refcount block at %#x: %w", off, err)
	}
	return nil
}

// compare compares the computed references with the stored refcounts
// (QEMU's compare_refcounts), repairing what fix allows: leaks with
// RepairLeaks or RepairAll, refcounts too low (but not 0) with RepairAll.
// A refcount of 0 under a reference needs a rebuild. It returns the
// highest cluster in use.
func (k *checker) compare(fix RepairMode) (int64, error) {
	img := k.img
	live := img.liveRefcountsLocked(k.res)
	res := k.res
	var highest int64
	for i := range int64(len(k.refs)) {
		rc, err := live.get(i)
		if err != nil {
			res.msg("Can't get refcount for cluster %d: %v", i, err)
			res.CheckErrors++
			continue
		}
		ref := k.refs[i]
		if rc > 0 || ref > 0 {
			highest = i
		}
		if rc == ref {
			continue
		}
		var fixed *int
		switch {
		case rc == 0:
			k.rebuild = true
		case rc > ref && fix != RepairNone:
			fixed = &res.LeaksFixed
		case rc < ref && fix == RepairAll:
			fixed = &res.CorruptionsFixed
		}
		word := "Leaked"
		switch {
		case fixed != nil:
			word = "Repairing"
		case rc < ref:
			word = "ERROR"
		}
		if fixed != nil {
			// Each repair is one refcount (and the freed cluster's
			// zeroing): stopping between them leaves leaks at worst.
			if err := k.ctx.Err(); err != nil {
				return highest, k.stopCompare(live, err)
			}
		}
		res.msg("%s cluster %d refcount=%d reference=%d", word, i, rc, ref)
		if fixed != nil {
			if err := live.set(i, ref); err == nil {
				if ref == 0 {
					// QEMU discards a cluster it frees; ovis never punches
					// holes (see hostholes.go), so it zeroes it instead and
					// the file reads as QEMU's repaired copy does.
					if err := img.zeroClusterLocked(i); err != nil {
						return highest, err
					}
				}
				*fixed++
				res.Repairs = append(res.Repairs, Repair{Kind: RepairRefcount, Cluster: i, Before: rc, After: ref})
				continue
			}
		}
		if rc < ref {
			res.Corruptions++
		} else {
			res.Leaks++
		}
	}
	if len(live.blocks) > 0 && fix != RepairNone {
		if err := img.file.Sync(); err != nil {
			return highest, fmt.Errorf("qcow2: syncing refcount repairs: %w", err)
		}
	}
	return highest, nil
}

// stopCompare syncs the refcount repairs made so far and returns err, the
// context's error that stopped compare.
func (k *checker) stopCompare(live *liveRefcounts, err error) error {
	if len(live.blocks) > 0 {
		if serr := k.img.file.Sync(); serr != nil {
			return fmt.Errorf("qcow2: syncing refcount repairs: %w", serr)
		}
	}
	return err
}
