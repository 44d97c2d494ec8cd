package qcow2

import (
	"context"
	"fmt"

	"github.com/ovis-storage/ovis/block"
)

// WriteZeroes makes [off, off+n) read as zeros. Whole (sub)clusters get
// the zero flag (and without NoUnmap lose their host cluster); the
// partial edges are written with zeros. With NoFallback, a range that
// needs zeros written (partial edges, an image whose metadata cannot say
// zero) fails with block.ErrNoFallback before anything changes.
func (img *Image) WriteZeroes(ctx context.Context, off, n int64, f block.Flags) error {
	img.gate.RLock()
	defer img.gate.RUnlock()
	mayUnmap, fua := !f.Has(block.NoUnmap), f.Has(block.FUA)
	if f.Has(block.NoFallback) && block.CheckRange(off, n, img.size) == nil && !img.zeroesByMetadata(off, n, mayUnmap) {
		return block.ErrNoFallback
	}
	if err := img.beginWrite(off, n); err != nil {
		return err
	}
	meta := false
	for n > 0 {
		c := off >> img.clusterBits
		in := off & (img.clusterSize - 1)
		k := min(n, img.clusterSize-in)
		end := in + k
		if (c+1)<<img.clusterBits > img.size && off+k == img.size {
			end = img.clusterSize // the tail of the last cluster counts as covered
		}
		// Whole subclusters covered by [in, end).
		first := (in + img.subSize - 1) / img.subSize
		last := end / img.subSize // exclusive
		var mask uint32
		for i := first; i < last; i++ {
			mask |= 1 << i
		}
		if mask == 0 || !img.canZero(mayUnmap) {
			if err := img.writeZeroBytes(ctx, c, in, k); err != nil {
				return err
			}
		} else {
			if first*img.subSize > in {
				if err := img.writeZeroBytes(ctx, c, in, first*img.subSize-in); err != nil {
					return err
				}
			}
			if tail := min(end, in+k); last*img.subSize < tail {
				if err := img.writeZeroBytes(ctx, c, last*img.subSize, tail-last*img.subSize); err != nil {
					return err
				}
			}
			err := img.zeroSubclusters(ctx, c, mask, mayUnmap, false)
			if err == errPartialCompressed && f.Has(block.NoFallback) {
				// Found only now, under the claim: earlier
				// clusters may be zeroed already, which a failed
				// FAST_ZERO allows.
				err = block.ErrNoFallback
			}
			if err == errPartialCompressed {
				err = img.writeZeroBytes(ctx, c, first*img.subSize, (last-first)*img.subSize)
			}
			if err != nil {
				return err
			}
		}
		meta = true
		off += k
		n -= k
	}
	return img.endWrite(meta, fua)
}

// zeroesByMetadata reports whether WriteZeroes can zero [off, off+n)
// without writing data: whole subclusters only (the image's partial last
// one counts as whole), in an image whose metadata can say zero.
func (img *Image) zeroesByMetadata(off, n int64, mayUnmap bool) bool {
	if n == 0 {
		return true
	}
	if !img.canZero(mayUnmap) {
		return false
	}
	end := off + n
	return off%img.subSize == 0 && (end%img.subSize == 0 || end == img.size)
}

// canZero reports whether the metadata can express zeros for the
// subclusters in mask without writing data.
func (img *Image) canZero(mayUnmap bool) bool {
	if img.hasDataFile {
		// Keep the data file readable on its own: write real zeros.
		return false
	}
	if img.extL2 || img.v3 {
		return true
	}
	// v2 has no zero flag: only an unallocated cluster with no backing
	// file reads as zeros, and unmapping must be allowed.
	return mayUnmap && img.hdr.BackingFile == ""
}

func (img *Image) writeZeroBytes(ctx context.Context, c, in, n int64) error {
	_, err := img.writeCluster(ctx, c, in, make([]byte, n))
	return err
}

