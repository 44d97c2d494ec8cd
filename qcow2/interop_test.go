package qcow2_test

// Read interop: images that qemu-img and qemu-io build must read, through
// ovis, byte for byte as `qemu-img convert -O raw` reads them.

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/ovis-storage/ovis/block"
	"github.com/ovis-storage/ovis/internal/testutil"
	"github.com/ovis-storage/ovis/qcow2"
)

// interopEnv is one case's folder with the pattern files qemu-io writes
// from (`write -s FILE`). qemu-io repeats a pattern file to fill a write,
// so the prime lengths keep any misplaced read from lining up again.
type interopEnv struct {
	t    *testing.T
	dir  string
	pat  [3]string // random bytes, 65521, 40009 and 7919 long
	text string    // compressible text, 100003 bytes
}

func newInteropEnv(t *testing.T) *interopEnv {
	t.Helper()
	e := &interopEnv{t: t, dir: t.TempDir()}
	for i, n := range []int{65521, 40009, 7919} {
		e.pat[i] = e.path(fmt.Sprintf("pat%d", i))
		writeFile(t, e.pat[i], randBytes(uint64(i+1), n))
	}
	e.text = e.path("text")
	writeFile(t, e.text, textBytes(rand.New(rand.NewPCG(9, 9)), 100003))
	return e
}

func (e *interopEnv) path(name string) string { return filepath.Join(e.dir, name) }

// create makes a qcow2 image with qemu-img create -o opts; backing, if
// given, is "name:format".
func (e *interopEnv) create(name, opts string, size int64, backing string) string {
	e.t.Helper()
	p := e.path(name)
	args := []string{"create", "-f", "qcow2"}
	if opts != "" {
		args = append(args, "-o", opts)
	}
	if backing != "" {
		file, format, _ := strings.Cut(backing, ":")
		args = append(args, "-b", file, "-F", format)
	}
	args = append(args, p)
	if size > 0 {
		args = append(args, fmt.Sprint(size))
	}
	testutil.QemuImg(e.t, args...)
	return p
}

// io runs qemu-io commands on a qcow2 image.
func (e *interopEnv) io(path string, cmds ...string) {
	e.t.Helper()
	testutil.QemuIO(e.t, path, "qcow2", cmds...)
}

// w formats a qemu-io write of pattern file i.
func (e *interopEnv) w(i int, off, n int64) string {
	return fmt.Sprintf("write -s %s %d %d", e.pat[i], off, n)
}

// stdOps is the standard mix of qemu-io commands for an image of the given
// virtual size, cluster size and L2 coverage: writes, zero writes (with
// and without unmap) and discards at odd offsets and lengths, inside one
// cluster, across clusters and across L2 tables, and at the end of the
// disk. Commands that would not fit are left out or shortened.
func (e *interopEnv) stdOps(cs, size, l2cov int64) []string {
	var cmds []string
	add := func(cmd string, off, n int64) {
		if off < 0 || off >= size {
			return
		}
		if n = min(n, size-off); n > 0 {
			cmds = append(cmds, fmt.Sprintf("%s %d %d", cmd, off, n))
		}
	}
	pat := func(i int) string { return "write -s " + e.pat[i] }
	add(pat(0), 1000, 3333)
	add("write -P 0x5a", cs-700, cs+1400)
	add(pat(1), 3*cs+17, cs/2+1)
	add("write -z", cs+100, 300)
	add("write -z", 5*cs, 2*cs)
	add(pat(2), 5*cs+cs/2, 1000)
	add(pat(0), 8*cs, 3*cs)
	add("discard", 8*cs, 2*cs)
	add("discard", cs/2, cs)
	add(pat(1), 12*cs, 2*cs)
	add("write -z -u", 12*cs, cs)
	add("write -z", 13*cs, cs)
	add(pat(2), 16*cs-1, 2)
	add(pat(0), l2cov-5000, 10000)
	add("write -z", l2cov-cs, 2*cs)
	add(pat(1), l2cov+3*cs-7, 77)
	add(pat(1), size/2+333, 4097)
	add("write -P 0x3c", size-777, 777)
	add(pat(2), size-3*cs-5, 2*cs)
	return cmds
}

