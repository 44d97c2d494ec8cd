package qcow2

import (
	"context"
	"fmt"

	"github.com/ovis-storage/ovis/block"
)

// segment is a piece of a read request with one source.
type segment struct {
	kind subKind
	n    int64
	host uint64 // kindData: host offset of the first byte; kindCompressed: the L2 entry
	cOff int64  // kindCompressed: offset of the first byte inside the cluster
}

// maxSegments bounds one mapping pass so that the lock is not held for long.
const maxSegments = 256

// mapRangeLocked maps up to n bytes at off into segments, merging
// neighbours with the same source. It returns a *needLoad error when an
// L2 table must be read first.
func (img *Image) mapRangeLocked(off, n int64, segs []segment) ([]segment, error) {
	for n > 0 && len(segs) < maxSegments {
		c := off >> img.clusterBits
		if _, idx, l2off := img.l2SlotLocked(c); l2off == 0 {
			// No L2 table: the rest of its range is unallocated.
			span := (img.l2Entries-idx)<<img.clusterBits - off&(img.clusterSize-1)
			s := segment{kind: kindUnalloc, n: min(n, span)}
			if k := len(segs) - 1; k >= 0 && segs[k].kind == kindUnalloc {
				segs[k].n += s.n
			} else {
				segs = append(segs, s)
			}
			off += s.n
			n -= s.n
			continue
		}
		m, err := img.lookupLocked(c)
		if _, ok := isNeedLoad(err); ok && len(segs) > 0 {
			// Serve what is mapped; the rest comes in the next pass,
			// so one request pins at most one table at a time.
			return segs, nil
		}
		if err != nil {
			return segs, err
		}
		inCluster := off & (img.clusterSize - 1)
		if h, ok := img.host(m); ok && h&uint64(img.clusterSize-1) != 0 {
			return segs, corruptf("L2 entry for guest offset %#x: host offset %#x is not cluster aligned", c<<img.clusterBits, h)
		}
		var s segment
		if m.entry&flagCompressed != 0 {
			s = segment{kind: kindCompressed, host: m.entry, cOff: inCluster, n: min(n, img.clusterSize-inCluster)}
		} else {
			i := int(inCluster / img.subSize)
			kind, host := img.sub(m, i)
			inSub := inCluster - int64(i)*img.subSize
			s = segment{kind: kind, n: min(n, img.subSize-inSub)}
			if kind == kindData {
				s.host = host + uint64(inSub)
			}
		}
		if k := len(segs) - 1; k >= 0 && segs[k].kind == s.kind && s.kind != kindCompressed &&
			(s.kind != kindData || segs[k].host+uint64(segs[k].n) == s.host) {
			segs[k].n += s.n
		} else {
			segs = append(segs, s)
		}
		off += s.n
		n -= s.n
	}
	return segs, nil
}

// withMetadata runs fn under mu, loading tables it asks for (by returning a
// *needLoad error) and retrying until it succeeds or fails otherwise.
func (img *Image) withMetadata(ctx context.Context, fn func() error) error {
	img.mu.Lock()
	defer img.mu.Unlock()
	var pins pinSet
	defer pins.releaseLocked()
	for {
		if img.closed {
			return block.ErrClosed
		}
		err := fn()
		if ng, ok := err.(*needGrow); ok {
			img.mu.Unlock()
			img.flushMu.Lock()
			img.mu.Lock()
			err = img.growRefTableLocked(ng.need)
			img.flushMu.Unlock()
			if err != nil {
				return err
			}
			continue
		}
		nl, ok := isNeedLoad(err)
		if !ok {
			return err
		}
		e, err := nl.c.load(ctx, nl.off)
		if err != nil {
			return err
		}
		pins = append(pins, e)
	}
}

// ReadAt reads len(p) bytes at guest offset off.
func (img *Image) ReadAt(ctx context.Context, p []byte, off int64) (int, error) {
	img.gate.RLock()
	defer img.gate.RUnlock()
	if err := block.CheckRange(off, int64(len(p)), img.size); err != nil {
		return 0, err
	}
	done := 0
	var segs []segment
	for done < len(p) {
		var epoch uint64
		err := img.withMetadata(ctx, func() error {
			var err error
			segs, err = img.mapRangeLocked(off+int64(done), int64(len(p)-done), segs[:0])
			if err == nil {
				epoch = img.enterLocked()
			}
			return err
		})
		if err != nil {
			return done, err
		}
		for _, s := range segs {
			if err = img.readSegment(ctx, p[done:done+int(s.n)], off+int64(done), s); err != nil {
				break
			}
			done += int(s.n)
		}
		img.exit(epoch)
		if err != nil {
			return done, err
		}
	}
	return done, nil
}

func (img *Image) readSegment(ctx context.Context, p []byte, guest int64, s segment) error {
	switch s.kind {
	case kindZero:
		clear(p)
	case kindUnalloc:
		return img.readBacking(ctx, p, guest)
	case kindData:
		if err := block.ReadFull(img.data, p, int64(s.host)); err != nil {
			return fmt.Errorf("qcow2: reading data at host offset %#x: %w", s.host, err)
		}
	case kindCompressed:
		buf, err := img.readCompressed(s.host)
		if err != nil {
			return err
		}
		copy(p, buf[s.cOff:])
	}
	return nil
}

