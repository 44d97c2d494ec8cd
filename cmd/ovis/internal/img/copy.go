package img

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"runtime"
	"sync"
	"sync/atomic"

	"github.com/schollz/progressbar/v3"

	"github.com/ovis-storage/ovis/block"
	"github.com/ovis-storage/ovis/qcow2"
)

// copier is the copy loop of convert: one goroutine walks the source's
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
	// zeroSkipFrom, with skipZeroTail, is where the new output's backing
	// file ends (in whole sectors): past it the backing file reads zeros,
	// so a range the source reports as zero is left unallocated, as
	// qemu-img's target_backing_sectors does; zeros found in data are
	// still written.
	zeroSkipFrom int64
	skipZeroTail bool
	// bar is the progress bar, nil without -p. Add64 is safe for
	// concurrent use.
	bar *progressbar.ProgressBar
	// qprog prints qemu-img's "    (12.34/100%)" lines instead (-p when
	// stdout is no terminal), computed as qemu-img computes them: the
	// share of the data (the sectors qemu-img reads, or with -S 0 also
	// zeroes) handed out so far, a step per buffer (2 MiB, or one cluster
	// with -c) from the start of each data extent. dataTotal is counted
	// by a first walk of the extents, as qemu-img counts it; dataDone and
	// qnext (where the next buffer starts) belong to the producer.
	qprog           *qemuProgress
	dataTotal       int64
	dataDone, qnext int64
	// ordered makes the writes one at a time in job order (qemu-img
	// convert without -W): workers hand their writes to one writer
	// goroutine, which keeps the next ones waiting until their turn.
	ordered bool
	// seq is the next job's sequence number (producer only).
	seq uint64
	// salvage (--salvage) turns what cannot be read into zeros, sector
	// by sector, with a warning for each sector.
	salvage bool
	// copyRange (-C) copies data between two raw files in the kernel;
	// it is cleared for good once the kernel refuses.
	copyRange bool
	noOffload atomic.Bool
	// rate paces the writes (-r); nil does not.
	rate *rateLimiter
	// warn receives the warnings; nil under -q.
	warn   io.Writer
	warnMu sync.Mutex
}

// Bounds of the range one Extent call covers (see produce).
const (
	minExtentAsk = 4 << 20
	maxExtentAsk = 1 << 40
)

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

var zeroSector [512]byte

// warnf prints a warning as QEMU's warn_report does, unless quiet.
func (c *copier) warnf(format string, args ...any) {
	if c.warn == nil {
		return
	}
	c.warnMu.Lock()
	defer c.warnMu.Unlock()
	fmt.Fprintf(c.warn, "ovis: warning: "+format+"\n", args...)
}

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
				return fmt.Errorf("error while compressing: %w", err)
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
		return fmt.Errorf("error while flushing the output: %w", err)
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