// l2Coverage is how many guest bytes one L2 table maps.
func l2Coverage(cs int64, extended bool) int64 {
	if extended {
		return cs * cs / 16
	}
	return cs * cs / 8
}

func writeFile(t *testing.T, path string, b []byte) {
	t.Helper()
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
}

func randBytes(seed uint64, n int) []byte {
	r := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
	b := make([]byte, n)
	for i := 0; i < n; i += 8 {
		v := r.Uint64()
		for j := 0; j < 8 && i+j < n; j++ {
			b[i+j] = byte(v >> (8 * j))
		}
	}
	return b
}

var words = strings.Fields("qcow2 cluster refcount table block device backing chain snapshot " +
	"extent zero data hole sector offset guest host ovis qemu image layer")

// textBytes is compressible text with enough variety not to be trivial.
func textBytes(r *rand.Rand, n int) []byte {
	// Appends in place of fmt.Fprintf(&b, "%s %d ", …), into one
	// allocation: the same bytes, at a fraction of the cost under -race.
	b := make([]byte, 0, n+32)
	for len(b) < n {
		b = append(b, words[r.IntN(len(words))]...)
		b = append(b, ' ')
		b = strconv.AppendInt(b, int64(r.IntN(1000)), 10)
		b = append(b, ' ')
		if r.IntN(12) == 0 {
			b = append(b, '\n')
		}
	}
	return b[:n]
}

// mixedBytes fills n bytes with runs of text, random bytes, zeros and a
// repeated byte, each run up to three clusters long, so that a compressed
// image gets compressed, uncompressed and zero clusters.
func mixedBytes(seed uint64, n int, cs int) []byte {
	r := rand.New(rand.NewPCG(seed, 77))
	b := make([]byte, 0, n)
	for len(b) < n {
		run := min(n-len(b), 1+r.IntN(3*cs))
		switch k := r.IntN(10); {
		case k < 6:
			b = append(b, textBytes(r, run)...)
		case k < 7:
			b = append(b, randBytes(r.Uint64(), run)...)
		case k < 9:
			b = append(b, make([]byte, run)...)
		default:
			b = append(b, bytes.Repeat([]byte{byte(r.IntN(256))}, run)...)
		}
	}
	return b
}

// interopCase builds one image with QEMU's tools and returns its path.
type interopCase struct {
	name  string
	build func(e *interopEnv) string
}

func up512(n int64) int64 { return (n + 511) &^ 511 }

// stdCase: an image made by qemu-img create -o opts and the standard
// operations.
func stdCase(name, opts string, cs, size int64) interopCase {
	return interopCase{name, func(e *interopEnv) string {
		p := e.create("img.qcow2", opts, size, "")
		e.io(p, e.stdOps(cs, up512(size), l2Coverage(cs, false))...)
		return p
	}}
}

// convertCase: qemu-img convert -c of a raw file of mixed content, then
// writes that copy, zero and discard compressed clusters.
func convertCase(name, opts string, cs, size int64) interopCase {
	return interopCase{name, func(e *interopEnv) string {
		src := e.path("src.raw")
		writeFile(e.t, src, mixedBytes(uint64(cs), int(size), int(cs)))
		p := e.path("img.qcow2")
		args := []string{"convert", "-c", "-f", "raw", "-O", "qcow2"}
		if opts != "" {
			args = append(args, "-o", opts)
		}
		testutil.QemuImg(e.t, append(args, src, p)...)
		e.io(p,
			e.w(1, cs+100, 1000), // COW from a compressed cluster
			e.w(2, 2*cs-10, 20),  // across two clusters
			fmt.Sprintf("write -z %d %d", 3*cs, cs),
			fmt.Sprintf("write -z %d %d", 4*cs+512, 1024),
			fmt.Sprintf("discard %d %d", 5*cs, 2*cs),
			// QEMU compresses only into clusters without a host
			// offset; the discard above left one.
			fmt.Sprintf("write -c -s %s %d %d", e.text, 6*cs, cs),
		)
		return p
	}}
}

