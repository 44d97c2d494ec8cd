package qcow2

import (
	"context"
	"errors"
	"fmt"
	"io"
	"slices"

	"golang.org/x/sys/unix"

	"github.com/ovis-storage/ovis/block"
)

// errZeroNewClusters is QEMU's refusal to grow a version 2 image over a
// longer backing file: it cannot mark the new clusters as zeros.
var errZeroNewClusters = errors.New("Failed to zero out new clusters: Operation not supported")

// Resize is Resize whose preallocation stops between runs of
// clusters once ctx is done, returning ctx's error: what it mapped stays
// mapped and consistent, and Close flushes it.
//
// Growth follows QEMU's qcow2_co_truncate: the new range reads as zeros
// even where a backing file longer than the old size has data (QEMU's
// block layer asks for BDRV_REQ_ZERO_WRITE then); preallocation starts at
// the old end, so the cluster holding an unaligned old end is allocated
// too; an image whose raw data file mirrors it gets its new range mapped
// onto that file.
func (img *Image) Resize(ctx context.Context, size int64, shrink bool, prealloc string) error {
	if size%512 != 0 || size < 0 {
		return fmt.Errorf("qcow2: the new size %d must be a non-negative multiple of 512", size)
	}
	if prealloc == "" {
		prealloc = PreallocOff
	}
	old := img.size
	zeroNew := false
	err := img.exclusive(ctx, func() error {
		if len(img.snapshots) > 0 && !img.v3 {
			// Version 2 snapshot entries carry no disk size.
			return errors.New("Can't resize a v2 image which has snapshots")
		}
		if size == img.size {
			return nil
		}
		if size < img.size && !shrink {
			return fmt.Errorf("qcow2: shrinking from %d to %d bytes needs shrink", img.size, size)
		}
		zeroNew = size > img.size && img.backing != nil && img.backingSize > img.size
		if zeroNew && img.zeroStepNeedsFlags(old, size, prealloc) && !img.v3 {
			// QEMU fails the same way, after the preallocation and
			// before the header's size changes; refusing first leaves
			// the image as it was.
			return errZeroNewClusters
		}
		if zeroNew && img.extL2 && prealloc == PreallocOff {
			// QEMU cannot zero some subclusters of a compressed cluster.
			zs := alignUp(old, img.subSize)
			if zs < size && zs&(img.clusterSize-1) != 0 {
				var m mapping
				err := img.retryExclusiveLocked(func() (err error) {
					m, err = img.lookupLocked(old >> img.clusterBits)
					return err
				})
				if err != nil {
					return err
				}
				if m.entry&flagCompressed != 0 {
					return errZeroNewClusters
				}
			}
		}
		storeBitmaps, err := img.resizeBitmapsLocked(size)
		if err != nil {
			return err
		}
		if size < img.size {
			if err := img.unshareTailLocked(size); err != nil {
				return err
			}
			if err := img.shrinkLocked(size); err != nil {
				return err
			}
		} else if err := img.growLocked(size); err != nil {
			return err
		}
		return storeBitmaps()
	})
	if err != nil || size <= old {
		return err
	}
	if img.dataFileRaw && prealloc == PreallocOff {
		// As QEMU: the raw data file and the image must read alike, so
		// the new range is mapped onto the data file.
		prealloc = PreallocMetadata
	}
	var stopped error
	if prealloc != PreallocOff {
		err := img.preallocate(ctx, prealloc, old, zeroNew)
		if err != nil && ctx.Err() == nil {
			return err
		}
		// Stopped early, the new range must still hide the backing file.
		stopped = err
	} else if img.hasDataFile {
		// QEMU truncates the data file to the new size, exactly.
		if err := img.data.Truncate(size); err != nil {
			return fmt.Errorf("qcow2: resizing the data file: %w", err)
		}
	}
	if zeroNew && (img.zeroStepNeeded(prealloc) || stopped != nil) {
		if err := img.zeroGrown(ctx, old, size); err != nil {
			return fmt.Errorf("Failed to zero out the new area: %w", err)
		}
	}
	if err := img.Flush(ctx); err != nil {
		return err
	}
	return stopped
}

// zeroStepNeeded reports whether growing with prealloc zeroes the new
// range afterwards. falloc and full allocate fresh (zero) clusters for all
// of it in QEMU, unless there is a data file.
func (img *Image) zeroStepNeeded(prealloc string) bool {
	return img.hasDataFile || (prealloc != PreallocFalloc && prealloc != PreallocFull)
}

