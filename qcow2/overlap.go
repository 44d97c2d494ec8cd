package qcow2

import "encoding/binary"

// The metadata overlap check, QEMU's qcow2_check_metadata_overlap in its
// default "cached" mode, for the clusters the allocator hands out.
//
// A cluster the allocator returns has refcount 0. On a sound image no
// metadata has refcount 0, and the metadata the engine creates is always
// counted, so only metadata that was on disk at open can be hit: a damaged
// image whose refcounts call its L1 table, an L2 table, a refcount block,
// the snapshot table... free. metaAtOpen indexes those clusters once, so
// the check costs one map lookup per allocated cluster; a hit is confirmed
// against the live structures (overlapLocked), since the cluster may have
// been freed and legitimately reused since (an L2 table, an old refcount
// table), in which case it leaves the index.

// buildMetaIndexLocked indexes the host clusters of the metadata QEMU's
// cached overlap check covers (everything but inactive L2 tables).
func (img *Image) buildMetaIndexLocked() {
	cs := img.clusterSize
	idx := make(map[int64]struct{})
	span := func(off uint64, n int64) {
		if n <= 0 || off > uint64(1)<<62 {
			return
		}
		for c := int64(off) / cs; c <= (int64(off)+n-1)/cs; c++ {
			idx[c] = struct{}{}
		}
	}
	h := &img.hdr
	span(0, img.hdrClustersN*cs)
	span(h.L1TableOffset, int64(len(img.l1))*8)
	for _, e := range img.l1 {
		span(e&l1OffsetMask, 1)
	}
	span(h.RefcountTableOffset, int64(len(img.refTable))*8)
	for _, e := range img.refTable {
		span(e&refTableMask, 1)
	}
	if len(img.snapshots) > 0 {
		span(h.SnapshotsOffset, snapshotTableLen(img.snapshots))
	}
	for _, sn := range img.snapshots {
		span(sn.L1TableOffset, int64(sn.L1Size)*8)
	}
	for _, e := range h.Extensions {
		if e.Type == extBitmaps && len(e.Data) >= 24 {
			be := binary.BigEndian
			span(be.Uint64(e.Data[16:]), int64(be.Uint64(e.Data[8:])))
		}
	}
	delete(idx, 0) // offset 0 in a table means "none"; the header is checked below
	img.metaAtOpen = idx
}

// checkAllocOverlapLocked refuses to hand out host clusters [idx, idx+n)
// when one of them holds metadata, as QEMU's overlap check refuses the
// write that would follow: the image is marked corrupt and the request
// fails with EIO (a *CorruptionEvent). Nothing is allocated then.
func (img *Image) checkAllocOverlapLocked(idx, n int64) error {
	if img.metaAtOpen == nil {
		if err := img.checkRefTableLocked(); err != nil {
			return err
		}
		img.buildMetaIndexLocked()
	}
	if idx < img.hdrClustersN {
		return img.overlapEventLocked(idx)
	}
	if len(img.metaAtOpen) == 0 {
		return nil
	}
	for c := idx; c < idx+n; c++ {
		if _, ok := img.metaAtOpen[c]; !ok {
			continue
		}
		if img.overlapLocked(uint64(c*img.clusterSize), uint64(img.clusterSize), "") != "" {
			return img.overlapEventLocked(c)
		}
		delete(img.metaAtOpen, c) // no longer metadata: freed and reusable
	}
	return nil
}

// overlapEventLocked signals the corruption event for an allocation that
// would overwrite the metadata in host cluster c.
func (img *Image) overlapEventLocked(c int64) error {
	what := img.overlapLocked(uint64(c*img.clusterSize), uint64(img.clusterSize), "")
	if what == "" {
		what = "qcow2_header"
	}
	return img.fatalEventLocked(img.corruptionEventLocked("Preventing invalid write on metadata (overlaps with %s)", what))
}

// fatalEventLocked makes the image unusable for writes after the
// corruption event ev, as QEMU drops the driver, and returns the error the
// request fails with: EIO, worded as QEMU's strerror, wrapping ev so that
// callers can print its Message first as qemu-img does.
func (img *Image) fatalEventLocked(ev error) error {
	err := &requestEIO{ev: ev}
	img.fatalEvent = err
	return err
}

type requestEIO struct{ ev error }

func (e *requestEIO) Error() string { return "Input/output error" }
func (e *requestEIO) Unwrap() error { return e.ev }

// checkRefTableLocked runs once, before the first allocation. A refcount
// block past the end of the file reads as all free in QEMU: its clusters
// would be handed out over whatever they hold, and the block itself be
// written at the bogus offset, growing the file to it. For block 0 QEMU's
// allocator takes cluster 0, which its overlap check refuses, and so does
// this; another such block is refused as the snapshot guard refuses it
// (treeRefsFitLocked). A header cluster counted free is refused as QEMU
// refuses allocating cluster 0 (ovis never allocates it).
func (img *Image) checkRefTableLocked() error {
	size, err := img.file.Size()
	if err != nil {
		return err
	}
	for i, e := range img.refTable {
		if off := e & refTableMask; off != 0 && off >= uint64(size) {
			if i == 0 {
				return img.overlapEventLocked(0)
			}
			return img.fatalEventLocked(img.corruptionEventLocked("Refblock offset %#x beyond the end of the image (reftable index: %#x)", off, i))
		}
	}
	rc, err := img.refcountLocked(0)
	if err != nil {
		return err
	}
	if rc == 0 {
		return img.overlapEventLocked(0)
	}
	return nil
}
