package qcow2_test

// Write interop: images that ovis creates and writes must pass qemu-img
// check, read in QEMU exactly as a raw mirror of every operation, and
// read back the same in ovis.

import (
	"bytes"
	"encoding/json"
	"fmt"
	"github.com/ovis-storage/ovis/block"
	"hash/fnv"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/ovis-storage/ovis/internal/testutil"
	"github.com/ovis-storage/ovis/qcow2"
)

// writeCase is one image ovis creates and then writes at random.
type writeCase struct {
	name string
	opts qcow2.CreateOptions // Size is the disk size
	open qcow2.Options       // for the writing Open
	// base, when set, is made by qemu-img before Create and becomes the
	// backing file: "qcow2" or "raw", of baseSize bytes.
	base     string
	baseSize int64
	ops      int  // random operations per worker
	workers  int  // goroutines on disjoint byte ranges (0 means 1)
	fill     bool // first write every byte, 64 KiB at a time in random order
	compress bool // mix in WriteCompressed on untouched clusters
	// growRefcountTable asserts the refcount table outgrew one cluster.
	growRefcountTable bool
}

func writeCases() []writeCase {
	const k, m = 1 << 10, 1 << 20
	o := func(cs int64, size int64) qcow2.CreateOptions {
		return qcow2.CreateOptions{ClusterSize: cs, Size: size}
	}
	with := func(opts qcow2.CreateOptions, f func(*qcow2.CreateOptions)) qcow2.CreateOptions {
		f(&opts)
		return opts
	}
	return []writeCase{
		{name: "c512", opts: o(512, 2*m), ops: 400},
		{name: "c4k", opts: o(4*k, 12*m+512), ops: 400},
		{name: "c64k", opts: o(64*k, 40*m), ops: 300},
		{name: "c2m", opts: o(2*m, 40*m), ops: 80},
		{name: "odd-size", opts: o(64*k, 3*m+1000), ops: 200},
		{name: "v2-c64k", opts: with(o(64*k, 16*m), func(c *qcow2.CreateOptions) { c.Compat = "0.10" }), ops: 300},
		{name: "v2-c512", opts: with(o(512, 2*m), func(c *qcow2.CreateOptions) { c.Compat = "0.10" }), ops: 300},
		{name: "v3-compat", opts: with(o(64*k, 16*m), func(c *qcow2.CreateOptions) { c.Compat = "1.1" }), ops: 200},
		{name: "rc1", opts: with(o(4*k, 8*m), func(c *qcow2.CreateOptions) { c.RefcountBits = 1 }), ops: 300},
		{name: "rc16", opts: with(o(4*k, 8*m), func(c *qcow2.CreateOptions) { c.RefcountBits = 16 }), ops: 300},
		{name: "rc64", opts: with(o(4*k, 8*m), func(c *qcow2.CreateOptions) { c.RefcountBits = 64 }), ops: 300},
		{name: "extl2-c64k", opts: with(o(64*k, 16*m), func(c *qcow2.CreateOptions) { c.ExtendedL2 = true }), ops: 300},
		{name: "extl2-c32k", opts: with(o(32*k, 8*m), func(c *qcow2.CreateOptions) { c.ExtendedL2 = true }), ops: 300},
		{name: "lazy", opts: with(o(64*k, 16*m), func(c *qcow2.CreateOptions) { c.LazyRefcounts = true }), ops: 300},
		{name: "backing-qcow2", opts: o(64*k, 16*m), base: "qcow2", baseSize: 16 * m, ops: 300},
		{name: "backing-short", opts: o(4*k, 8*m), base: "qcow2", baseSize: 3*m + 512, ops: 300},
		{name: "backing-raw-v2", opts: with(o(64*k, 8*m), func(c *qcow2.CreateOptions) { c.Compat = "0.10" }), base: "raw", baseSize: 8 * m, ops: 300},
		{name: "backing-extl2", opts: with(o(64*k, 8*m), func(c *qcow2.CreateOptions) { c.ExtendedL2 = true }), base: "qcow2", baseSize: 8 * m, ops: 300},
		{name: "backing-default-size", opts: o(64*k, 0), base: "qcow2", baseSize: 5*m + 512, ops: 200},
		{name: "datafile", opts: with(o(64*k, 16*m), func(c *qcow2.CreateOptions) { c.DataFile = "img.data" }), ops: 300},
		{name: "datafile-raw", opts: with(o(4*k, 8*m), func(c *qcow2.CreateOptions) { c.DataFile = "img.data"; c.DataFileRaw = true }), ops: 300},
		{name: "compress-zlib", opts: o(64*k, 16*m), ops: 200, compress: true},
		{name: "compress-zstd", opts: with(o(64*k, 16*m), func(c *qcow2.CreateOptions) { c.CompressionType = "zstd" }), ops: 200, compress: true},
		{name: "compress-zlib-c4k-tail", opts: o(4*k, 4*m+1536), ops: 300, compress: true},
		{name: "compress-zstd-c512", opts: with(o(512, 1*m), func(c *qcow2.CreateOptions) { c.CompressionType = "zstd" }), ops: 300, compress: true},
		{name: "compress-zlib-c2m", opts: o(2*m, 10*m), ops: 20, compress: true},
		{name: "compress-zlib-v2", opts: with(o(64*k, 8*m), func(c *qcow2.CreateOptions) { c.Compat = "0.10" }), ops: 200, compress: true},
		{name: "compress-over-backing", opts: o(64*k, 8*m), base: "qcow2", baseSize: 8 * m, ops: 200, compress: true},
		{name: "prealloc-metadata", opts: with(o(4*k, 8*m), func(c *qcow2.CreateOptions) { c.Preallocation = qcow2.PreallocMetadata }), ops: 300},
		{name: "prealloc-falloc", opts: with(o(64*k, 4*m), func(c *qcow2.CreateOptions) { c.Preallocation = qcow2.PreallocFalloc }), ops: 200},
		{name: "prealloc-full", opts: with(o(64*k, 4*m), func(c *qcow2.CreateOptions) { c.Preallocation = qcow2.PreallocFull }), ops: 200},
		{name: "concurrent-c4k", opts: o(4*k, 16*m), ops: 150, workers: 4},
		// Caches far smaller than the metadata: every operation evicts,
		// and dirty L2 slices and refcount blocks are written back in
		// the middle of allocations.
		{name: "tiny-cache-c4k", opts: o(4*k, 8*m), ops: 300,
			open: qcow2.Options{L2CacheSize: 1024, L2CacheEntrySize: 512, RefcountCacheSize: 1}},
		{name: "tiny-cache-c64k-hitcount", opts: o(64*k, 16*m), ops: 200,
			open: qcow2.Options{L2CacheSize: 128 * k, L2CachePolicy: "hitcount"}},
		{name: "tiny-cache-concurrent-c512", opts: o(512, 4*m), ops: 200, workers: 4,
			open: qcow2.Options{L2CacheSize: 1024, RefcountCacheSize: 1}},
		{name: "tiny-cache-concurrent-extl2-backing", opts: with(o(16*k, 8*m), func(c *qcow2.CreateOptions) { c.ExtendedL2 = true }),
			base: "qcow2", baseSize: 8 * m, ops: 150, workers: 3,
			open: qcow2.Options{L2CacheSize: 2048, L2CacheEntrySize: 1024}},
		{name: "concurrent-backing-extl2", opts: with(o(32*k, 16*m), func(c *qcow2.CreateOptions) { c.ExtendedL2 = true }), base: "qcow2", baseSize: 16 * m, ops: 100, workers: 4},
		// 131072 data clusters, 2048 L2 tables and ~530 refcount blocks:
		// the refcount table must grow several times.
		{name: "grow-c512-64m", opts: o(512, 64*m), fill: true, ops: 100, growRefcountTable: true},
		{name: "grow-c512-rc64", opts: with(o(512, 16*m), func(c *qcow2.CreateOptions) { c.RefcountBits = 64 }), fill: true, ops: 100, growRefcountTable: true},
	}
}

