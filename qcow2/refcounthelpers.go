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

func (img *Image) clustersFor(n int64) int64 { return (n + img.clusterSize - 1) / img.clusterSize }

func (img *Image) freeRangeLocked(off uint64, n int64) {
	for i := int64(0); i < img.clustersFor(n); i++ {
		img.pendingFree = append(img.pendingFree, off+uint64(i*img.clusterSize))
	}
}
