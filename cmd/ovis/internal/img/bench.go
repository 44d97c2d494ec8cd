package img

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ovis-storage/ovis/block"
	"github.com/ovis-storage/ovis/export"
	"github.com/ovis-storage/ovis/qcow2"
)

// BenchConfig is what `ovis img bench` was given, as qemu-img bench's
// arguments: bench [-c COUNT] [-d DEPTH] [-f FMT] [--flush-interval=N]
// [--no-drain] [-n] [-o OFFSET] [--pattern=N] [-q] [-s SIZE] [-S STEP]
// [-t CACHE] [-w] [-U] FILENAME. Numbers are kept as typed and checked by
// Bench with qemu-img's messages.
type BenchConfig struct {
	// Filename is the image to run requests against.
	Filename string
	// Format is "qcow2", "raw" or "" to probe.
	Format string
	// Count (-c) is the number of requests; the default is 75000.
	Count string
	// Depth (-d) is how many requests are in flight; the default is 64.
	Depth string
	// Offset (-o) is the offset of the first request.
	Offset string
	// BufSize (-s) is the size of each request; the default is 4 KiB.
	BufSize string
	// Step (-S) is the distance between the offsets of consecutive
	// requests; 0 (the default) means BufSize.
	Step string
	// Pattern (--pattern) is the byte written by write requests.
	Pattern string
	// FlushInterval (--flush-interval) flushes every that many requests
	// (write tests only); NoDrain lets requests run during the flush
	// instead of waiting for those in flight first.
	FlushInterval string
	NoDrain       bool
	// Cache (-t) is the cache mode, writeback by default.
	Cache string
	// Write (-w) sends writes instead of reads.
	Write bool
	// Quiet (-q) leaves out the cache counters, which qemu-img does not
	// print.
	Quiet bool
}

// benchRun is a parsed BenchConfig.
type benchRun struct {
	count, depth, flushInterval int
	offset, bufSize, step       int64
	pattern                     byte
	drain, write                bool
	cache                       block.CacheMode
}

// parseBench checks the numbers as qemu-img bench does.
func parseBench(cfg BenchConfig) (*benchRun, error) {
	r := &benchRun{count: 75000, depth: 64, bufSize: 4096, drain: !cfg.NoDrain, write: cfg.Write}
	ulong := func(s string, max uint64) (uint64, bool) {
		v, err := strconv.ParseUint(s, 0, 64)
		return v, err == nil && v <= max
	}
	if cfg.Count != "" {
		v, ok := ulong(cfg.Count, math.MaxInt32)
		if !ok {
			return nil, errors.New("Invalid request count specified")
		}
		r.count = int(v)
	}
	if cfg.Depth != "" {
		// qemu-img accepts 0 and then waits forever; ovis refuses it.
		v, ok := ulong(cfg.Depth, math.MaxInt32)
		if !ok || v == 0 {
			return nil, errors.New("Invalid queue depth specified")
		}
		r.depth = int(v)
	}
	if cfg.Offset != "" {
		v, err := cvtnum("offset", cfg.Offset, math.MaxInt64)
		if err != nil {
			return nil, err
		}
		r.offset = v
	}
	if cfg.BufSize != "" {
		v, err := cvtnum("buffer size", cfg.BufSize, math.MaxInt32)
		if err != nil {
			return nil, err
		}
		r.bufSize = v
	}
	if cfg.Step != "" {
		v, err := cvtnum("step_size", cfg.Step, math.MaxInt32)
		if err != nil {
			return nil, err
		}
		r.step = v
	}
	if r.step == 0 {
		r.step = r.bufSize
	}
	if cfg.Pattern != "" {
		v, ok := ulong(cfg.Pattern, 0xff)
		if !ok {
			return nil, errors.New("Invalid pattern byte specified")
		}
		r.pattern = byte(v)
	}
	if cfg.FlushInterval != "" {
		v, ok := ulong(cfg.FlushInterval, math.MaxInt32)
		if !ok {
			return nil, errors.New("Invalid flush interval specified")
		}
		r.flushInterval = int(v)
	}
	if cfg.Cache != "" {
		m, err := block.ParseCacheMode(cfg.Cache)
		if err != nil {
			return nil, errors.New("Invalid cache mode")
		}
		r.cache = m
	}
	return r, nil
}