func interopCases() []interopCase {
	const k, m, g = 1 << 10, 1 << 20, 1 << 30
	return []interopCase{
		stdCase("c512", "cluster_size=512", 512, 1*m),
		stdCase("c4k", "cluster_size=4096", 4*k, 5*m),
		stdCase("c64k", "", 64*k, 600*m),
		stdCase("c2m", "cluster_size=2M", 2*m, 512*g+5*m),
		stdCase("v2-c64k", "compat=0.10", 64*k, 8*m),
		stdCase("v2-c4k", "compat=0.10,cluster_size=4096", 4*k, 5*m),
		stdCase("rc1", "refcount_bits=1,cluster_size=4096", 4*k, 5*m),
		stdCase("rc8", "refcount_bits=8,cluster_size=4096", 4*k, 5*m),
		stdCase("rc64", "refcount_bits=64,cluster_size=4096", 4*k, 5*m),
		stdCase("size-65537", "", 64*k, 65537),
		stdCase("size-65537-c512", "cluster_size=512", 512, 65537),
		stdCase("size-10M+512", "cluster_size=4096", 4*k, 10*m+512),
		stdCase("size-1G+1234567", "", 64*k, 1*g+1234567),
		stdCase("lazy", "lazy_refcounts=on,cluster_size=4096", 4*k, 5*m),
		stdCase("prealloc-metadata", "preallocation=metadata,cluster_size=4096", 4*k, 5*m),
		stdCase("prealloc-falloc", "preallocation=falloc", 64*k, 4*m),
		stdCase("prealloc-full", "preallocation=full,cluster_size=4096", 4*k, 3*m),
		{"datafile", func(e *interopEnv) string {
			p := e.create("img.qcow2", "cluster_size=4096,data_file="+e.path("img.data"), 5*m, "")
			e.io(p, e.stdOps(4*k, 5*m, l2Coverage(4*k, false))...)
			return p
		}},
		{"datafile-raw", func(e *interopEnv) string {
			p := e.create("img.qcow2", "data_file="+e.path("img.data")+",data_file_raw=on", 3*m, "")
			e.io(p, e.stdOps(64*k, 3*m, l2Coverage(64*k, false))...)
			return p
		}},
		convertCase("convert-zlib-c512", "cluster_size=512", 512, 300*k+512),
		convertCase("convert-zlib-c4k", "cluster_size=4096", 4*k, 2*m+1536),
		convertCase("convert-zlib-c64k", "", 64*k, 6*m+1536),
		convertCase("convert-zlib-c2m", "cluster_size=2M", 2*m, 16*m+1536), // convertCase writes to cluster 7
		convertCase("convert-zstd-c512", "cluster_size=512,compression_type=zstd", 512, 300*k+512),
		convertCase("convert-zstd-c64k", "compression_type=zstd", 64*k, 6*m+1536),
		convertCase("convert-zstd-c2m", "cluster_size=2M,compression_type=zstd", 2*m, 16*m+1536), // convertCase writes to cluster 7
		convertCase("convert-zlib-v2", "compat=0.10", 64*k, 3*m+512),
		{"iocompress-zstd", func(e *interopEnv) string {
			const cs = 64 * k
			p := e.create("img.qcow2", "compression_type=zstd", 2*m+512, "")
			e.io(p,
				fmt.Sprintf("write -c -s %s 0 %d", e.text, 4*cs),
				fmt.Sprintf("write -c -P 0x61 %d %d", 5*cs, cs),
				fmt.Sprintf("write -c -s %s %d %d", e.pat[0], 6*cs, cs), // incompressible
				fmt.Sprintf("write -c -s %s %d 512", e.text, 2*m),       // the partial last cluster
				e.w(1, 2*cs+4321, 1234),
			)
			return p
		}},
		{"iocompress-zlib-c4k", func(e *interopEnv) string {
			const cs = 4 * k
			p := e.create("img.qcow2", "cluster_size=4096", 3*m, "")
			e.io(p,
				fmt.Sprintf("write -c -s %s 0 %d", e.text, 64*cs),
				fmt.Sprintf("write -c -s %s %d %d", e.text, 2*m-4*cs, 8*cs), // across an L2 table
				e.w(2, 10*cs-100, 200),
				fmt.Sprintf("discard %d %d", 20*cs, 3*cs),
			)
			return p
		}},
		{"chain-raw-qcow2-qcow2", func(e *interopEnv) string {
			writeFile(e.t, e.path("base.raw"), randBytes(42, 4*m))
			mid := e.create("mid.qcow2", "cluster_size=4096", 4*m, "base.raw:raw")
			e.io(mid, e.w(0, 100000, 200000), "write -z 1048576 65536", e.w(1, 3*m-5, 10))
			top := e.create("top.qcow2", "", 6*m, "mid.qcow2:qcow2")
			e.io(top,
				"write -z 50000 3000",       // within a cluster: COW from the layers below
				"write -z 2097152 131072",   // whole clusters masking base data
				"write -z -u 3145728 65536", // with unmap: must still mask the base
				"write -z 150000 70000",     // masking mid's data
				e.w(2, 4*m-1000, 3000),      // across the end of the backing chain
				"discard 2621440 65536",     // discard over backing data
				"discard 5242880 65536",     // discard past the backing's end
				e.w(0, 5*m+17, 1000),
			)
			return top
		}},
		{"short-backing", func(e *interopEnv) string {
			base := e.create("base.qcow2", "cluster_size=4096", 1*m+512, "")
			e.io(base, e.w(0, 0, 1*m+512))
			top := e.create("top.qcow2", "", 4*m, "base.qcow2:qcow2")
			e.io(top, e.w(1, 1*m-100, 1000), "write -z 1000 100", e.w(2, 3*m, 100))
			return top
		}},
		{"short-raw-backing", func(e *interopEnv) string {
			writeFile(e.t, e.path("base.raw"), randBytes(43, 700*k+512))
			top := e.create("top.qcow2", "cluster_size=4096", 2*m, "base.raw:raw")
			e.io(top, e.w(1, 700*k-100, 1000), e.w(2, 1*m, 100))
			return top
		}},
		extL2Case("extl2-c64k", 64*k),
		extL2Case("extl2-c32k", 32*k),
		{"extl2-nobacking", func(e *interopEnv) string {
			p := e.create("img.qcow2", "extended_l2=on", 3*m, "")
			e.io(p, e.stdOps(64*k, 3*m, l2Coverage(64*k, true))...)
			return p
		}},
		{"snapshots", func(e *interopEnv) string {
			const cs = 4 * k
			p := e.create("img.qcow2", "cluster_size=4096", 4*m, "")
			e.io(p, e.stdOps(cs, 4*m, l2Coverage(cs, false))...)
			testutil.QemuImg(e.t, "snapshot", "-c", "s1", p)
			e.io(p, e.w(2, 0, 64*k), "write -z 8192 8192", "discard 20480 12288", e.w(1, 2*m-50, 100))
			testutil.QemuImg(e.t, "snapshot", "-c", "s2", p)
			e.io(p, "write -P 0x99 4096 4096", "write -z -u 65536 65536")
			testutil.QemuImg(e.t, "snapshot", "-d", "s1", p)
			e.io(p, e.w(0, 300*k+1, 5000))
			return p
		}},
		{"lazy-dirty", func(e *interopEnv) string {
			p := e.create("img.qcow2", "lazy_refcounts=on,cluster_size=4096", 4*m, "")
			out, code := testutil.QemuIOExit(e.t, p, "qcow2",
				e.w(0, 1000, 300000), "flush", e.w(1, 2*m, 100000), "flush", "sigraise 9")
			if code == 0 {
				e.t.Fatalf("qemu-io survived sigraise 9: %s", out)
			}
			if info := testutil.ImageInfo(e.t, p); info["dirty-flag"] != true {
				e.t.Fatalf("image not left dirty: %v", info)
			}
			return p
		}},
		{"sparse-1t", func(e *interopEnv) string {
			const tb = 1 << 40
			p := e.create("img.qcow2", "", tb, "")
			e.io(p,
				e.w(0, 0, 3*m-5),
				e.w(1, 300*g+12345, 2*m),
				"write -P 0x42 751619280897 196608", // 700 GiB + 4097
				"write -z 751619342336 65536",
				e.w(2, tb-1*m-3, 1*m+3),
			)
			return p
		}},
	}
}

