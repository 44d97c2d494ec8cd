package convert

import (
	"context"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"

	"github.com/ovis-storage/ovis/block"
	"github.com/ovis-storage/ovis/qcow2"
)

// Sizes of the requests the copy makes.
const (
	// copyChunk is the largest read or write one worker makes.
	copyChunk = 2 << 20
	// zeroChunk is the largest WriteZeroes one worker makes, so that
	// progress and cancellation stay responsive.
	zeroChunk = 256 << 20
	// compressSlack is room after a job's compressed clusters for one
	// that comes out larger than its input (a few bytes of frame per
	// block).
	compressSlack = 64 << 10
)

// Copy copies the whole of src onto dst, which must be at least as large
// (ErrOutputTooSmall), and flushes dst. It closes neither.
//
// Ranges the source reports as zero are zeroed (with the unmap hint), or
// not written at all with TargetIsZero; all-zero runs of at least
// MinSparse bytes inside data are zeroed too. The first error stops the
// copy and is returned: an *Error for a failed step, ctx's error once ctx
// is done, ErrCompressUnsupported, or the error of Options.Validate. What
// was written before it stays written.
func Copy(ctx context.Context, dst, src block.Device, o Options) error {
	if err := o.Validate(); err != nil {
		return err
	}
	c := &copier{
		src:          src,
		dst:          dst,
		minSparse:    o.minSparse(),
		workers:      o.workers(),
		copyTopOnly:  o.TopOnly,
		zeroSkipFrom: o.BackingEnd,
		skipZeroTail: o.HasBackingEnd,
		ordered:      !o.OutOfOrder,
		salvage:      o.Salvage,
		salvaged:     o.Salvaged,
		copyRange:    o.CopyRange,
		rate:         NewRateLimiter(o.RateLimit),
		progressFn:   o.Progress,
		dataProgress: o.DataProgress,
		total:        src.Size(),
	}
	c.hasZeroInit = o.TargetIsZero && c.minSparse > 0
	c.srcBackingEnd = src.Size()
	if img, ok := block.As[*qcow2.Image](src); ok && o.TopOnly {
		// Past its backing file's end (or with none) the source's
		// unallocated ranges read as zeros of its own, which the
		// output's backing file need not hold: they are zeroed, as
		// QEMU's block status reports them zero there.
		c.srcBackingEnd = 0
		if b := img.Backing(); b != nil {
			c.srcBackingEnd = b.Size()
		}
	}
	if o.Compress {
		img, ok := block.As[*qcow2.Image](dst)
		if !ok {
			return ErrCompressUnsupported
		}
		c.compressed = img
		c.clusterSize = img.ClusterSize()
	}
	if dst.Size() < src.Size() {
		return fmt.Errorf("%w (%d < %d bytes)", ErrOutputTooSmall, dst.Size(), src.Size())
	}
	return c.run(ctx)
}

// copier is one copy: one goroutine (the producer) walks the source's
// extents and hands ranges (jobs) to workers that read them and find
// their zeros; the writes are made by the workers themselves, or, when
// the copy is ordered, by one writer goroutine in job order.
//
// It follows qemu-img convert's block classification: a range the source
// reports as zero is not written when the output reads as zeros already
// (hasZeroInit), and is zeroed otherwise; a data range is read, and its
// all-zero runs of at least minSparse bytes are treated as zero ranges;
// with copyTopOnly, ranges below the source's top layer are left to the
// output's backing file.
type copier struct {
	src, dst block.Device
	// compressed is the output when every cluster is written compressed;
	// clusterSize is its cluster size.
	compressed  *qcow2.Image
	clusterSize int64
	// minSparse is 0 to write every byte and zero without unmapping.
	minSparse int64
	workers   int
	// hasZeroInit: the output reads as zeros everywhere, so zero ranges
	// need no write.
	hasZeroInit bool
	// copyTopOnly: only the source's own layer (Depth 1) is copied.
	copyTopOnly bool
	// srcBackingEnd, with copyTopOnly, is where the source's backing file
	// ends: ranges no layer holds past it are the source's own zeros.
	srcBackingEnd int64
	// zeroSkipFrom, with skipZeroTail, is where the output's backing
	// file ends: past it a range the source reports as zero is left
	// unallocated, as qemu-img's target_backing_sectors does.
	zeroSkipFrom int64
	skipZeroTail bool
	// ordered makes the writes one at a time in job order: workers hand
	// their writes to one writer goroutine, which keeps the next ones
	// waiting until their turn.
	ordered bool
	// seq is the next job's sequence number (producer only).
	seq uint64
	// salvage turns what cannot be read into zeros, sector by sector;
	// salvaged hears of each, under salvageMu.
	salvage   bool
	salvaged  func(*Error)
	salvageMu sync.Mutex
	// copyRange copies data between two raw files in the kernel;
	// noOffload is set for good once the kernel refuses.
	copyRange bool
	noOffload atomic.Bool
	// rate paces the writes; nil does not.
	rate *RateLimiter
	// progressFn hears of done (of total) under progressMu.
	progressFn  func(done, total int64)
	progressMu  sync.Mutex
	done, total int64
	// dataProgress hears of the data handed out so far (dataDone), of
	// dataTotal, counted by a first walk of the extents as qemu-img
	// counts it; dataDone and qnext (where the next buffer starts)
	// belong to the producer.
	dataProgress    func(queued, total int64)
	dataTotal       int64
	dataDone, qnext int64
}