// zeroStepNeedsFlags reports whether zeroing the range grown from old to
// size needs zero flags (which version 2 lacks): whole subclusters past
// the old end, which QEMU marks rather than writes.
func (img *Image) zeroStepNeedsFlags(old, size int64, prealloc string) bool {
	return img.zeroStepNeeded(prealloc) && alignUp(old, img.subSize) < size
}

func alignUp(n, a int64) int64 { return (n + a - 1) / a * a }

// zeroGrown makes [old, size) read as zeros, as QEMU's qcow2_co_truncate
// does after growing over a longer backing file: the subclusters past the
// old end get the zero flag (keeping any host cluster, as without
// BDRV_REQ_MAY_UNMAP), the rest of the subcluster holding the old end is
// written with zeros.
func (img *Image) zeroGrown(ctx context.Context, old, size int64) error {
	if !img.v3 {
		// No zero flag: reached when the range lies within the old end's
		// cluster (QEMU refuses more) or falloc or full stopped early.
		return img.WriteZeroes(ctx, old, size-old, block.NoUnmap)
	}
	// As a write would, but leaving dirty bitmaps alone: QEMU zeroes
	// below the layer that records writes.
	img.mu.Lock()
	need := img.needRebuild || (img.lazy && !img.markedDirty) || img.bm.pending.Load()
	img.mu.Unlock()
	if need {
		if err := img.beforeFirstWrite(); err != nil {
			return err
		}
	}
	start := min(alignUp(old, img.subSize), size)
	if start > old {
		if _, err := img.WriteAt(ctx, make([]byte, start-old), old, 0); err != nil {
			return err
		}
	}
	all := uint32(1<<img.nsub - 1)
	for off := start; off < size; {
		c := off >> img.clusterBits
		first := (off & (img.clusterSize - 1)) / img.subSize
		mask := all &^ (1<<first - 1)
		if err := img.zeroSubclusters(ctx, c, mask, false, false); err != nil {
			return err
		}
		if err := img.endWrite(true, false); err != nil { // keeps the caches bounded
			return err
		}
		off = (c + 1) << img.clusterBits
	}
	return nil
}

// growDataFile extends the external data file to size if it is shorter,
// reserving (falloc) or writing (full) the added range, as QEMU's
// preallocate_co and the data file's truncate do.
func (img *Image) growDataFile(size int64, mode string) error {
	cur, err := img.data.Size()
	if err != nil {
		return err
	}
	if size <= cur {
		return nil
	}
	if err := img.data.Truncate(size); err != nil {
		return fmt.Errorf("qcow2: extending the data file: %w", err)
	}
	return img.reserveHost(mode, cur, size-cur)
}

// reserveHost gives [off, off+n) of the data file its host space: falloc
// reserves it, full writes zeros. A file system without fallocate gets
// zeros written, as QEMU falls back to.
func (img *Image) reserveHost(mode string, off, n int64) error {
	if n <= 0 {
		return nil
	}
	switch mode {
	case PreallocFalloc:
		if of, ok := img.data.(*block.OSFile); ok {
			err := unix.Fallocate(int(of.Fd()), 0, off, n)
			if err == nil {
				return nil
			}
			if !errors.Is(err, unix.EOPNOTSUPP) {
				return fmt.Errorf("Could not preallocate new data: %w", err)
			}
		}
		fallthrough
	case PreallocFull:
		zero := make([]byte, min(n, 1<<20))
		for end := off + n; off < end; off += int64(len(zero)) {
			if _, err := img.data.WriteAt(zero[:min(int64(len(zero)), end-off)], off); err != nil {
				return fmt.Errorf("Could not write zeros for preallocation: %w", err)
			}
		}
	}
	return nil
}

