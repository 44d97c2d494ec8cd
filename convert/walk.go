package convert

import (
	"context"

	"github.com/ovis-storage/ovis/block"
	"github.com/ovis-storage/ovis/qcow2"
)

// Bounds of the range one Extents call covers (see walk).
const (
	minExtentAsk = 4 << 20
	maxExtentAsk = 1 << 40
)

// classify maps a source extent to what the copy does with it. Without
// zero detection zeros are data too: the whole output is then allocated.
func (c *copier) classify(e block.Extent, off int64) kind {
	switch {
	case c.copyTopOnly && e.Depth == 0 && off >= c.srcBackingEnd && e.Status&block.StatusZero != 0:
		if c.skipZeroTail && off >= c.zeroSkipFrom {
			return kindSkip
		}
		return kindZero
	case c.copyTopOnly && e.Depth != 1:
		return kindSkip
	case e.Status&block.StatusZero != 0 && c.skipZeroTail && off >= c.zeroSkipFrom:
		return kindSkip
	case e.Status&block.StatusZero != 0 && c.minSparse > 0:
		return kindZero
	}
	return kindData
}

// produce walks the source's extents and queues jobs. With compression
// every job covers whole clusters: a cluster that is not uniformly zero or
// skipped is data, read whole and written compressed.
func (c *copier) produce(ctx context.Context, jobs chan<- job) error {
	if c.dataProgress != nil {
		// qemu-img's first pass: the data sectors, for the percentage.
		err := c.walk(ctx, func(k kind, off, end int64) error {
			if k == kindData {
				c.dataTotal += (end - off + 511) / 512 * 512
			}
			return nil
		})
		if err != nil {
			return err
		}
	}
	return c.walk(ctx, func(k kind, off, end int64) error { return c.emit(ctx, jobs, k, off, end) })
}

// walk calls fn on the ranges of the source in order, classified.
func (c *copier) walk(ctx context.Context, fn func(k kind, off, end int64) error) error {
	size := c.src.Size()
	// ask is how far each Extents call looks: the engine maps the whole
	// range it is given (up to a few hundred runs) even though only the
	// first run is used, so the window starts small and doubles while
	// runs fill it, which keeps both fragmented and empty sources cheap.
	ask := int64(minExtentAsk)
	for off := int64(0); off < size; {
		if err := ctx.Err(); err != nil {
			return err
		}
		want := min(ask, size-off)
		e, err := block.FirstExtent(ctx, c.src, off, want)
		if err != nil && c.salvage {
			e, err = c.salvageExtent(ctx, off, want, err), nil
		}
		if err != nil {
			return &Error{OpBlockStatus, off, err}
		}
		if e.Length <= 0 {
			return &Error{OpBlockStatus, off, errEmptyExtent}
		}
		if e.Length == want {
			ask = min(2*ask, maxExtentAsk)
		} else {
			ask = minExtentAsk
		}
		end := min(off+e.Length, size)
		if c.skipZeroTail && off < c.zeroSkipFrom && end > c.zeroSkipFrom {
			// Zeros are handled differently from there on.
			end = c.zeroSkipFrom
		}
		if c.copyTopOnly && off < c.srcBackingEnd && end > c.srcBackingEnd {
			// So are the source's unallocated ranges.
			end = c.srcBackingEnd
		}
		k := c.classify(e, off)
		if k == kindData && c.dataProgress != nil {
			end = c.hostRun(ctx, off, end)
		}
		if cs := c.clusterSize; c.compressed != nil {
			// off is cluster aligned here.
			if k != kindData && (end == size || end-off >= cs) {
				if end != size {
					end -= end % cs
				}
			} else {
				k = kindData
				end = min((end+cs-1)/cs*cs, size)
			}
		}
		if err := fn(k, off, end); err != nil {
			return err
		}
		off = end
	}
	return nil
}

// hostRun cuts the data range [off, end) of a qcow2 source where QEMU's
// block status cuts it, so that the data progress steps fall where
// qemu-img's do: where the clusters stop being contiguous in the host
// file, and after each compressed cluster.
func (c *copier) hostRun(ctx context.Context, off, end int64) int64 {
	img, ok := block.As[*qcow2.Image](c.src)
	if !ok {
		return end
	}
	m, err := img.MapAt(ctx, off, end-off)
	if err != nil || m.Length <= 0 {
		return end
	}
	if m.Data && m.Offset < 0 {
		cs := img.ClusterSize()
		return min(end, (off/cs+1)*cs)
	}
	return min(end, off+m.Length)
}

// dataStep reports the data buffers that start in [c.qnext, upto) of the
// data range ending at end, as qemu-img counts one when it hands a buffer
// to a coroutine.
func (c *copier) dataStep(upto, end int64) {
	step := int64(copyChunk)
	if c.compressed != nil {
		step = c.clusterSize
	}
	for c.qnext < upto && c.qnext < end {
		n := min(step, end-c.qnext)
		c.dataDone += (n + 511) / 512 * 512
		c.qnext += n
		c.dataProgress(c.dataDone, c.dataTotal)
	}
}

// emit queues [off, end) as jobs of at most one chunk each.
func (c *copier) emit(ctx context.Context, jobs chan<- job, k kind, off, end int64) error {
	if k == kindSkip || (k == kindZero && c.hasZeroInit) {
		c.progress(end - off)
		return nil
	}
	chunk := int64(zeroChunk)
	c.qnext = off
	if k == kindData {
		chunk = copyChunk
		if c.compressed != nil {
			chunk = max(chunk-chunk%c.clusterSize, c.clusterSize)
		}
	}
	for off < end {
		// Cut at multiples of chunk so that requests stay aligned.
		n := min(end-off, chunk-off%chunk)
		if k == kindData && c.dataProgress != nil {
			c.dataStep(off+n, end)
		}
		select {
		case jobs <- job{k, off, n, c.seq}:
		case <-ctx.Done():
			return ctx.Err()
		}
		c.seq++
		off += n
	}
	return nil
}