// extL2Case: an extended-L2 overlay over a raw base, written at subcluster
// granularity.
func extL2Case(name string, cs int64) interopCase {
	return interopCase{name, func(e *interopEnv) string {
		const m = 1 << 20
		sc := cs / 32
		writeFile(e.t, e.path("base.raw"), randBytes(44, 3*m))
		p := e.create("img.qcow2", fmt.Sprintf("extended_l2=on,cluster_size=%d", cs), 4*m, "base.raw:raw")
		e.io(p,
			e.w(0, 2*sc, sc),      // one whole subcluster
			e.w(1, 3*sc+77, 1000), // inside a subcluster: COW from the base
			fmt.Sprintf("write -z %d %d", 8*sc, sc),
			fmt.Sprintf("write -z -u %d %d", 10*sc, 3*sc),
			fmt.Sprintf("discard %d %d", cs+2*sc, 2*sc),
			e.w(2, 2*cs-3000, 6000), // across clusters, partial subclusters
			fmt.Sprintf("write -z %d %d", 3*cs, cs),
			e.w(0, 3*cs+5000, 100),                       // into a zeroed cluster
			e.w(1, 5*cs+31*sc, sc+1),                     // last subcluster and one byte more
			fmt.Sprintf("write -z %d %d", 6*cs+sc/2, sc), // zero across a subcluster edge
		)
		e.io(p, e.stdOps(cs, 4*m, l2Coverage(cs, true))...)
		return p
	}}
}