// preallocOldEnd allocates the cluster holding an unaligned old end from
// as QEMU's preallocation does, since its range starts at the old end and
// not at the next cluster. Without extended L2, the cluster moves to a
// fresh host cluster holding only its head (copied from where it read
// before, the backing file included) unless metadata finds it allocated
// already; falloc and full always start it afresh. With extended L2,
// QEMU's preallocation leaves the subcluster bitmap alone: the cluster
// only gets a host cluster of its own, except when falloc or full must
// hide a backing file (zeroNew), where every subcluster is allocated. It
// returns the end of a fresh host cluster it placed, or 0.
func (img *Image) preallocOldEnd(ctx context.Context, mode string, from int64, zeroNew bool) (hostEnd int64, err error) {
	in := from & (img.clusterSize - 1)
	if in == 0 {
		return 0, nil
	}
	c := from >> img.clusterBits
	start := c << img.clusterBits
	end := min(start+img.clusterSize, img.size)
	anew := (mode == PreallocFalloc || mode == PreallocFull) && !img.hasDataFile
	var m mapping
	if err := img.withMetadata(ctx, func() (err error) {
		m, err = img.lookupLocked(c)
		return err
	}); err != nil {
		return 0, err
	}
	_, hasHost := img.host(m)
	owned := hasHost && m.entry&flagCopied != 0 && m.entry&flagCompressed == 0
	if !img.extL2 {
		if owned && !anew {
			return 0, nil
		}
		return img.freshOldEnd(ctx, c, in, mode)
	}
	if hasHost && m.entry&flagCompressed == 0 && m.entry&flagCopied == 0 && !(anew && zeroNew) {
		// Shared with a snapshot: the active layer gets its own copy with
		// the same bitmap, as QEMU's copy-on-write of the allocation.
		nm, err := img.copyClusterAway(ctx, c, m)
		if err != nil {
			return 0, err
		}
		m, owned = nm, true
	}
	switch {
	case anew && zeroNew:
		buf := make([]byte, end-start)
		if _, err := img.ReadAt(ctx, buf[:in], start); err != nil {
			return 0, err
		}
		_, err := img.WriteAt(ctx, buf, start, 0)
		return 0, err
	case owned:
		if !anew {
			return 0, nil
		}
		// The fresh cluster's tail reads zeros where a subcluster was
		// allocated (data left from before a shrink).
		for i := in / img.subSize; i < int64(img.nsub); i++ {
			k, h := img.sub(m, int(i))
			s := max(from, start+i*img.subSize)
			e := min(end, start+(i+1)*img.subSize)
			if k != kindData || s >= e {
				continue
			}
			if _, err := img.writeHost(img.data, make([]byte, e-s), int64(h)+s-start-i*img.subSize); err != nil {
				return 0, fmt.Errorf("qcow2: zeroing the tail of the last cluster: %w", err)
			}
		}
		return 0, nil
	case m.entry&flagCompressed == 0 && !hasHost:
		// Only a host cluster: the bitmap (zero or unallocated
		// subclusters) stays.
		host, err := img.freshHost(ctx, start, mode)
		if err != nil {
			return 0, err
		}
		err = img.withMetadata(ctx, func() error {
			return img.setEntryLocked(c, mapping{entry: host | flagCopied, bitmap: m.bitmap &^ uint64(1<<img.nsub-1)}, false)
		})
		if err != nil || img.hasDataFile {
			return 0, err
		}
		return int64(host) + img.clusterSize, nil
	}
	// Compressed: QEMU drops the data here (the bitmap of a compressed
	// entry allocates nothing); ovis keeps it, written out whole.
	_, err = img.WriteAt(ctx, make([]byte, end-from), from, 0)
	return 0, err
}

// freshHost allocates the host cluster for guest offset start (in a data
// file, the same offset) and gives it its host space as mode asks: a
// cluster reused from inside the file is zeroed, as a fresh one past the
// end reads.
func (img *Image) freshHost(ctx context.Context, start int64, mode string) (uint64, error) {
	if img.hasDataFile {
		return uint64(start), nil
	}
	host, err := img.allocClusterRetrying(ctx)
	if err != nil {
		return 0, err
	}
	fileSize, err := img.data.Size()
	if err != nil {
		return 0, err
	}
	if z := min(int64(host)+img.clusterSize, fileSize) - int64(host); z > 0 && mode != PreallocFull {
		if _, err := img.writeHost(img.data, make([]byte, z), int64(host)); err != nil {
			return 0, fmt.Errorf("qcow2: zeroing a reused cluster at %#x: %w", host, err)
		}
	}
	if mode == PreallocFalloc || mode == PreallocFull {
		if err := img.reserveHost(mode, int64(host), img.clusterSize); err != nil {
			return 0, err
		}
	}
	return host, nil
}

