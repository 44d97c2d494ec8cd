package img

import (
	"bytes"
	"context"
	"fmt"
	"sync"

	"github.com/schollz/progressbar/v3"

	"github.com/ovis-storage/ovis/block"
	"github.com/ovis-storage/ovis/qcow2"
)

// copier is the copy loop of convert: one goroutine walks the source's
// extents and hands ranges to workers that read, drop zeros, and write.
//
// It follows qemu-img convert's block classification: a range the source
// reports as zero is not written when the output reads as zeros already
// (hasZeroInit), and is zeroed otherwise; a data range is read, and its
// all-zero runs of at least minSparse bytes are treated as zero ranges;
// with copyTopOnly, ranges below the source's top layer are left to the
// output's backing file.
type copier struct {
	src, dst block.Device
	// compressed is the output when every cluster is written compressed
	// (-c); clusterSize is its cluster size.
	compressed  *qcow2.Image
	clusterSize int64
	// minSparse is -S; 0 writes every byte and zeroes without unmapping.
	minSparse int64
	workers   int
	// hasZeroInit: the output is new, has no backing file, and reads as
	// zeros everywhere, so zero ranges need no write.
	hasZeroInit bool
	// copyTopOnly: the output has a backing file standing in for the
	// source's, so only the source's own layer (Depth 1) is copied.
	copyTopOnly bool
	// bar is the progress bar, nil without -p. Add64 is safe for
	// concurrent use.
	bar *progressbar.ProgressBar
}

// kind classifies a range of the source.
type kind uint8

const (
	kindData kind = iota // read and write
	kindZero             // reads as zeros
	kindSkip             // provided by the output's backing file
)

// job is one range handed to a worker.
type job struct {
	kind   kind
	off, n int64
}

var zeroSector [512]byte

func (c *copier) progress(n int64) {
	if c.bar != nil {
		c.bar.Add64(n)
	}
}

// run copies the whole source and flushes the output. The first error
// stops the copy and is returned.
func (c *copier) run(ctx context.Context) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var (
		wg    sync.WaitGroup
		once  sync.Once
		first error
	)
	fail := func(err error) {
		once.Do(func() {
			first = err
			cancel()
		})
	}
	jobs := make(chan job, 2*c.workers)
	bufSize := int64(copyChunk)
	if c.compressed != nil {
		bufSize = max(bufSize, c.clusterSize)
	}
	for range c.workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			buf := make([]byte, bufSize)
			for j := range jobs {
				if ctx.Err() != nil {
					continue // drain after a failure
				}
				if err := c.do(j, buf); err != nil {
					fail(err)
				}
			}
		}()
	}
	if err := c.produce(ctx, jobs); err != nil {
		fail(err)
	}
	close(jobs)
	wg.Wait()
	if first != nil {
		return first
	}
	if err := c.dst.Flush(); err != nil {
		return fmt.Errorf("error while flushing the output: %w", err)
	}
	return nil
}

// classify maps a source extent to what the copy does with it.
func (c *copier) classify(e block.Extent) kind {
	switch {
	case c.copyTopOnly && e.Depth != 1:
		return kindSkip
	case e.Status&block.StatusZero != 0:
		return kindZero
	}
	return kindData
}

// produce walks the source's extents and queues jobs. With compression
// every job covers whole clusters: a cluster that is not uniformly zero or
// skipped is data, read whole and written compressed.
func (c *copier) produce(ctx context.Context, jobs chan<- job) error {
	size := c.src.Size()
	for off := int64(0); off < size; {
		if err := ctx.Err(); err != nil {
			return err
		}
		e, err := c.src.Extent(off, size-off)
		if err != nil {
			return fmt.Errorf("error while reading block status at offset %d: %w", off, err)
		}
		if e.Length <= 0 {
			return fmt.Errorf("error while reading block status at offset %d: empty extent", off)
		}
		end := min(off+e.Length, size)
		k := c.classify(e)
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
		if err := c.emit(ctx, jobs, k, off, end); err != nil {
			return err
		}
		off = end
	}
	return nil
}

