package qcow2

import (
	"fmt"
)

// This file holds the refcount and allocation helpers the exclusive
// operations (snapshots, resize, amend) use: refcount updates and reads
// that load tables as needed, contiguous allocation, the clusters an L2
// entry or a whole L1 tree references, and deferred freeing.

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
	k, off, n, ok := img.entryRef(m)
	if !ok {
		return nil
	}
	return img.clustersOf(hostRef{kind: k, off: off, n: n})
}

// clustersOf returns the host clusters an L2 entry's reference r counts:
// a data cluster's one, a compressed cluster's every cluster its sectors
// touch.
func (img *Image) clustersOf(r hostRef) []int64 {
	if r.kind == refData {
		return []int64{int64(r.off) >> img.clusterBits}
	}
	first, last := img.refClusters(r)
	var out []int64
	for c := first; c <= last; c++ {
		out = append(out, int64(c))
	}
	return out
}

// addTreeRefsLocked adds delta to the refcount of every L2 table an L1
// table references and of every cluster those tables map.
func (img *Image) addTreeRefsLocked(l1 []uint64, delta int64) error {
	v := &treeVisitor{img: img, ref: func(r hostRef) error {
		if r.kind == refL2 {
			return img.refAddLocked(int64(r.off)>>img.clusterBits, delta)
		}
		for _, c := range img.clustersOf(r) {
			if err := img.refAddLocked(c, delta); err != nil {
				return fmt.Errorf("qcow2: L2 table at %#x entry %d: %w", r.table, r.index, err)
			}
		}
		return nil
	}}
	return v.tree(l1, false)
}

func (img *Image) clustersFor(n int64) int64 { return (n + img.clusterSize - 1) / img.clusterSize }

func (img *Image) freeRangeLocked(off uint64, n int64) {
	for i := int64(0); i < img.clustersFor(n); i++ {
		img.pendingFree = append(img.pendingFree, off+uint64(i*img.clusterSize))
	}
}