// seedFor is the case's random seed: OVIS_WRITE_SEED if set, else a hash
// of the case name, so that runs repeat.
func seedFor(t *testing.T, name string) uint64 {
	if s := os.Getenv("OVIS_WRITE_SEED"); s != "" {
		v, err := strconv.ParseUint(s, 0, 64)
		if err != nil {
			t.Fatalf("OVIS_WRITE_SEED=%q: %v", s, err)
		}
		return v
	}
	h := fnv.New64a()
	h.Write([]byte(name))
	return h.Sum64()
}

// TestWriteInterop creates each image with ovis, applies a seeded random
// sequence of writes, zero writes, discards, flushes and compressed
// writes while mirroring them into a raw model, and then has QEMU check
// the image and compare it with the model.
//
// The cases with several workers are TestWriteInteropConcurrent's.
func TestWriteInterop(t *testing.T) {
	t.Parallel()
	for _, c := range writeCases() {
		if c.workers > 1 {
			continue
		}
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			runWriteCase(t, c)
		})
	}
}

// TestWriteInteropConcurrent is TestWriteInterop's cases with several
// workers, which write from goroutines of their own at once: it keeps
// the race detector where TestWriteInterop, in one goroutine, runs
// without it (scripts/test.sh).
func TestWriteInteropConcurrent(t *testing.T) {
	t.Parallel()
	for _, c := range writeCases() {
		if c.workers <= 1 {
			continue
		}
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			runWriteCase(t, c)
		})
	}
}

