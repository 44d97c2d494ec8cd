package qcow2

import (
	"context"
	"fmt"
	"runtime"
	"sync"
	"weak"

	"golang.org/x/sys/unix"

	"github.com/ovis-storage/ovis/block"
)

var _ block.Mapper = (*Image)(nil)

// mapClass is what MapAt merges runs by.
type mapClass struct {
	kind    subKind
	hasHost bool
	host    uint64 // host offset of the run's next byte
}

// MapAt reports where the run starting at off (at most n bytes) lives, as
// qemu-img map does: in this image (Depth 0), or down the backing chain.
// Data clusters that are holes in the host file are reported as zeros
// only in an image QEMU finds metadata-preallocated
// (metadataPreallocLocked); elsewhere QEMU does not ask the host file,
// and a cluster's unwritten tail is data.
func (img *Image) MapAt(ctx context.Context, off, n int64) (block.MapExtent, error) {
	if err := block.CheckRange(off, n, img.Size()); err != nil {
		return block.MapExtent{}, err
	}
	if n == 0 {
		return block.MapExtent{}, nil
	}
	var first mapClass
	var length int64
	var prealloc bool
	err := img.withMetadata(ctx, func() error {
		length = 0
		var err error
		if prealloc, err = img.metadataPreallocLocked(); err != nil {
			return err
		}
		for pos := off; pos < off+n; {
			c := pos >> img.clusterBits
			in := pos & (img.clusterSize - 1)
			var cl mapClass
			step := min(img.subSize-in%img.subSize, off+n-pos)
			if _, idx, l2off := img.l2SlotLocked(c); l2off == 0 {
				cl = mapClass{kind: kindUnalloc}
				step = min((img.l2Entries-idx)<<img.clusterBits-in, off+n-pos)
			} else {
				m, err := img.lookupLocked(c)
				if _, ok := isNeedLoad(err); ok && length > 0 {
					return nil
				}
				if err != nil {
					return err
				}
				if m.entry&flagCompressed != 0 {
					cl = mapClass{kind: kindCompressed}
					step = min(img.clusterSize-in, off+n-pos)
				} else {
					i := int(in / img.subSize)
					cl.kind, _ = img.sub(m, i)
					// An unallocated subcluster of an allocated cluster
					// has a host offset too, which QEMU reports when no
					// backing file answers for it.
					if h, ok := img.host(m); ok {
						if h%uint64(img.clusterSize) != 0 {
							return corruptf("L2 entry for guest offset %#x: host offset %#x is not cluster aligned", c<<img.clusterBits, h)
						}
						cl.hasHost = true
						cl.host = h + uint64(in)
					}
				}
			}
			if length > 0 && (cl.kind != first.kind || cl.hasHost != first.hasHost ||
				(cl.hasHost && cl.host != first.host+uint64(length))) {
				return nil
			}
			if length == 0 {
				first = cl
			}
			length += step
			pos += step
		}
		return nil
	})
	if err != nil {
		return block.MapExtent{}, err
	}
	me := block.MapExtent{Length: length, Offset: -1, File: img.path}
	if img.hasDataFile {
		me.File = img.resolve(img.hdr.DataFile)
	}
	switch first.kind {
	case kindData:
		me.Present, me.Data, me.Offset = true, true, int64(first.host)
		if !prealloc {
			break
		}
		if hole, hl := block.FileHole(img.data, int64(first.host), length); hole || hl < length {
			me.Length, me.Zero = hl, hole
		}
	case kindCompressed:
		me.Present, me.Data, me.File = true, true, img.path
	case kindZero:
		me.Present, me.Zero = true, true
		if first.hasHost {
			me.Offset = int64(first.host)
		}
	case kindUnalloc:
		me.Zero = true
		if first.hasHost {
			me.Offset = int64(first.host)
		}
		if img.backing == nil {
			return me, nil
		}
		bs := img.backing.Size()
		if off >= bs {
			return me, nil // past the backing file's end: decided here, as QEMU reports it
		}
		bm, ok := block.As[block.Mapper](img.backing)
		if !ok {
			return block.MapExtent{}, fmt.Errorf("qcow2: backing file of %s cannot be mapped", img.path)
		}
		m, err := bm.MapAt(ctx, off, min(length, bs-off))
		if err != nil {
			return block.MapExtent{}, err
		}
		m.Depth++
		return m, nil
	}
	return me, nil
}

// metaPrealloc caches metadataPreallocLocked per open image, as QEMU
// decides once per open (metadata_preallocation_checked).
var metaPrealloc sync.Map // weak.Pointer[Image] -> bool

// metadataPreallocLocked reports whether QEMU 7.2 would take the image
// for a metadata-preallocated one (qcow2_detect_metadata_preallocation):
// at least a ninth more host clusters, and at least two more, have a
// refcount than the file has allocated clusters. Only then does its block status ask
// the host file (BDRV_BLOCK_RECURSE) and report its holes as zeros. A
// failure, as in QEMU, counts as no.
func (img *Image) metadataPreallocLocked() (bool, error) {
	k := weak.Make(img)
	if v, ok := metaPrealloc.Load(k); ok {
		return v.(bool), nil
	}
	v, err := img.detectMetadataPreallocLocked()
	if _, ok := isNeedLoad(err); ok {
		return false, err // withMetadata loads the block and retries
	}
	if _, loaded := metaPrealloc.LoadOrStore(k, v); !loaded {
		runtime.AddCleanup(img, func(k weak.Pointer[Image]) { metaPrealloc.Delete(k) }, k)
	}
	return v, nil
}

func (img *Image) detectMetadataPreallocLocked() (bool, error) {
	length, err := img.file.Size()
	if err != nil {
		return false, nil
	}
	fd, ok := img.file.(interface{ Fd() uintptr })
	if !ok {
		return false, nil
	}
	var st unix.Stat_t
	if err := unix.Fstat(int(fd.Fd()), &st); err != nil {
		return false, nil
	}
	realClusters := st.Blocks * 512 / img.clusterSize
	threshold := max(realClusters*10/9, realClusters+2)
	end := (length + img.clusterSize - 1) / img.clusterSize
	var count int64
	for i := int64(0); i < end && count < threshold; i++ {
		rc, err := img.refcountLocked(i)
		if err != nil {
			if _, ok := isNeedLoad(err); ok {
				return false, err
			}
			return false, nil
		}
		if rc != 0 {
			count++
		}
	}
	return count >= threshold, nil
}