// kind classifies a range of the source.
type kind uint8

const (
	kindData kind = iota // read and write
	kindZero             // reads as zeros
	kindSkip             // provided by the output's backing file
)

// job is one range handed to a worker. seq numbers the jobs in offset
// order, from 0.
type job struct {
	kind   kind
	off, n int64
	seq    uint64
}

// write is a job's writes, prepared by a worker: run makes them; buf
// (which holds the data) goes back to the pool afterwards.
type write struct {
	seq uint64
	n   int64
	buf []byte
	run func(context.Context) error
}

// progress counts n more bytes done.
func (c *copier) progress(n int64) {
	if c.progressFn == nil {
		return
	}
	c.progressMu.Lock()
	defer c.progressMu.Unlock()
	c.done += n
	c.progressFn(c.done, c.total)
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
	bufSize := int64(copyChunk)
	if c.compressed != nil {
		bufSize = max(bufSize, c.clusterSize)
		// The compressed clusters go after the data, packed; the slack
		// holds the last one even when it comes out larger than its
		// input (and is then dropped).
		bufSize += bufSize + c.clusterSize + compressSlack
	}
	// Compressors, one per CPU, kept for the whole copy: a worker
	// borrows one for each job it compresses. More workers than CPUs
	// only add read-ahead; more encoders than CPUs would only add
	// tables competing for the caches (measured: about 15 % more CPU time
	// with 8 than with 2 on 2 cores).
	var comps chan *qcow2.Compressor
	if c.compressed != nil {
		n := min(c.workers, runtime.NumCPU())
		comps = make(chan *qcow2.Compressor, n)
		for range n {
			comp, err := c.compressed.NewCompressor()
			if err != nil {
				return &Error{OpCompress, -1, err}
			}
			comps <- comp
		}
	}
	// One buffer per worker, and when ordered as many again for jobs
	// read ahead of the writer.
	nbuf := c.workers
	if c.ordered {
		nbuf *= 2
	}
	bufs, release := block.CopyBuffers(nbuf, int(bufSize))
	// Every goroutine that holds a buffer has returned before run does.
	defer release()
	pool := make(chan []byte, nbuf)
	for _, b := range bufs {
		pool <- b
	}
	var writes chan write
	writerDone := make(chan struct{})
	if c.ordered {
		writes = make(chan write, nbuf)
		go func() {
			defer close(writerDone)
			c.writeInOrder(ctx, writes, pool, fail)
		}()
	} else {
		close(writerDone)
	}
	jobs := make(chan job, 2*c.workers)
	for range c.workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				// The buffer comes before the job: a worker that holds
				// a job never waits for a buffer, which the writer may
				// hold for later jobs until this one is written.
				var buf []byte
				select {
				case buf = <-pool:
				case <-ctx.Done():
					return // the producer stops on ctx too
				}
				j, ok := <-jobs
				if !ok {
					// Give the buffer back: a worker still waiting for
					// one must get it to see that the jobs are done.
					pool <- buf
					return
				}
				if ctx.Err() != nil {
					pool <- buf
					return
				}
				w, err := c.prepare(ctx, j, buf, comps)
				if err != nil {
					pool <- buf
					fail(err)
					continue
				}
				if c.ordered {
					writes <- w
					continue
				}
				err = w.run(ctx)
				pool <- buf
				if err != nil {
					fail(err)
					continue
				}
				c.progress(w.n)
			}
		}()
	}
	if err := c.produce(ctx, jobs); err != nil {
		fail(err)
	}
	close(jobs)
	wg.Wait()
	if writes != nil {
		close(writes)
	}
	<-writerDone
	if first != nil {
		return first
	}
	if err := c.dst.Flush(ctx); err != nil {
		return &Error{OpFlush, -1, err}
	}
	return nil
}

// writeInOrder makes the writes it receives in sequence order, keeping
// those that come early until their turn, and returns their buffers to
// the pool. It returns when writes is closed or the copy failed.
func (c *copier) writeInOrder(ctx context.Context, writes <-chan write, pool chan<- []byte, fail func(error)) {
	pending := map[uint64]write{}
	var next uint64
	for {
		select {
		case w, ok := <-writes:
			if !ok {
				return
			}
			pending[w.seq] = w
		case <-ctx.Done():
			// Drain so that no worker blocks on a full channel.
			for w := range writes {
				pool <- w.buf
			}
			return
		}
		for {
			w, ok := pending[next]
			if !ok {
				break
			}
			delete(pending, next)
			next++
			if ctx.Err() != nil {
				pool <- w.buf
				continue
			}
			err := w.run(ctx)
			pool <- w.buf
			if err != nil {
				fail(err)
				continue
			}
			c.progress(w.n)
		}
	}
}