// readBacking reads guest range p@off from the backing file; whatever lies
// past the backing file's end reads as zeros.
func (img *Image) readBacking(ctx context.Context, p []byte, off int64) error {
	if img.backing == nil {
		clear(p)
		return nil
	}
	n := int64(len(p))
	bs := img.backing.Size()
	if off >= bs {
		clear(p)
		return nil
	}
	if off+n > bs {
		clear(p[bs-off:])
		p = p[:bs-off]
	}
	if _, err := img.backing.ReadAt(ctx, p, off); err != nil {
		return fmt.Errorf("qcow2: reading backing file at %#x: %w", off, err)
	}
	return nil
}

// readCompressed reads and inflates the compressed cluster of an L2 entry.
func (img *Image) readCompressed(entry uint64) ([]byte, error) {
	coff, n := img.compressedRange(entry)
	if img.hasDataFile {
		return nil, corruptf("compressed cluster at %#x in an image with an external data file", coff)
	}
	fsize, err := img.file.Size()
	if err != nil {
		return nil, err
	}
	if coff >= uint64(fsize) {
		return nil, corruptf("compressed cluster at %#x is beyond the end of the file (%d bytes)", coff, fsize)
	}
	n = min(n, fsize-int64(coff))
	src := make([]byte, n)
	if err := block.ReadFull(img.file, src, int64(coff)); err != nil {
		return nil, fmt.Errorf("qcow2: reading compressed cluster at %#x: %w", coff, err)
	}
	dst := make([]byte, img.clusterSize)
	if err := decompressCluster(img.compression, src, dst); err != nil {
		return nil, fmt.Errorf("qcow2: compressed cluster at %#x: %w", coff, err)
	}
	return dst, nil
}

// Extents reports the runs of equal status in [off, off+n): this
// image's clusters, and the backing chain's runs beneath unallocated
// ones. It maps the range in passes of at most maxSegments segments, so
// that mu is never held for long.
func (img *Image) Extents(ctx context.Context, off, n int64, dst []block.Extent) ([]block.Extent, error) {
	img.gate.RLock()
	defer img.gate.RUnlock()
	if err := block.CheckRange(off, n, img.size); err != nil {
		return dst, err
	}
	var segs []segment
	for n > 0 {
		var prealloc bool
		err := img.withMetadata(ctx, func() error {
			var err error
			if prealloc, err = img.metadataPreallocLocked(); err != nil {
				return err
			}
			segs, err = img.mapRangeLocked(off, n, segs[:0])
			return err
		})
		if err != nil {
			return dst, err
		}
		for _, s := range segs {
			if dst, err = img.appendSegment(ctx, dst, off, s, prealloc); err != nil {
				return dst, err
			}
			off += s.n
			n -= s.n
		}
	}
	return dst, nil
}

// appendSegment appends the runs of segment s, which maps guest offset
// off.
func (img *Image) appendSegment(ctx context.Context, dst []block.Extent, off int64, s segment, prealloc bool) ([]block.Extent, error) {
	switch s.kind {
	case kindData:
		if img.hasDataFile || !prealloc {
			// QEMU reports an external data file's clusters as data
			// whatever the file holds; so does ovis, for qemu-img
			// map. Elsewhere QEMU asks the host file only in a
			// metadata-preallocated image (see MapAt).
			return block.AppendExtent(dst, block.Extent{Length: s.n, Status: block.StatusData, Depth: 1}), nil
		}
		for done := int64(0); done < s.n; {
			// Mapped, so allocated here; where the host file holds no
			// bytes the run reads as zeros, as QEMU reports them
			// (zero, not a hole).
			hole, l := img.hostHole(int64(s.host)+done, s.n-done)
			if l <= 0 {
				l = s.n - done
			}
			st := block.StatusData
			if hole {
				st = block.StatusZero
			}
			dst = block.AppendExtent(dst, block.Extent{Length: l, Status: st, Depth: 1})
			done += l
		}
		return dst, nil
	case kindCompressed:
		return block.AppendExtent(dst, block.Extent{Length: s.n, Status: block.StatusData, Depth: 1}), nil
	case kindZero:
		return block.AppendExtent(dst, block.Extent{Length: s.n, Status: block.StatusZero | block.StatusHole, Depth: 1}), nil
	}
	// Unallocated here: ask the backing file, for the part it covers.
	var bsize int64
	if img.backing != nil {
		bsize = img.backing.Size()
	}
	n := s.n
	if off < bsize {
		k := min(n, bsize-off)
		runs, err := img.backing.Extents(ctx, off, k, nil)
		if err != nil {
			return dst, err
		}
		for _, r := range runs {
			if r.Depth > 0 {
				r.Depth++
			}
			dst = block.AppendExtent(dst, r)
		}
		off += k
		n -= k
	}
	if n > 0 {
		dst = block.AppendExtent(dst, block.Extent{Length: n, Status: block.StatusZero | block.StatusHole})
	}
	return dst, nil
}

func classOf(k subKind) subKind {
	if k == kindCompressed {
		return kindData
	}
	return k
}