func runWriteCase(t *testing.T, c writeCase) {
	seed := seedFor(t, c.name)
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("seed %d (rerun with OVIS_WRITE_SEED=%d go test ./qcow2 -run '%s$')", seed, seed, t.Name())
		}
	})
	e := newInteropEnv(t)
	path := e.path("img.qcow2")
	opts := c.opts
	var base []byte
	switch c.base {
	case "qcow2":
		bp := e.create("base.qcow2", "cluster_size=4096", c.baseSize, "")
		e.io(bp, e.w(0, 0, c.baseSize), "write -z 65536 65536", fmt.Sprintf("discard %d %d", c.baseSize/2, 1<<20))
		opts.BackingFile, opts.BackingFormat = "base.qcow2", "qcow2"
		base = testutil.ConvertToRaw(t, bp)
	case "raw":
		base = randBytes(seed^1, int(c.baseSize))
		writeFile(t, e.path("base.raw"), base)
		opts.BackingFile, opts.BackingFormat = "base.raw", "raw"
	}
	if opts.DataFile != "" {
		opts.DataFile = e.path(opts.DataFile)
	}
	if err := qcow2.Create(path, opts); err != nil {
		t.Fatalf("Create(%+v): %v", opts, err)
	}
	img, err := qcow2.Open(path, c.open)
	if err != nil {
		t.Fatalf("Open(%+v): %v", c.open, err)
	}
	size := img.Size()
	if want := up512(max(opts.Size, int64(len(base)))); size != want {
		t.Errorf("Size() = %d after Create with Size %d, want %d (QEMU rounds up to 512)", size, opts.Size, want)
	}
	model := make([]byte, size)
	copy(model, base)
	if base != nil && int64(len(base)) < size {
		base = append(base, make([]byte, size-int64(len(base)))...)
	}
	m := &mirror{img: img, model: model, cs: img.ClusterSize()}
	if base != nil {
		m.base = base[:size]
	}

	if c.fill {
		m.fill(t, rand.New(rand.NewPCG(seed, 1)))
	}
	if !m.runWorkers(t, seed, c.ops, max(c.workers, 1), c.compress) {
		return
	}
	raw := e.path("model.raw")
	writeFile(t, raw, model)
	rep := checkWithQemu(t, path, raw, size)
	if c.compress {
		if n, _ := rep["compressed-clusters"].(float64); n == 0 {
			t.Errorf("qemu-img check counts no compressed clusters: %v", rep)
		}
	}
	if c.growRefcountTable {
		buf, fileSize := readHeaderCluster(t, path)
		h, err := qcow2.ParseHeader(buf, fileSize)
		if err != nil {
			t.Fatal(err)
		}
		if h.RefcountTableClusters < 2 {
			t.Errorf("refcount table has %d cluster(s); the case should have made it grow", h.RefcountTableClusters)
		}
	}
}