// classify maps a source extent to what the copy does with it. With -S 0
// zeros are data too: qemu-img then allocates the whole output.
func (c *copier) classify(e block.Extent, off int64) kind {
	switch {
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
	if c.qprog != nil {
		// qemu-img's first pass: the data sectors, for the percentage.
		err := c.walk(ctx, func(k kind, off, end int64) error {
			if k == kindData {
				c.dataTotal += (end - off + 511) / 512
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
	// ask is how far each Extent call looks: the engine maps the whole
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
			return fmt.Errorf("error while reading block status at offset %d: %w", off, err)
		}
		if e.Length <= 0 {
			return fmt.Errorf("error while reading block status at offset %d: empty extent", off)
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
		k := c.classify(e, off)
		if k == kindData && c.qprog != nil {
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
// block status cuts it, so that the progress steps fall where qemu-img's
// do: where the clusters stop being contiguous in the host file, and
// after each compressed cluster.
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

// qemuStep prints the qemu-img progress lines of the data buffers that
// start in [c.qnext, upto) of the data range ending at end, as qemu-img
// prints one when it hands a buffer to a coroutine.
func (c *copier) qemuStep(upto, end int64) {
	step := int64(copyChunk)
	if c.compressed != nil {
		step = c.clusterSize
	}
	for c.qnext < upto && c.qnext < end {
		n := min(step, end-c.qnext)
		c.dataDone += (n + 511) / 512
		c.qnext += n
		c.qprog.print(float32(100*float64(c.dataDone)/float64(c.dataTotal)), 0)
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
		if k == kindData && c.qprog != nil {
			c.qemuStep(off+n, end)
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
// already. Without -S 0 the range may be deallocated.
func (c *copier) zero(ctx context.Context, off, n int64) error {
	if c.hasZeroInit {
		return nil
	}
	if err := c.rate.wait(ctx, n); err != nil {
		return err
	}
	at, m := off, n
	if c.ordered {
		at, m = c.widenZero(ctx, off, n)
	}
	if err := c.dst.WriteZeroes(ctx, at, m, block.ZeroFlags(c.minSparse > 0, false)); err != nil {
		return fmt.Errorf("error while writing at byte %d: %w", off, err)
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

func (c *copier) read(ctx context.Context, p []byte, off int64) error {
	_, err := c.src.ReadAt(ctx, p, off)
	switch {
	case err == nil:
		return nil
	case !c.salvage:
		return fmt.Errorf("error while reading at byte %d: %w", off, err)
	}
	// As qemu-img convert --salvage: read the range again one sector at
	// a time, and zero the sectors that still fail.
	for i := 0; i < len(p); i += 512 {
		q := p[i:min(i+512, len(p))]
		if _, err := c.src.ReadAt(ctx, q, off+int64(i)); err != nil {
			c.warnf("error while reading offset %d: %s", off+int64(i), strerror(err))
			clear(q)
		}
	}
	return nil
}

// salvageExtent finds the status at off after asking for want bytes
// failed with err: it asks for a quarter as much until one sector is
// left, which is then taken as data (to be read, and zeroed if that fails
// too).
func (c *copier) salvageExtent(ctx context.Context, off, want int64, err error) block.Extent {
	for n := want; n > 512; {
		n = (n/512 + 3) / 4 * 512
		var e block.Extent
		if e, err = block.FirstExtent(ctx, c.src, off, n); err == nil {
			return e
		}
	}
	c.warnf("error while reading block status at offset %d: %s", off, strerror(err))
	return block.Extent{Length: min(512, c.src.Size()-off), Status: block.StatusData, Depth: 1}
}

// span is a piece of a data job: bytes to write, or zeros.
type span struct {
	from, to int
	zero     bool
}

// prepareData reads one data range and splits it into the data to write
// and its all-zero runs of at least minSparse bytes, which are zeroed
// instead. Under -C the range is copied in the kernel when it can be.
func (c *copier) prepareData(ctx context.Context, j job, w write) (write, error) {
	off, p := j.off, w.buf[:j.n]
	if c.copyRange && !c.noOffload.Load() {
		// The output's Raw is found under its cache-mode wrapper: a
		// copied range gets no FUA of its own, and is durable with
		// the flush that closing the output makes.
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
	if err := c.rate.wait(ctx, int64(len(p))); err != nil {
		return err
	}
	err := dst.CopyFrom(src, off, off, int64(len(p)))
	if err == nil {
		return nil
	}
	if !errors.Is(err, block.ErrCopyUnsupported) {
		return fmt.Errorf("error while writing at byte %d: %w", off, err)
	}
	c.noOffload.Store(true)
	if err := c.read(ctx, p, off); err != nil {
		return err
	}
	return c.writeSpans(ctx, p, off, c.spans(p, off))
}

// spans splits data read at off into the runs to write and the zero
// runs to zero instead, where qemu-img convert splits its buffer
// (is_allocated_sectors_min): a run of zero sectors counts only if it
// starts the buffer or is at least minSparse long, and the ends of data
// runs are rounded up to the alignment (minSparse rounded down to a power
// of two) while zero runs shrink to it, so that writes stay aligned.
func (c *copier) spans(p []byte, off int64) []span {
	if c.minSparse <= 0 {
		return []span{{0, len(p), false}}
	}
	nsec := (len(p) + 511) / 512
	minSec := max(int(c.minSparse/512), 1)
	align := 1
	for align*2 <= minSec {
		align *= 2
	}
	var spans []span
	add := func(from, to int, zero bool) {
		to = min(to*512, len(p))
		from *= 512
		if k := len(spans); k > 0 && spans[k-1].zero == zero {
			spans[k-1].to = to
			return
		}
		spans = append(spans, span{from, to, zero})
	}
	sector := off / 512
	for i := 0; i < nsec; {
		data, n := allocatedSectorsMin(p, i, nsec-i, minSec, sector+int64(i), align)
		add(i, i+n, !data)
		i += n
	}
	return spans
}

// sectorIsZero reports whether sector i of p (maybe short at the end)
// is all zeros.
func sectorIsZero(p []byte, i int) bool {
	s := p[i*512 : min(i*512+512, len(p))]
	return bytes.Equal(s, zeroSector[:len(s)])
}

// allocatedSectors is qemu-img's is_allocated_sectors over the n sectors
// of p from sector i (device sector number sector): whether the first
// holds data, and how many share its state, the run's end aligned.
func allocatedSectors(p []byte, i, n int, sector int64, align int) (bool, int) {
	if n <= 0 {
		return false, 0
	}
	zero := sectorIsZero(p, i)
	k := 1
	for k < n && sectorIsZero(p, i+k) == zero {
		k++
	}
	if k == n {
		return !zero, k
	}
	if tail := int((sector + int64(k)) & int64(align-1)); tail != 0 {
		if zero && k <= tail {
			// The data that follows rewrites this short zero tail anyway.
			zero = false
		}
		if !zero {
			k = min(k+align-tail, n)
		} else {
			k -= tail
		}
	}
	return !zero, k
}

// allocatedSectorsMin is qemu-img's is_allocated_sectors_min: a data run
// goes on over zero runs shorter than minSec sectors.
func allocatedSectorsMin(p []byte, i, n, minSec int, sector int64, align int) (bool, int) {
	minSec = min(minSec, n)
	data, k := allocatedSectors(p, i, n, sector, align)
	if !data {
		return false, k
	}
	used, checked := k, k
	i, n, sector = i+k, n-k, sector+int64(k)
	for n > 0 {
		data, k = allocatedSectors(p, i, n, sector, align)
		i, n, sector = i+k, n-k, sector+int64(k)
		checked += k
		if data {
			used = checked
		} else if k >= minSec {
			break
		}
	}
	return true, used
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
		if err := c.rate.wait(ctx, int64(s.to-s.from)); err != nil {
			return err
		}
		if _, err := c.dst.WriteAt(ctx, p[s.from:s.to], at, 0); err != nil {
			return fmt.Errorf("error while writing at byte %d: %w", at, err)
		}
	}
	return nil
}

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
			return w, fmt.Errorf("error while compressing cluster at byte %d: %w", j.off+i, err)
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
			if err := c.rate.wait(ctx, int64(len(cl.q))); err != nil {
				return err
			}
			if err := c.compressed.WritePrecompressed(ctx, cl.z, cl.q, off); err != nil {
				return fmt.Errorf("error while writing compressed cluster at byte %d: %w", off, err)
			}
		}
		return nil
	}
	return w, nil
}

// compressSlack is room after a job's compressed clusters for one that
// comes out larger than its input (a few bytes of frame per block).
const compressSlack = 64 << 10