// Bench runs count requests of bufSize bytes against an image, depth of
// them in flight, at offsets that advance by step and wrap around before
// the end of the image, as qemu-img bench does, and prints qemu-img's two
// lines and then the qcow2 metadata cache counters (hits, misses,
// evictions, writebacks of the L2 and refcount caches).
func (e *Env) Bench(ctx context.Context, cfg BenchConfig) error {
	stdout := e.stdout()
	r, err := parseBench(cfg)
	if err != nil {
		return err
	}
	if !r.write && r.flushInterval != 0 {
		return errors.New("--flush-interval is only available in write tests")
	}
	if r.flushInterval != 0 && r.flushInterval < r.depth {
		return errors.New("Flush interval can't be smaller than depth")
	}
	o := qcow2.Options{ReadOnly: !r.write, OpenFile: block.OpenFileFor(r.cache)}
	dev, err := e.openImage(cfg.Filename, cfg.Format, o)
	if err != nil {
		return err
	}
	defer dev.Close()
	d := export.WithCacheMode(dev, r.cache)
	kind := "read"
	if r.write {
		kind = "write"
	}
	fmt.Fprintf(stdout, "Sending %d %s requests, %d bytes each, %d in parallel (starting at offset %d, step size %d)\n",
		r.count, kind, r.bufSize, r.depth, r.offset, r.step)
	if r.flushInterval != 0 {
		fmt.Fprintf(stdout, "Sending flush every %d requests\n", r.flushInterval)
	}
	start := time.Now()
	if err := r.run(ctx, d, (dev.Size()+511)&^511); err != nil {
		return fmt.Errorf("Failed request: %s", requestReason(err))
	}
	fmt.Fprintf(stdout, "Run completed in %3.3f seconds.\n", time.Since(start).Seconds())
	if img, ok := block.As[*qcow2.Image](dev); ok && !cfg.Quiet {
		l2, rc := img.CacheStats()
		for _, c := range []struct {
			name string
			s    qcow2.CacheStats
		}{{"L2 cache", l2}, {"Refcount cache", rc}} {
			fmt.Fprintf(stdout, "%s: %d hits, %d misses, %d evictions, %d writebacks\n",
				c.name, c.s.Hits, c.s.Misses, c.s.Evictions, c.s.Writebacks)
		}
	}
	return nil
}

// requestReason is the strerror QEMU reports for a failed request: a
// request past the end is EIO there.
func requestReason(err error) string {
	if errors.Is(err, block.ErrOutOfRange) {
		return "Input/output error"
	}
	return strerror(err)
}

// run sends the requests. Offsets are handed out in submission order, as
// qemu-img computes them; depth workers each keep one request in flight.
// With a flush interval and draining, every flushInterval requests the
// workers wait for those in flight, and a flush runs alone.
func (r *benchRun) run(ctx context.Context, d block.Device, size int64) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var (
		mu      sync.Mutex
		next    = r.offset
		issued  int
		beyond  bool  // a request past the end was handed out; guarded by mu
		first   error // guarded by mu
		flushes sync.WaitGroup
		done    atomic.Int64
	)
	fail := func(err error) {
		mu.Lock()
		if first == nil {
			first = err
		}
		mu.Unlock()
		cancel()
	}
	failed := func() error {
		mu.Lock()
		defer mu.Unlock()
		return first
	}
	// take returns the next request's offset, or false when a batch (up
	// to limit requests) or the run is complete.
	take := func(limit int) (int64, bool) {
		mu.Lock()
		defer mu.Unlock()
		if issued >= limit || ctx.Err() != nil || beyond {
			return 0, false
		}
		issued++
		off := next
		if off+r.bufSize > size {
			// qemu-img's submission of a request past the end fails at
			// once, before it submits another: hand out none after it,
			// whatever the scheduling (another worker's request would
			// change bytes qemu-img leaves alone).
			beyond = true
		}
		next += r.step
		if size <= r.bufSize {
			next = 0
		} else {
			next %= size - r.bufSize
		}
		return off, true
	}
	worker := func(limit int, buf []byte) {
		for {
			off, ok := take(limit)
			if !ok {
				return
			}
			var err error
			if r.write {
				_, err = d.WriteAt(ctx, buf, off, 0)
			} else {
				_, err = d.ReadAt(ctx, buf, off)
			}
			if err != nil {
				fail(err)
				return
			}
			if n := done.Add(1); !r.drain && r.flushInterval != 0 && n%int64(r.flushInterval) == 0 {
				flushes.Add(1)
				go func() {
					defer flushes.Done()
					if err := d.Flush(ctx); err != nil {
						fail(err)
					}
				}()
			}
		}
	}
	bufs := make([][]byte, r.depth)
	for i := range bufs {
		bufs[i] = make([]byte, r.bufSize)
		if r.pattern != 0 {
			for j := range bufs[i] {
				bufs[i][j] = r.pattern
			}
		}
	}
	batch := r.count
	if r.drain && r.flushInterval != 0 {
		batch = r.flushInterval
	}
	for limit := min(batch, r.count); ; limit = min(limit+batch, r.count) {
		var wg sync.WaitGroup
		for i := range r.depth {
			wg.Add(1)
			go func() {
				defer wg.Done()
				worker(limit, bufs[i])
			}()
		}
		wg.Wait()
		if failed() != nil || limit == r.count {
			break
		}
		if err := d.Flush(ctx); err != nil {
			fail(err)
			break
		}
	}
	flushes.Wait()
	if err := failed(); err != nil {
		return err
	}
	return ctx.Err()
}