// runWorkers applies ops random operations from each of workers
// goroutines, on disjoint byte ranges that share clusters, then closes
// the image. It reports whether all went well. One worker runs in the
// caller's goroutine: such a test starts no goroutine, and runs without
// the race detector (scripts/test.sh).
func (m *mirror) runWorkers(t *testing.T, seed uint64, ops, workers int, compress bool) bool {
	size, cs := int64(len(m.model)), m.cs
	var wg sync.WaitGroup
	for w := range workers {
		lo, hi := int64(w)*size/int64(workers), int64(w+1)*size/int64(workers)
		if w > 0 {
			lo += 777 // stripes share clusters: concurrent COW of one cluster
		}
		wk := &worker{m: m, t: t, r: rand.New(rand.NewPCG(seed, uint64(w)+2)), lo: lo, hi: hi,
			compress: compress && workers == 1, name: fmt.Sprintf("worker %d", w)}
		if wk.compress {
			wk.touched = make([]bool, (size+cs-1)/cs)
			// Keep the last quarter from the random operations, for
			// compressed clusters that stay compressed to the end.
			wk.hi = max(cs, (size-size/4)/cs*cs)
		}
		if workers == 1 {
			wk.run(ops)
			break
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			wk.run(ops)
		}()
	}
	wg.Wait()
	if t.Failed() {
		m.img.Close()
		return false
	}
	if err := m.img.Close(); err != nil {
		t.Errorf("Close: %v", err)
		return false
	}
	if err := m.img.Close(); err == nil {
		t.Errorf("second Close returned nil, want ErrClosed")
	}
	return true
}

// checkWithQemu runs qemu-img check (no errors, no leaks) and qemu-img
// compare against the raw model on a closed image, then reopens it
// read-only in ovis and compares it with the model too. It returns the
// check report.
func checkWithQemu(t *testing.T, path, raw string, size int64) map[string]any {
	t.Helper()
	rep := testutil.CheckImage(t, path)
	if out, code := testutil.QemuImgExit(t, "compare", "-f", "qcow2", "-F", "raw", path, raw); code != 0 {
		t.Errorf("qemu-img compare with the model: exit %d: %s", code, out)
	}
	ro, err := qcow2.Open(path, qcow2.Options{ReadOnly: true})
	if err != nil {
		t.Fatalf("reopen: %v", err)
	}
	defer ro.Close()
	testutil.CompareDeviceWithRaw(t, block.ReaderAt(ctx, ro), size, raw)
	return rep
}

// TestWriteInteropQemuImages writes, with ovis, images that QEMU made
// (compressed clusters, zero clusters, snapshots sharing clusters,
// extended L2, backing chains, data files, a dirty lazy-refcounts image)
// and checks the result with QEMU. Internal snapshots must keep their
// contents: shared clusters are copied, never written in place.
func TestWriteInteropQemuImages(t *testing.T) {
	t.Parallel()
	want := map[string]bool{
		"c512": true, "c4k": true, "v2-c4k": true, "rc1": true, "rc64": true,
		"size-65537": true, "lazy": true, "prealloc-metadata": true,
		"datafile": true, "datafile-raw": true,
		"convert-zlib-c4k": true, "convert-zstd-c64k": true, "convert-zlib-v2": true, "iocompress-zstd": true,
		"chain-raw-qcow2-qcow2": true, "short-backing": true, "short-raw-backing": true,
		"extl2-c64k": true, "extl2-c32k": true, "snapshots": true, "lazy-dirty": true,
	}
	for _, c := range interopCases() {
		if !want[c.name] {
			continue
		}
		delete(want, c.name)
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			seed := seedFor(t, "qemu/"+c.name)
			t.Cleanup(func() {
				if t.Failed() {
					t.Logf("seed %d (rerun with OVIS_WRITE_SEED=%d go test ./qcow2 -run 'TestWriteInteropQemuImages/%s$')", seed, seed, c.name)
				}
			})
			e := newInteropEnv(t)
			path := c.build(e)
			model := testutil.ConvertToRaw(t, path)
			snaps := snapshotContents(t, path)

			img, err := qcow2.Open(path, qcow2.Options{})
			if err != nil {
				t.Fatalf("Open: %v", err)
			}
			size := img.Size()
			if size != int64(len(model)) {
				t.Fatalf("Size() = %d, qemu-img convert gave %d bytes", size, len(model))
			}
			m := &mirror{img: img, model: model, cs: img.ClusterSize()}
			if bp := img.BackingPath(); bp != "" {
				m.base = testutil.ConvertToRaw(t, bp)
				m.base = append(m.base, make([]byte, max(0, size-int64(len(m.base))))...)[:size]
			}
			if !m.runWorkers(t, seed, 200, 1, false) {
				return
			}
			raw := e.path("model.raw")
			writeFile(t, raw, model)
			checkWithQemu(t, path, raw, size)
			for name, before := range snaps {
				if after := snapshotContent(t, path, name); !bytes.Equal(after, before) {
					t.Errorf("snapshot %s changed under ovis's writes at offset %d", name, firstDiff(after, before))
				}
			}
		})
	}
	if len(want) > 0 {
		t.Errorf("no interop cases named %v", want)
	}
}