// freshOldEnd moves guest cluster c, holding the old end at in, to a
// fresh host cluster that gets only the head [0, in) as it read before
// (the backing file, compressed or shared data, zeros) and zeros past
// the image's end, as QEMU's allocation copies on write; the rest stays
// fresh. It returns the end of the host cluster, 0 in a data file.
func (img *Image) freshOldEnd(ctx context.Context, c, in int64, mode string) (int64, error) {
	start := c << img.clusterBits
	head := make([]byte, in)
	if _, err := img.ReadAt(ctx, head, start); err != nil {
		return 0, err
	}
	host, err := img.freshHost(ctx, start, mode)
	if err != nil {
		return 0, err
	}
	if tail := img.size - start; tail < img.clusterSize {
		if _, err := img.writeHost(img.data, make([]byte, img.clusterSize-tail), int64(host)+tail); err != nil {
			return 0, fmt.Errorf("qcow2: writing the last cluster at %#x: %w", host, err)
		}
	}
	if _, err := img.writeHost(img.data, head, int64(host)); err != nil {
		return 0, fmt.Errorf("qcow2: writing the last cluster at %#x: %w", host, err)
	}
	err = img.withMetadata(ctx, func() error { return img.setEntryLocked(c, mapping{entry: host | flagCopied}, true) })
	if err != nil || img.hasDataFile {
		return 0, err
	}
	return int64(host) + img.clusterSize, nil
}

// copyClusterAway gives guest cluster c, mapped by m to a host cluster
// shared with a snapshot, a copy of its own, keeping the bitmap.
func (img *Image) copyClusterAway(ctx context.Context, c int64, m mapping) (mapping, error) {
	h, _ := img.host(m)
	buf := make([]byte, img.clusterSize)
	if _, err := img.data.ReadAt(buf, int64(h)); err != nil && !errors.Is(err, io.EOF) {
		return mapping{}, fmt.Errorf("qcow2: reading the cluster at %#x: %w", h, err)
	}
	host, err := img.allocClusterRetrying(ctx)
	if err != nil {
		return mapping{}, err
	}
	if _, err := img.writeHost(img.data, buf, int64(host)); err != nil {
		return mapping{}, fmt.Errorf("qcow2: copying the cluster to %#x: %w", host, err)
	}
	nm := mapping{entry: host | flagCopied, bitmap: m.bitmap}
	return nm, img.withMetadata(ctx, func() error { return img.setEntryLocked(c, nm, true) })
}

func (img *Image) growLocked(size int64) error {
	need := int(l1EntriesFor(uint64(size), img.clusterBits, img.hdr.L2EntrySize()))
	if int64(need)*8 > maxL1Bytes {
		return fmt.Errorf("qcow2: an L1 table for %d bytes would exceed %d bytes", size, maxL1Bytes)
	}
	if need > len(img.l1) {
		l1 := make([]uint64, need)
		copy(l1, img.l1)
		off, err := img.writeNewLocked("L1 table", encodeL1(l1, need))
		if err != nil {
			return err
		}
		if err := img.flushExclusiveLocked(); err != nil {
			return err
		}
		oldOff, oldLen := img.hdr.L1TableOffset, int64(len(img.l1))*8
		img.hdr.L1TableOffset, img.hdr.L1Size = off, uint32(need)
		img.hdr.Size = uint64(size)
		if err := img.writeHeaderLocked(); err != nil {
			return err
		}
		img.l1 = l1
		clear(img.l1Dirty)
		if oldLen > 0 {
			img.freeRangeLocked(oldOff, oldLen)
		}
	} else {
		img.hdr.Size = uint64(size)
		if err := img.writeHeaderLocked(); err != nil {
			return err
		}
	}
	img.size = size
	return img.flushExclusiveLocked()
}