// emit queues [off, end) as jobs of at most one chunk each.
func (c *copier) emit(ctx context.Context, jobs chan<- job, k kind, off, end int64) error {
	if k == kindSkip || (k == kindZero && c.hasZeroInit) {
		c.progress(end - off)
		return nil
	}
	chunk := int64(zeroChunk)
	if k == kindData {
		chunk = copyChunk
		if c.compressed != nil {
			chunk = max(chunk-chunk%c.clusterSize, c.clusterSize)
		}
	}
	for off < end {
		// Cut at multiples of chunk so that requests stay aligned.
		n := min(end-off, chunk-off%chunk)
		select {
		case jobs <- job{k, off, n}:
		case <-ctx.Done():
			return ctx.Err()
		}
		off += n
	}
	return nil
}

// do runs one job with buf as scratch space.
func (c *copier) do(j job, buf []byte) error {
	var err error
	switch {
	case j.kind == kindZero:
		err = c.zero(j.off, j.n)
	case c.compressed != nil:
		err = c.copyCompressed(j.off, j.n, buf)
	default:
		err = c.copyData(j.off, j.n, buf)
	}
	if err == nil {
		c.progress(j.n)
	}
	return err
}

// zero makes [off, off+n) of the output read as zeros, unless it does
// already. Without -S 0 the range may be deallocated.
func (c *copier) zero(off, n int64) error {
	if c.hasZeroInit {
		return nil
	}
	if err := c.dst.WriteZeroes(off, n, c.minSparse > 0, false); err != nil {
		return fmt.Errorf("error while writing at byte %d: %w", off, err)
	}
	return nil
}

func (c *copier) read(p []byte, off int64) error {
	if _, err := c.src.ReadAt(p, off); err != nil {
		return fmt.Errorf("error while reading at byte %d: %w", off, err)
	}
	return nil
}

// copyData copies one data range, leaving out all-zero runs of at least
// minSparse bytes (found at 512-byte granularity).
func (c *copier) copyData(off, n int64, buf []byte) error {
	p := buf[:n]
	if err := c.read(p, off); err != nil {
		return err
	}
	write := func(from, to int) error {
		if from == to {
			return nil
		}
		if _, err := c.dst.WriteAt(p[from:to], off+int64(from), false); err != nil {
			return fmt.Errorf("error while writing at byte %d: %w", off+int64(from), err)
		}
		return nil
	}
	if c.minSparse == 0 {
		return write(0, len(p))
	}
	dataStart := 0
	for i := 0; i < len(p); {
		s := min(len(p)-i, len(zeroSector))
		if !bytes.Equal(p[i:i+s], zeroSector[:s]) {
			i += s
			continue
		}
		z := i + s
		for z < len(p) {
			s := min(len(p)-z, len(zeroSector))
			if !bytes.Equal(p[z:z+s], zeroSector[:s]) {
				break
			}
			z += s
		}
		if int64(z-i) >= c.minSparse {
			if err := write(dataStart, i); err != nil {
				return err
			}
			if err := c.zero(off+int64(i), int64(z-i)); err != nil {
				return err
			}
			dataStart = z
		}
		i = z
	}
	return write(dataStart, len(p))
}

// copyCompressed writes the whole clusters of [off, off+n) compressed,
// skipping (or zeroing) all-zero clusters. The last cluster may be short:
// it ends with the output.
func (c *copier) copyCompressed(off, n int64, buf []byte) error {
	cs := c.clusterSize
	srcSize, dstSize := c.src.Size(), c.dst.Size()
	for end := off + n; off < end; off += cs {
		p := buf[:min(cs, dstSize-off)]
		have := min(int64(len(p)), srcSize-off)
		if err := c.read(p[:have], off); err != nil {
			return err
		}
		clear(p[have:])
		if isZero(p) {
			if err := c.zero(off, int64(len(p))); err != nil {
				return err
			}
			continue
		}
		if err := c.compressed.WriteCompressed(p, off); err != nil {
			return fmt.Errorf("error while compressing cluster at byte %d: %w", off, err)
		}
	}
	return nil
}

// isZero reports whether p holds only zero bytes.
func isZero(p []byte) bool {
	for len(p) > 0 {
		s := min(len(p), len(zeroSector))
		if !bytes.Equal(p[:s], zeroSector[:s]) {
			return false
		}
		p = p[s:]
	}
	return true
}