// TestInteropQemuImages opens every image QEMU builds and compares it with
// qemu-img convert's raw output, byte for byte; its Size with qemu-img
// info; and, as a secondary check, its Extent walk with qemu-img map.
func TestInteropQemuImages(t *testing.T) {
	t.Parallel()
	for _, c := range interopCases() {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			e := newInteropEnv(t)
			path := c.build(e)
			verifyWithQemu(t, path)
			t.Run("extents", func(t *testing.T) { compareExtents(t, path) })
		})
	}
}

// verifyWithQemu compares the image at path, opened read-only by ovis,
// with QEMU's reading of it: the size, every byte (sampling the holes of
// huge disks), and random unaligned reads from four goroutines through an
// L2 cache of two 512-byte slices.
func verifyWithQemu(t *testing.T, path string) {
	t.Helper()
	size := testutil.VirtualSize(t, path)
	raw := testutil.ConvertToRawFile(t, path)

	img, err := qcow2.Open(path, qcow2.Options{ReadOnly: true})
	if err != nil {
		t.Fatalf("Open(%s): %v", path, err)
	}
	if got := img.Size(); got != size {
		t.Errorf("Size() = %d, qemu-img info says %d", got, size)
	}
	testutil.CompareDeviceWithRaw(t, block.ReaderAt(ctx, img), size, raw)
	if _, err := img.ReadAt(ctx, make([]byte, 2), size-1); !errors.Is(err, block.ErrOutOfRange) {
		t.Errorf("ReadAt across the end: %v, want ErrOutOfRange", err)
	}
	if err := img.Close(); err != nil {
		t.Errorf("Close: %v", err)
	}

	cs := img.ClusterSize()
	small, err := qcow2.Open(path, qcow2.Options{ReadOnly: true, L2CacheSize: 1024, L2CacheEntrySize: 512})
	if err != nil {
		t.Fatalf("Open(%s) with an L2 cache of two 512-byte slices: %v", path, err)
	}
	defer small.Close()
	// Every read of a compressed 2 MiB cluster inflates all of it: fewer
	// reads for big clusters keep the race detector's run short.
	randomReads(t, block.ReaderAt(ctx, small), raw, size, cs, 4, int(max(12, min(100, 100*65536/cs))))
}