// zeroSubclusters marks the subclusters of guest cluster c in mask as
// zero. discard drops them instead (reads then come from the backing file
// when there is one, as QEMU's discard does).
func (img *Image) zeroSubclusters(ctx context.Context, c int64, mask uint32, mayUnmap, discard bool) error {
	claimed, err := img.claim(ctx, c, func() (bool, error) { return false, nil })
	if err != nil || !claimed {
		return err
	}
	defer img.release(c)
	full := mask == uint32(1<<img.nsub-1)
	return img.withMetadata(ctx, func() error {
		m, err := img.lookupLocked(c)
		if err != nil {
			return err
		}
		if m.entry&flagCompressed != 0 && !full {
			return errPartialCompressed
		}
		hasBacking := img.hdr.BackingFile != ""
		h, hasHost := img.host(m)
		keep := hasHost && !mayUnmap && m.entry&flagCopied != 0 && m.entry&flagCompressed == 0
		var nm mapping
		freeOld := false
		switch {
		case discard:
			// QEMU's guest discard (discard_in_l2_slice, not a full
			// discard): what it drops reads as zeros, and a cluster that
			// is neither allocated nor over a backing file is left alone.
			if !hasHost && m.entry&flagCompressed == 0 && !hasBacking {
				return nil
			}
			switch {
			case img.extL2:
				nm = mapping{bitmap: uint64(1<<img.nsub-1) << 32}
			case img.v3:
				nm = mapping{entry: flagZero}
			}
			freeOld = true
		case img.extL2:
			alloc := uint32(m.bitmap) &^ mask
			zero := uint32(m.bitmap>>32) | mask
			if m.entry&flagCompressed != 0 || (full && !keep) {
				nm = mapping{bitmap: uint64(alloc) | uint64(zero)<<32}
				freeOld = true
			} else {
				nm = mapping{entry: m.entry, bitmap: uint64(alloc) | uint64(zero)<<32}
			}
		case !img.v3:
			nm = mapping{}
			freeOld = true
		case keep:
			nm = mapping{entry: h | flagCopied | flagZero}
		default:
			nm = mapping{entry: flagZero}
			freeOld = true
		}
		if nm == m {
			return nil
		}
		if nm.entry == 0 && nm.bitmap == 0 && m.entry == 0 && m.bitmap == 0 {
			return nil
		}
		if freeOld && img.passDiscard {
			img.punchLaterLocked(m)
		}
		return img.setEntryLocked(c, nm, freeOld)
	})
}

// punchLaterLocked marks the host clusters of an entry a guest discard
// frees to be punched when Flush drops their refcount (pass-discard-request).
func (img *Image) punchLaterLocked(m mapping) {
	if img.hasDataFile {
		return
	}
	if img.pendingPunch == nil {
		img.pendingPunch = make(map[uint64]struct{})
	}
	for _, c := range img.entryClusters(m) {
		img.pendingPunch[uint64(c)<<img.clusterBits] = struct{}{}
	}
}

var errPartialCompressed = &CorruptError{Msg: "internal: partial zero of a compressed cluster"}

// Discard drops whole clusters in [off, off+n), as QEMU's guest discard;
// partial clusters are left alone. Discarded clusters read as zeros (the
// zero flag in v3, all-zero subclusters with extended L2, unallocated in
// v2). A v2 image with a backing file ignores discards, as QEMU does
// (they would expose the backing file), and so do images with an
// external data file.
func (img *Image) Discard(ctx context.Context, off, n int64, f block.Flags) error {
	img.gate.RLock()
	defer img.gate.RUnlock()
	if err := img.beginWrite(off, n); err != nil {
		return err
	}
	if img.hasDataFile || (!img.v3 && img.hdr.BackingFile != "") {
		return nil
	}
	end := off + n
	first := (off + img.clusterSize - 1) >> img.clusterBits
	last := end >> img.clusterBits // exclusive
	if end == img.size {
		last = (end + img.clusterSize - 1) >> img.clusterBits
	}
	all := uint32(1<<img.nsub - 1)
	for c := first; c < last; c++ {
		if err := img.zeroSubclusters(ctx, c, all, true, true); err != nil {
			return err
		}
	}
	return img.endWrite(last > first, f.Has(block.FUA))
}

// MakeEmpty drops every cluster of the image's active layer, so that it
// reads from its backing file again (or as zeros without one), as QEMU's
// qcow2_make_empty does. Where QEMU rebuilds the file afresh (a version 3
// image without snapshots, bitmaps or data file), so does MakeEmpty
// (empty.go); otherwise it discards every cluster. That works with
// internal snapshots (they keep their clusters; only this layer's
// references go), bitmaps, external data files and v2 images. L2 tables
// stay allocated, empty. Bitmaps are not marked: once the data is
// committed below, what the image reads has not changed. It stops once
// ctx is done, leaving the image partly emptied (still consistent).
func (img *Image) MakeEmpty(ctx context.Context) error {
	if done, err := img.emptyWhole(ctx); done || err != nil {
		return err
	}
	img.gate.RLock()
	defer img.gate.RUnlock()
	if err := img.beginWrite(0, 0); err != nil {
		return err
	}
	clusters := (img.size + img.clusterSize - 1) >> img.clusterBits
	for c, done := int64(0), int64(0); c < clusters; {
		if err := ctx.Err(); err != nil {
			return err
		}
		var skip int64
		claimed, err := img.claim(ctx, c, func() (bool, error) {
			_, idx, l2off := img.l2SlotLocked(c)
			if l2off == 0 {
				skip = img.l2Entries - idx
				return true, nil
			}
			skip = 1
			m, err := img.lookupLocked(c)
			return m == (mapping{}), err
		})
		if err == nil && claimed {
			err = img.withMetadata(ctx, func() error {
				m, err := img.lookupLocked(c)
				if err != nil || m == (mapping{}) {
					return err
				}
				return img.setEntryLocked(c, mapping{}, true)
			})
			img.release(c)
		}
		if err != nil {
			return fmt.Errorf("qcow2: emptying guest cluster %d: %w", c, err)
		}
		c += skip
		// Keep the clusters waiting to be freed bounded.
		if done += skip; done >= img.l2Entries {
			done = 0
			if err := img.flush(); err != nil {
				return err
			}
		}
	}
	return img.flush()
}
