package qcow2

import (
	"fmt"

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
// Data clusters that are holes in the host file also read as zeros.
func (img *Image) MapAt(off, n int64) (block.MapExtent, error) {
	if err := block.CheckRange(off, n, img.Size()); err != nil {
		return block.MapExtent{}, err
	}
	if n == 0 {
		return block.MapExtent{}, nil
	}
	var first mapClass
	var length int64
	err := img.withMetadata(func() error {
		length = 0
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
		bm, ok := img.backing.(block.Mapper)
		if !ok {
			return block.MapExtent{}, fmt.Errorf("qcow2: backing file of %s cannot be mapped", img.path)
		}
		m, err := bm.MapAt(off, min(length, bs-off))
		if err != nil {
			return block.MapExtent{}, err
		}
		m.Depth++
		return m, nil
	}
	return me, nil
}