// randomReads compares reads of random offsets and lengths (up to three
// clusters, at most 1 MiB) from workers goroutines with the raw file.
func randomReads(t *testing.T, dev io.ReaderAt, rawPath string, size, cs int64, workers, n int) {
	t.Helper()
	raw, err := os.Open(rawPath)
	if err != nil {
		t.Fatal(err)
	}
	defer raw.Close()
	var wg sync.WaitGroup
	var once sync.Once
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := rand.New(rand.NewPCG(uint64(w), uint64(size)))
			// Buffers of the largest length, reused and cleared for
			// each read (under -race every large allocation costs a
			// shadow reset, and these were gigabytes).
			maxLn := min(3*cs, 1<<20, size)
			gotBuf, wantBuf := make([]byte, maxLn), make([]byte, maxLn)
			for range n {
				ln := 1 + r.Int64N(maxLn)
				off := r.Int64N(size - ln + 1)
				if r.IntN(4) == 0 { // start at a cluster boundary, give or take
					off = min(off/cs*cs+r.Int64N(3)-1, size-ln)
					off = max(off, 0)
				}
				got, want := gotBuf[:ln], wantBuf[:ln]
				clear(got)
				k, err := raw.ReadAt(want, off)
				if err != nil && err != io.EOF {
					t.Errorf("read raw: %v", err)
					return
				}
				clear(want[k:])
				if _, err := dev.ReadAt(got, off); err != nil {
					once.Do(func() { t.Errorf("ReadAt(%d bytes at %d): %v", ln, off, err) })
					return
				}
				if i := firstDiff(got, want); i >= 0 {
					once.Do(func() {
						t.Errorf("ReadAt(%d bytes at %d) differs from qemu at offset %d: got % x, want % x",
							ln, off, off+int64(i), got[i:min(i+16, len(got))], want[i:min(i+16, len(want))])
					})
					return
				}
			}
		}()
	}
	wg.Wait()
}

// extSeg is a run of equal allocation status, as qemu-img map or Extent
// reports it.
type extSeg struct {
	start, end int64
	hole, zero bool
	depth      int // 1 for the image itself; 0 for a hole
	// either: QEMU calls it data and zero at once (a preallocated cluster
	// over a hole of the host file); ovis may say data or zero.
	either bool
}

func (s extSeg) String() string {
	return fmt.Sprintf("[%d,%d) hole=%v zero=%v depth=%d", s.start, s.end, s.hole, s.zero, s.depth)
}

// compareExtents walks Extent over the whole image and compares it with
// `qemu-img map --output=json` the way qemu-nbd maps one to the other:
// StatusHole with !data, StatusZero with zero, and Depth with depth+1
// where present (0 where not).
func compareExtents(t *testing.T, path string) {
	var want []extSeg
	for _, m := range testutil.Map(t, path) {
		// NBD's base:allocation, as qemu-nbd derives it: a hole is
		// what holds no data (unallocated or a zero cluster), and
		// qemu:allocation-depth counts from 1 where a layer has the
		// range (present), 0 where none has.
		s := extSeg{start: m.Start, end: m.Start + m.Length, zero: m.Zero, hole: !m.Data}
		if m.Present == nil || *m.Present {
			s.depth = m.Depth + 1
		}
		s.either = m.Data && m.Zero
		want = append(want, s)
	}

	img, err := qcow2.Open(path, qcow2.Options{ReadOnly: true})
	if err != nil {
		t.Fatalf("Open: %v", err)
	}
	defer img.Close()
	size := img.Size()
	var got []extSeg
	for off := int64(0); off < size; {
		x, err := block.FirstExtent(ctx, img, off, size-off)
		if err != nil {
			t.Fatalf("Extent(%d, %d): %v", off, size-off, err)
		}
		if x.Length <= 0 || x.Length > size-off {
			t.Fatalf("Extent(%d, %d) has length %d", off, size-off, x.Length)
		}
		got = append(got, extSeg{start: off, end: off + x.Length,
			hole: x.Status&block.StatusHole != 0, zero: x.Status&block.StatusZero != 0, depth: x.Depth})
		off += x.Length
		if len(got) > 200000 {
			t.Fatalf("Extent returned more than 200000 runs by offset %d (latest %+v): it does not merge runs", off, x)
		}
	}

	// Walk both lists together and report the differing ranges.
	var bad []string
	for i, j := 0, 0; i < len(want) && j < len(got); {
		w, g := want[i], got[j]
		lo, hi := max(w.start, g.start), min(w.end, g.end)
		ok := w.depth == g.depth && (w.hole == g.hole && w.zero == g.zero ||
			w.either && (!g.hole || g.zero))
		if !ok && hi > lo {
			msg := fmt.Sprintf("[%d,%d): qemu %v, ovis %v", lo, hi, w, g)
			if len(bad) < 8 {
				bad = append(bad, msg)
			}
		}
		if w.end <= g.end {
			i++
		}
		if g.end <= w.end {
			j++
		}
	}
	if len(bad) > 0 {
		t.Errorf("Extent differs from qemu-img map:\n%s", strings.Join(bad, "\n"))
	}
}

