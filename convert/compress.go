package convert

import (
	"context"

	"github.com/ovis-storage/ovis/block"
	"github.com/ovis-storage/ovis/qcow2"
)

// prepareCompressed reads the whole clusters of a job and compresses
// them, on the worker, into the second part of its buffer; its writes
// only store them (or zero all-zero clusters), so that an ordered copy's
// one writer does not compress. The last cluster may be short: it ends
// with the output.
func (c *copier) prepareCompressed(ctx context.Context, j job, w write, comps chan *qcow2.Compressor) (write, error) {
	cs := c.clusterSize
	srcSize, dstSize := c.src.Size(), c.dst.Size()
	n := min(j.n, dstSize-j.off)
	// The buffer is the data's part, as much again, one more cluster and
	// compressSlack (see run).
	p, zbuf := w.buf[:n], w.buf[(len(w.buf)-int(cs)-compressSlack)/2:]
	have := max(0, min(n, srcSize-j.off))
	if err := c.read(ctx, p[:have], j.off); err != nil {
		return w, err
	}
	clear(p[have:])
	type cluster struct {
		q, z []byte // z nil: store q as it is
		zero bool
	}
	clusters := make([]cluster, 0, (n+cs-1)/cs)
	comp := <-comps
	defer func() { comps <- comp }()
	for i := int64(0); i < n; i += cs {
		q := p[i:min(i+cs, n)]
		if block.IsZero(q) {
			clusters = append(clusters, cluster{q: q, zero: true})
			continue
		}
		z, ok, err := comp.Compress(zbuf, q)
		if err != nil {
			return w, &Error{OpCompress, j.off + i, err}
		}
		if ok {
			zbuf = zbuf[len(z):]
		}
		clusters = append(clusters, cluster{q: q, z: z})
	}
	w.run = func(ctx context.Context) error {
		for i, cl := range clusters {
			off := j.off + int64(i)*cs
			if cl.zero {
				if err := c.zero(ctx, off, int64(len(cl.q))); err != nil {
					return err
				}
				continue
			}
			// Throttled by the guest bytes, as QEMU throttles the request.
			if err := c.rate.Wait(ctx, int64(len(cl.q))); err != nil {
				return err
			}
			if err := c.compressed.WritePrecompressed(ctx, cl.z, cl.q, off); err != nil {
				return &Error{OpWriteCompressed, off, err}
			}
		}
		return nil
	}
	return w, nil
}