// snapshotContents returns the guest contents of every internal snapshot
// of the image, by name.
func snapshotContents(t *testing.T, path string) map[string][]byte {
	t.Helper()
	out := map[string][]byte{}
	snaps, _ := testutil.ImageInfo(t, path)["snapshots"].([]any)
	for _, s := range snaps {
		name, _ := s.(map[string]any)["name"].(string)
		out[name] = snapshotContent(t, path, name)
	}
	return out
}

// snapshotContent reads one internal snapshot with qemu-img convert -l.
func snapshotContent(t *testing.T, path, name string) []byte {
	t.Helper()
	dst := filepath.Join(t.TempDir(), "snap.raw")
	testutil.QemuImg(t, "convert", "-l", "snapshot.name="+name, "-O", "raw", path, dst)
	b, err := os.ReadFile(dst)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// mirror is an open image and the raw model of what it must read.
type mirror struct {
	img   *qcow2.Image
	model []byte
	base  []byte // the backing file's bytes over the disk, nil without one
	cs    int64
}

// fill writes every byte of the disk, 64 KiB at a time in random order.
func (m *mirror) fill(t *testing.T, r *rand.Rand) {
	const chunk = 64 << 10
	n := (int64(len(m.model)) + chunk - 1) / chunk
	for _, i := range r.Perm(int(n)) {
		off := int64(i) * chunk
		p := randBytes(r.Uint64(), int(min(chunk, int64(len(m.model))-off)))
		if _, err := m.img.WriteAt(ctx, p, off, 0); err != nil {
			t.Fatalf("fill: WriteAt(%d bytes at %d): %v", len(p), off, err)
		}
		copy(m.model[off:], p)
	}
}

// worker applies random operations to [lo, hi) of a mirror.
type worker struct {
	m        *mirror
	t        *testing.T
	r        *rand.Rand
	lo, hi   int64
	name     string
	compress bool
	touched  []bool // clusters any operation has touched (compress only)
	log      []string
}

// fail reports an error with the recent operations; safe from goroutines.
func (w *worker) fail(format string, args ...any) {
	recent := w.log[max(0, len(w.log)-15):]
	w.t.Errorf("%s, op %d: %s\nrecent operations:\n  %s", w.name, len(w.log), fmt.Sprintf(format, args...), strings.Join(recent, "\n  "))
}

// span picks a range inside [lo, hi): cluster aligned, sector aligned,
// arbitrary, or tiny.
func (w *worker) span() (off, n int64) {
	cs, r := w.m.cs, w.r
	off = w.lo + r.Int64N(w.hi-w.lo)
	switch r.IntN(4) {
	case 0:
		off = max(w.lo, off/cs*cs)
		n = cs * (1 + r.Int64N(4))
	case 1:
		off = max(w.lo, off/512*512)
		n = 512 * (1 + r.Int64N(max(1, 3*cs/512)))
	case 2:
		n = 1 + r.Int64N(3*cs)
	default:
		n = 1 + r.Int64N(600)
	}
	return off, max(1, min(n, 1<<20, w.hi-off))
}

func (w *worker) data(n int64) []byte {
	switch w.r.IntN(6) {
	case 0:
		return make([]byte, n) // zeros written as data
	case 1:
		return textBytes(w.r, int(n))
	case 2:
		return bytes.Repeat([]byte{byte(w.r.IntN(255) + 1)}, int(n))
	default:
		return randBytes(w.r.Uint64(), int(n))
	}
}

// compressN is how many clusters a compression phase writes: fewer big
// ones, as deflate under the race detector is slow.
func (w *worker) compressN() int {
	if w.m.cs >= 1<<20 {
		return 2
	}
	return min(8, len(w.touched)/3)
}

func (w *worker) touch(off, n int64) {
	if w.touched == nil {
		return
	}
	for c := off / w.m.cs; c*w.m.cs < off+n; c++ {
		w.touched[c] = true
	}
}

func (w *worker) run(ops int) {
	img, model := w.m.img, w.m.model
	if w.compress {
		// Compress some clusters before random writes touch them all,
		// so that later operations overwrite compressed clusters.
		for range w.compressN() {
			w.writeCompressed(false)
		}
	}
	for range ops {
		p := w.r.IntN(100)
		switch {
		case p < 40:
			off, n := w.span()
			fua := w.r.IntN(5) == 0
			buf := w.data(n)
			w.log = append(w.log, fmt.Sprintf("WriteAt(%d bytes at %d, fua %v)", n, off, fua))
			if k, err := img.WriteAt(ctx, buf, off, block.FUAIf(fua)); err != nil || k != len(buf) {
				w.fail("WriteAt: %d, %v", k, err)
				return
			}
			copy(model[off:], buf)
			w.touch(off, n)
		case p < 55:
			off, n := w.span()
			unmap, fua := w.r.IntN(2) == 0, w.r.IntN(5) == 0
			w.log = append(w.log, fmt.Sprintf("WriteZeroes(%d, %d, mayUnmap %v, fua %v)", off, n, unmap, fua))
			if err := img.WriteZeroes(ctx, off, n, block.ZeroFlags(unmap, fua)); err != nil {
				w.fail("WriteZeroes: %v", err)
				return
			}
			clear(model[off : off+n])
			w.touch(off, n)
		case p < 65:
			off, n := w.span()
			w.log = append(w.log, fmt.Sprintf("Discard(%d, %d)", off, n))
			if err := img.Discard(ctx, off, n, 0); err != nil {
				w.fail("Discard: %v", err)
				return
			}
			if !w.checkDiscard(off, n) {
				return
			}
			w.touch(off, n)
		case p < 78:
			off, n := w.span()
			w.log = append(w.log, fmt.Sprintf("ReadAt(%d bytes at %d)", n, off))
			got := make([]byte, n)
			if k, err := img.ReadAt(ctx, got, off); err != nil || k != len(got) {
				w.fail("ReadAt: %d, %v", k, err)
				return
			}
			if i := firstDiff(got, model[off:off+n]); i >= 0 {
				w.fail("read back differs at offset %d: got % x, want % x", off+int64(i),
					got[i:min(i+16, len(got))], model[off+int64(i):min(off+int64(i)+16, off+n)])
				return
			}
		case p < 82:
			w.log = append(w.log, "Flush()")
			if err := img.Flush(ctx); err != nil {
				w.fail("Flush: %v", err)
				return
			}
		case w.compress:
			w.writeCompressed(false)
		default:
			off, n := w.span()
			buf := w.data(n)
			w.log = append(w.log, fmt.Sprintf("WriteAt(%d bytes at %d)", n, off))
			if k, err := img.WriteAt(ctx, buf, off, 0); err != nil || k != len(buf) {
				w.fail("WriteAt: %d, %v", k, err)
				return
			}
			copy(model[off:], buf)
		}
		if w.t.Failed() {
			return
		}
	}
	if w.compress {
		for range w.compressN() {
			w.writeCompressed(true)
		}
	}
}

// checkDiscard reads back a discarded range: each 512-byte piece must read
// as before, as zeros, or (QEMU's v2 images) as the backing file. The
// model then takes what the image reads.
func (w *worker) checkDiscard(off, n int64) bool {
	got := make([]byte, n)
	if k, err := w.m.img.ReadAt(ctx, got, off); err != nil || k != len(got) {
		w.fail("ReadAt after Discard: %d, %v", k, err)
		return false
	}
	for p := off; p < off+n; {
		end := min((p/512+1)*512, off+n)
		g, old := got[p-off:end-off], w.m.model[p:end]
		ok := bytes.Equal(g, old) || allZero(g) || w.m.base != nil && bytes.Equal(g, w.m.base[p:end])
		if !ok {
			w.fail("after Discard(%d, %d), bytes [%d,%d) read neither as before, nor zeros, nor the backing file: % x",
				off, n, p, end, g[:min(16, len(g))])
			return false
		}
		p = end
	}
	copy(w.m.model[off:], got)
	return true
}

func allZero(b []byte) bool {
	for _, c := range b {
		if c != 0 {
			return false
		}
	}
	return true
}

// writeCompressed compresses a whole cluster (or the disk's partial last
// cluster) that no operation has touched yet: QEMU, too, only compresses
// into unallocated clusters. The data is mostly text, sometimes random
// (incompressible) or zeros. Without final it picks a cluster the random
// operations may overwrite later; with final, one of the reserved last
// quarter, always with text, so that the image surely ends with
// compressed clusters.
func (w *worker) writeCompressed(final bool) {
	cs := w.m.cs
	size := int64(len(w.m.model))
	lo, hi := int64(0), (w.hi+cs-1)/cs
	if final {
		lo, hi = hi, int64(len(w.touched))
	}
	if lo >= hi {
		return
	}
	text := final
	for range 20 {
		c := lo + w.r.Int64N(hi-lo)
		if w.touched[c] {
			continue
		}
		off := c * cs
		n := min(cs, size-off)
		var buf []byte
		switch k := w.r.IntN(8); {
		case text || k > 1:
			buf = textBytes(w.r, int(n))
		case k == 0:
			buf = randBytes(w.r.Uint64(), int(n)) // incompressible
		default:
			buf = make([]byte, n)
		}
		w.log = append(w.log, fmt.Sprintf("WriteCompressed(%d bytes at %d)", n, off))
		if err := w.m.img.WriteCompressed(ctx, buf, off); err != nil {
			w.fail("WriteCompressed: %v", err)
			return
		}
		copy(w.m.model[off:], buf)
		w.touched[c] = true
		return
	}
}

// TestWriteInteropInfo creates images with ovis and with qemu-img from the
// same options and compares qemu-img info of the two (all but
// actual-size), and, as a subtest, the bytes of the two files.
func TestWriteInteropInfo(t *testing.T) {
	t.Parallel()
	const m = 1 << 20
	for _, c := range []struct {
		name    string
		ovis    qcow2.CreateOptions
		qemu    string
		size    int64
		backing bool
	}{
		{"default", qcow2.CreateOptions{}, "", 16 * m, false},
		{"c512-v2", qcow2.CreateOptions{ClusterSize: 512, Compat: "0.10"}, "cluster_size=512,compat=0.10", 3 * m, false},
		{"c4k", qcow2.CreateOptions{ClusterSize: 4096}, "cluster_size=4096", 3 * m, false},
		{"c2m", qcow2.CreateOptions{ClusterSize: 2 * m}, "cluster_size=2M", 100 * m, false},
		{"rc1-lazy", qcow2.CreateOptions{RefcountBits: 1, LazyRefcounts: true}, "refcount_bits=1,lazy_refcounts=on", 8 * m, false},
		{"rc64", qcow2.CreateOptions{RefcountBits: 64, ClusterSize: 8192}, "refcount_bits=64,cluster_size=8192", 8 * m, false},
		{"extl2-zstd", qcow2.CreateOptions{ExtendedL2: true, CompressionType: "zstd"}, "extended_l2=on,compression_type=zstd", 8 * m, false},
		{"odd-size", qcow2.CreateOptions{}, "", 65537, false},
		{"big", qcow2.CreateOptions{}, "", 1 << 40, false},
		{"backing", qcow2.CreateOptions{BackingFile: "base.qcow2", BackingFormat: "qcow2"}, "", 8 * m, true},
		{"backing-default-size", qcow2.CreateOptions{BackingFile: "base.qcow2", BackingFormat: "qcow2"}, "", 0, true},
		{"datafile", qcow2.CreateOptions{DataFile: "img.data"}, "data_file=img.data", 8 * m, false},
		{"datafile-raw", qcow2.CreateOptions{DataFile: "img.data", DataFileRaw: true}, "data_file=img.data,data_file_raw=on", 8 * m, false},
		{"prealloc-metadata", qcow2.CreateOptions{Preallocation: "metadata", ClusterSize: 4096}, "preallocation=metadata,cluster_size=4096", 4 * m, false},
		{"prealloc-full", qcow2.CreateOptions{Preallocation: "full"}, "preallocation=full", 2 * m, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			dirs := [2]string{t.TempDir(), t.TempDir()}
			var paths [2]string
			for i, dir := range dirs {
				paths[i] = filepath.Join(dir, "img.qcow2")
				if c.backing {
					testutil.QemuImg(t, "create", "-f", "qcow2", filepath.Join(dir, "base.qcow2"), "5243392") // 5M+512
				}
			}
			o := c.ovis
			o.Size = c.size
			if o.DataFile != "" {
				o.DataFile = filepath.Join(dirs[0], o.DataFile)
			}
			if err := qcow2.Create(paths[0], o); err != nil {
				t.Fatalf("Create: %v", err)
			}
			args := []string{"create", "-f", "qcow2"}
			if opts := strings.ReplaceAll(c.qemu, "data_file=img.data", "data_file="+filepath.Join(dirs[1], "img.data")); opts != "" {
				args = append(args, "-o", opts)
			}
			if c.backing {
				args = append(args, "-b", "base.qcow2", "-F", "qcow2")
			}
			args = append(args, paths[1])
			if c.size > 0 {
				args = append(args, fmt.Sprint(c.size))
			}
			testutil.QemuImg(t, args...)

			var infos [2]map[string]any
			for i, p := range paths {
				out := testutil.QemuImg(t, "info", "--output=json", p)
				out = strings.ReplaceAll(out, dirs[i], "DIR")
				if err := json.Unmarshal([]byte(out), &infos[i]); err != nil {
					t.Fatal(err)
				}
				delete(infos[i], "actual-size")
			}
			a, _ := json.MarshalIndent(infos[0], "", "  ")
			b, _ := json.MarshalIndent(infos[1], "", "  ")
			if !bytes.Equal(a, b) {
				t.Errorf("qemu-img info differs\novis:\n%s\nqemu-img create:\n%s", a, b)
			}
			testutil.CheckImage(t, paths[0])

			// QEMU lays out preallocated images its own way (the refcount
			// structures for the whole disk up front); compare the bytes
			// of the plain ones only.
			if c.ovis.DataFile == "" && c.ovis.Preallocation == "" {
				t.Run("same-bytes", func(t *testing.T) { compareFiles(t, paths[0], paths[1]) })
			}
		})
	}
}

// compareFiles reports where two fresh images differ, the shorter one
// read as zero-padded (qemu-img does not pad the L1 table's cluster).
func compareFiles(t *testing.T, ovisPath, qemuPath string) {
	a, err := os.ReadFile(ovisPath)
	if err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(qemuPath)
	if err != nil {
		t.Fatal(err)
	}
	n := max(len(a), len(b))
	a = append(a, make([]byte, n-len(a))...)
	b = append(b, make([]byte, n-len(b))...)
	if i := firstDiff(a, b); i >= 0 {
		t.Errorf("ovis's image differs from qemu-img's at byte %d (%#x): ovis % x, qemu % x",
			i, i, a[i:min(i+16, n)], b[i:min(i+16, n)])
	}
}