func (img *Image) shrinkLocked(size int64) error {
	firstGone := (size + img.clusterSize - 1) >> img.clusterBits
	need := int(l1EntriesFor(uint64(size), img.clusterBits, img.hdr.L2EntrySize()))
	var frees []int64
	for i, e := range img.l1 {
		l2off := e & l1OffsetMask
		if l2off == 0 {
			continue
		}
		base := int64(i) * img.l2Entries
		if base+img.l2Entries <= firstGone {
			continue
		}
		buf, err := img.readTableFile(l2off, img.clusterSize)
		if err != nil {
			return err
		}
		for j := max(firstGone-base, 0); j < img.l2Entries; j++ {
			m := img.readEntry(buf, j)
			frees = append(frees, img.entryClusters(m)...)
			img.writeEntry(buf, j, mapping{})
		}
		if i >= need {
			frees = append(frees, int64(l2off)>>img.clusterBits)
			img.l1[i] = 0
			img.l1Dirty[i] = struct{}{}
			continue
		}
		if err := img.writeTableLocked(l2off, buf); err != nil {
			return err
		}
	}
	if err := img.flushExclusiveLocked(); err != nil {
		return err
	}
	img.hdr.Size = uint64(size)
	img.hdr.L1Size = uint32(need)
	if err := img.writeHeaderLocked(); err != nil {
		return err
	}
	// The L1 table's clusters past its new end are no longer counted.
	keep := img.clustersFor(int64(need) * 8)
	for c := keep; c < img.clustersFor(int64(len(img.l1))*8); c++ {
		frees = append(frees, int64(img.hdr.L1TableOffset)>>img.clusterBits+c)
	}
	for i := range img.l1Dirty {
		if i >= need {
			delete(img.l1Dirty, i)
		}
	}
	img.l1 = img.l1[:need]
	img.size = size
	for _, c := range frees {
		img.pendingFree = append(img.pendingFree, uint64(c)<<img.clusterBits)
	}
	if err := img.flushExclusiveLocked(); err != nil {
		return err
	}
	if img.hasDataFile {
		// QEMU truncates the data file with the image.
		if err := img.data.Truncate(size); err != nil {
			return fmt.Errorf("qcow2: truncating the data file: %w", err)
		}
	}
	return img.releaseHostLocked(frees)
}

// releaseHostLocked gives the host space of the freed clusters that no
// snapshot still references back to the file system, and cuts the file
// after its last used cluster, as QEMU's shrink does (its discards pass
// down with QCOW2_DISCARD_ALWAYS, and it truncates the tail).
func (img *Image) releaseHostLocked(freed []int64) error {
	slices.Sort(freed)
	freed = slices.Compact(freed)
	of, _ := img.file.(*block.OSFile)
	for i := 0; i < len(freed); {
		rc, err := img.refcountExclusiveLocked(freed[i])
		if err != nil {
			return err
		}
		if rc != 0 {
			i++
			continue
		}
		j := i + 1
		for j < len(freed) && freed[j] == freed[j-1]+1 {
			if rc, err := img.refcountExclusiveLocked(freed[j]); err != nil {
				return err
			} else if rc != 0 {
				break
			}
			j++
		}
		if of != nil {
			off, n := freed[i]<<img.clusterBits, int64(j-i)<<img.clusterBits
			// Best effort, as a discard: the clusters are free either way.
			_ = unix.Fallocate(int(of.Fd()), unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, off, n)
		}
		i = j
	}
	// Host runs found before may now be holes.
	img.hostRuns.Store(nil)
	img.hostGen.Add(1)
	last, err := img.lastUsedClusterLocked()
	if err != nil {
		return err
	}
	fileSize, err := img.file.Size()
	if err != nil {
		return err
	}
	if end := (last + 1) << img.clusterBits; end < fileSize {
		// A failure only leaves the file longer, as QEMU warns and goes on.
		_ = img.file.Truncate(end)
	}
	return nil
}

// lastUsedClusterLocked returns the highest host cluster with a nonzero
// refcount.
func (img *Image) lastUsedClusterLocked() (int64, error) {
	for b := int64(len(img.refTable)) - 1; b >= 0; b-- {
		if img.refTable[b]&refTableMask == 0 {
			continue
		}
		for idx := (b+1)*img.rcPerBlock - 1; idx >= b*img.rcPerBlock; idx-- {
			rc, err := img.refcountExclusiveLocked(idx)
			if err != nil {
				return 0, err
			}
			if rc != 0 {
				return idx, nil
			}
		}
	}
	return 0, nil
}

// allocClusterRetrying allocates one host cluster under the metadata
// lock, retrying through table loads and refcount-table growth
// (withMetadata) without allocating twice.
func (img *Image) allocClusterRetrying(ctx context.Context) (uint64, error) {
	var host uint64
	allocated := false
	err := img.withMetadata(ctx, func() (err error) {
		if !allocated {
			host, err = img.allocClusterLocked()
			allocated = err == nil
		}
		return err
	})
	return host, err
}
