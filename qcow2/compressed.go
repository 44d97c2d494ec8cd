package qcow2

import (
	"context"
	"fmt"
)

// WriteCompressed writes one whole guest cluster compressed with the
// image's compression type. off must be cluster aligned and len(p) the
// cluster size, or what remains of the disk for the last cluster. Data
// that does not compress is written normally. Safe for concurrent use:
// compression runs outside every lock.
func (img *Image) WriteCompressed(ctx context.Context, p []byte, off int64) error {
	img.gate.RLock()
	defer img.gate.RUnlock()
	if err := img.checkCompressed(p, off); err != nil {
		return err
	}
	src := p
	if int64(len(p)) < img.clusterSize {
		src = make([]byte, img.clusterSize)
		copy(src, p)
	}
	z, ok, err := compressCluster(img.compression, src)
	if err != nil {
		return err
	}
	if !ok {
		z = nil
	}
	return img.writePrecompressed(ctx, z, p, off)
}

// WritePrecompressed is WriteCompressed with the compression done by the
// caller: z is what a Compressor of this image (Image.NewCompressor) made
// of p, or nil when it reported that p does not shrink, in which case p
// is written uncompressed. The engine does not decode z: a stream that is
// not p's, or not of the image's compression type, makes the cluster
// unreadable. The caller keeps z and p; they are not retained. Safe for
// concurrent use.
func (img *Image) WritePrecompressed(ctx context.Context, z, p []byte, off int64) error {
	img.gate.RLock()
	defer img.gate.RUnlock()
	if err := img.checkCompressed(p, off); err != nil {
		return err
	}
	if z != nil && (len(z) == 0 || int64(len(z)) >= img.clusterSize) {
		return fmt.Errorf("qcow2: precompressed cluster at %#x: %d bytes is not smaller than a cluster of %d", off, len(z), img.clusterSize)
	}
	return img.writePrecompressed(ctx, z, p, off)
}

// checkCompressed checks the arguments of a compressed cluster write.
func (img *Image) checkCompressed(p []byte, off int64) error {
	if off&(img.clusterSize-1) != 0 || (int64(len(p)) != img.clusterSize && off+int64(len(p)) != img.size) {
		return fmt.Errorf("qcow2: compressed write of %d bytes at %#x is not one whole cluster", len(p), off)
	}
	if img.hasDataFile {
		return fmt.Errorf("qcow2: compressed writes are not supported with an external data file")
	}
	return nil
}

// writePrecompressed stores the compressed form z of cluster p at off,
// or p itself when z is nil: it packs z after the previous compressed
// cluster, writes it, and only then sets the L2 entry that points at it.
func (img *Image) writePrecompressed(ctx context.Context, z, p []byte, off int64) error {
	if err := img.beginWrite(off, int64(len(p))); err != nil {
		return err
	}
	if z == nil {
		_, err := img.writeAt(ctx, p, off, false)
		return err
	}
	c := off >> img.clusterBits
	claimed, err := img.claim(ctx, c, func() (bool, error) { return false, nil })
	if err != nil || !claimed {
		return err
	}
	defer img.release(c)
	var at uint64
	reserved := false
	err = img.withMetadata(ctx, func() error {
		if _, _, err := img.writableL2Locked(c); err != nil {
			return err
		}
		if !reserved {
			var err error
			if at, err = img.allocBytesLocked(int64(len(z))); err != nil {
				return err
			}
			reserved = true
		}
		return nil
	})
	if err != nil {
		return err
	}
	if _, err := img.writeHost(img.file, z, int64(at)); err != nil {
		return fmt.Errorf("qcow2: writing compressed cluster at %#x: %w", at, err)
	}
	err = img.withMetadata(ctx, func() error {
		return img.setEntryLocked(c, mapping{entry: img.compressedEntry(at, int64(len(z)))}, true)
	})
	if err != nil {
		return err
	}
	return img.endWrite(true, false)
}

// allocBytesLocked reserves n bytes (at most one cluster) for compressed
// data, packing it after the previous compressed cluster as QEMU does.
// Every host cluster the bytes touch gains one reference.
func (img *Image) allocBytesLocked(n int64) (uint64, error) {
	cs := uint64(img.clusterSize)
	if t := img.compTail; t != 0 && t%cs != 0 {
		cur := int64(t / cs)
		room := cs - t%cs
		rc, err := img.refcountLocked(cur)
		if err != nil {
			return 0, err
		}
		if rc >= img.maxRefcount() {
			// Narrow refcounts (1 bit) cannot count another sharer.
			room = 0
		}
		if n <= 0 {
			return 0, fmt.Errorf("qcow2: internal error: compressed size %d", n)
		}
		if uint64(n) <= room {
			if err := img.addRefLocked(cur, 1); err != nil {
				return 0, err
			}
			img.compTail = t + uint64(n)
			return t, nil
		}
		// Spill into the next cluster if it is free and already counted
		// by a refcount block.
		next := cur + 1
		blk, err := img.refBlockLocked(next)
		if err != nil {
			return 0, err
		}
		if room > 0 && blk != nil && getRefcount(blk.buf, next%img.rcPerBlock, img.rcBits) == 0 {
			if err := img.addRefLocked(cur, 1); err != nil {
				return 0, err
			}
			if err := img.addRefLocked(next, 1); err != nil {
				return 0, err
			}
			img.compTail = t + uint64(n)
			return t, nil
		}
	}
	off, err := img.allocClusterLocked()
	if err != nil {
		return 0, err
	}
	img.compTail = off + uint64(n)
	return off, nil
}
