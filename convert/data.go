package convert

import (
	"context"
	"errors"

	"github.com/ovis-storage/ovis/block"
	"github.com/ovis-storage/ovis/qcow2"
)

// prepare does the reading part of a job into buf (and with compression,
// the compressing, with a compressor from comps) and returns its writes.
func (c *copier) prepare(ctx context.Context, j job, buf []byte, comps chan *qcow2.Compressor) (write, error) {
	w := write{seq: j.seq, n: j.n, buf: buf}
	switch {
	case j.kind == kindZero:
		w.run = func(ctx context.Context) error { return c.zero(ctx, j.off, j.n) }
		return w, nil
	case c.compressed != nil:
		return c.prepareCompressed(ctx, j, w, comps)
	}
	return c.prepareData(ctx, j, w)
}

// zero makes [off, off+n) of the output read as zeros, unless it does
// already. With zero detection on the range may be deallocated.
func (c *copier) zero(ctx context.Context, off, n int64) error {
	if c.hasZeroInit {
		return nil
	}
	if err := c.rate.Wait(ctx, n); err != nil {
		return err
	}
	at, m := off, n
	if c.ordered {
		at, m = c.widenZero(ctx, off, n)
	}
	if err := c.dst.WriteZeroes(ctx, at, m, block.ZeroFlags(c.minSparse > 0, false)); err != nil {
		return &Error{OpWrite, off, err}
	}
	return nil
}

// widenZero stretches a zero write over the rest of the qcow2 output's
// subclusters it covers in part, where that rest reads as zeros already
// and holds no data of the output's own: QEMU's qcow2_co_pwrite_zeroes
// then zeroes the whole subcluster instead of writing zeros into it
// (e.g. where the output's backing file ends inside a cluster). Only for
// ordered writes: the rest is looked at before the write is made, which
// is safe only while no other write can land in between.
func (c *copier) widenZero(ctx context.Context, off, n int64) (int64, int64) {
	img, ok := block.As[*qcow2.Image](c.dst)
	if !ok {
		return off, n
	}
	h := img.Header()
	if h.Version < 3 || h.IncompatibleFeatures&qcow2.IncompatDataFile != 0 {
		return off, n // no zero flag, or zeros are written to the data file
	}
	sub := img.ClusterSize()
	if h.ExtendedL2() {
		sub /= 32
	}
	readsZero := func(at, l int64) bool {
		e, err := block.FirstExtent(ctx, img, at, l)
		return err == nil && e.Length >= l && e.Status&block.StatusZero != 0 &&
			(e.Depth != 1 || e.Status&block.StatusHole != 0)
	}
	if head := off % sub; head != 0 && readsZero(off-head, head) {
		off, n = off-head, n+head
	}
	end := off + n
	if tail := min((sub-end%sub)%sub, img.Size()-end); tail > 0 && readsZero(end, tail) {
		n += tail
	}
	return off, n
}

// span is a piece of a data job: bytes to write, or zeros.
type span struct {
	from, to int
	zero     bool
}

// prepareData reads one data range and splits it into the data to write
// and its all-zero runs of at least minSparse bytes, which are zeroed
// instead. With copyRange the range is copied in the kernel when it can
// be.
func (c *copier) prepareData(ctx context.Context, j job, w write) (write, error) {
	off, p := j.off, w.buf[:j.n]
	if c.copyRange && !c.noOffload.Load() {
		src, ok1 := block.As[*block.Raw](c.src)
		dst, ok2 := block.As[*block.Raw](c.dst)
		if ok1 && ok2 {
			w.run = func(ctx context.Context) error {
				return c.offload(ctx, dst, src, p, off)
			}
			return w, nil
		}
	}
	if err := c.read(ctx, p, off); err != nil {
		return w, err
	}
	spans := c.spans(p, off)
	w.run = func(ctx context.Context) error { return c.writeSpans(ctx, p, off, spans) }
	return w, nil
}

// offload copies len(p) bytes at off from src to dst with copy_file_range;
// when the kernel refuses, offloading stops for the rest of the copy and
// this range goes through p, as qemu-img falls back.
func (c *copier) offload(ctx context.Context, dst, src *block.Raw, p []byte, off int64) error {
	if err := c.rate.Wait(ctx, int64(len(p))); err != nil {
		return err
	}
	err := dst.CopyFrom(src, off, off, int64(len(p)))
	if err == nil {
		return nil
	}
	if !errors.Is(err, block.ErrCopyUnsupported) {
		return &Error{OpWrite, off, err}
	}
	c.noOffload.Store(true)
	if err := c.read(ctx, p, off); err != nil {
		return err
	}
	return c.writeSpans(ctx, p, off, c.spans(p, off))
}

// writeSpans writes the spans of p, which holds the source at off.
func (c *copier) writeSpans(ctx context.Context, p []byte, off int64, spans []span) error {
	for _, s := range spans {
		at := off + int64(s.from)
		if s.zero {
			if err := c.zero(ctx, at, int64(s.to-s.from)); err != nil {
				return err
			}
			continue
		}
		if err := c.rate.Wait(ctx, int64(s.to-s.from)); err != nil {
			return err
		}
		if _, err := c.dst.WriteAt(ctx, p[s.from:s.to], at, 0); err != nil {
			return &Error{OpWrite, at, err}
		}
	}
	return nil
}