// TestInteropBackingLoop: a chain that leads back to itself fails Open
// with an error that says so, instead of recursing.
func TestInteropBackingLoop(t *testing.T) {
	t.Parallel()
	e := newInteropEnv(t)
	a := e.create("a.qcow2", "", 1<<20, "")
	b := e.create("b.qcow2", "", 1<<20, "a.qcow2:qcow2")
	testutil.QemuImg(t, "rebase", "-u", "-b", "b.qcow2", "-F", "qcow2", a)
	self := e.create("self.qcow2", "", 1<<20, "")
	testutil.QemuImg(t, "rebase", "-u", "-b", "self.qcow2", "-F", "qcow2", self)
	for _, p := range []string{a, b, self} {
		for _, ro := range []bool{true, false} {
			img, err := qcow2.Open(p, qcow2.Options{ReadOnly: ro})
			if err == nil {
				img.Close()
				t.Errorf("Open(%s, ReadOnly %v) of a backing loop succeeded", filepath.Base(p), ro)
				continue
			}
			if !strings.Contains(strings.ToLower(err.Error()), "loop") {
				t.Errorf("Open(%s, ReadOnly %v): error %q does not mention the loop", filepath.Base(p), ro, err)
			}
		}
	}
}

// TestInteropRelativeBacking: a relative backing name resolves against the
// folder of the image that names it, not against the working directory.
// A decoy at the cwd-relative place holds other data. Not parallel: it
// changes the working directory.
func TestInteropRelativeBacking(t *testing.T) {
	e := newInteropEnv(t)
	for _, d := range []string{"img", "base", "x/y", "x/base"} {
		if err := os.MkdirAll(e.path(d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	base := e.create("base/base.qcow2", "", 2<<20, "")
	e.io(base, e.w(0, 0, 2<<20))
	decoy := e.create("x/base/base.qcow2", "", 2<<20, "")
	e.io(decoy, e.w(1, 0, 2<<20))
	top := e.create("img/top.qcow2", "", 2<<20, "../base/base.qcow2:qcow2")
	e.io(top, e.w(2, 4096, 4096))
	raw := testutil.ConvertToRawFile(t, top)

	t.Chdir(e.path("x/y"))
	img, err := qcow2.Open("../../img/top.qcow2", qcow2.Options{ReadOnly: true})
	if err != nil {
		t.Fatalf("Open: %v", err)
	}
	defer img.Close()
	gotAbs, _ := filepath.Abs(img.BackingPath())
	if gotAbs != base {
		t.Errorf("BackingPath() = %q (%s), want %s", img.BackingPath(), gotAbs, base)
	}
	testutil.CompareDeviceWithRaw(t, block.ReaderAt(ctx, img), 2<<20, raw)
}
