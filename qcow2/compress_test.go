package qcow2

import (
	"bytes"
	stdflate "compress/flate"
	"encoding/binary"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"sync"
	"testing"

	"github.com/klauspost/compress/zstd"
)

var compressionTypes = []struct {
	name string
	typ  uint8
}{
	{"deflate", CompressionDeflate},
	{"zstd", CompressionZstd},
}

// clusterData returns n deterministic bytes of the given kind:
//
//	zero    all zeroes
//	repeat  a short pattern over and over
//	text    random words from a small vocabulary: random, but compressible
//	random  incompressible
func clusterData(kind string, n int, seed uint64) []byte {
	r := rand.New(rand.NewPCG(seed, uint64(n)))
	b := make([]byte, n)
	switch kind {
	case "zero":
	case "repeat":
		pat := []byte("ovis-qcow2-")
		for i := range b {
			b[i] = pat[i%len(pat)]
		}
	case "text":
		words := make([][]byte, 200)
		for i := range words {
			w := make([]byte, 2+r.IntN(8))
			for j := range w {
				w[j] = 'a' + byte(r.IntN(16))
			}
			words[i] = w
		}
		for i := 0; i < n; {
			i += copy(b[i:], words[r.IntN(len(words))])
			if i < n {
				b[i] = ' '
				i++
			}
		}
	case "random":
		for i := range b {
			b[i] = byte(r.Uint32())
		}
	default:
		panic("unknown test data kind " + kind)
	}
	return b
}

func mustCompress(t testing.TB, typ uint8, src []byte) []byte {
	t.Helper()
	out, ok, err := compressCluster(typ, src)
	if err != nil || !ok {
		t.Fatalf("compressCluster(%d, %d bytes) = ok %v, err %v; want compressed", typ, len(src), ok, err)
	}
	return out
}

func TestCompressRoundTrip(t *testing.T) {
	for _, ct := range compressionTypes {
		for _, bits := range []int{MinClusterBits, 10, 12, 16, 20, MaxClusterBits} {
			n := 1 << bits
			for _, kind := range []string{"zero", "repeat", "text", "random"} {
				t.Run(fmt.Sprintf("%s/%d/%s", ct.name, n, kind), func(t *testing.T) {
					src := clusterData(kind, n, 1)
					out, ok, err := compressCluster(ct.typ, src)
					if err != nil {
						t.Fatal(err)
					}
					if kind == "random" {
						if ok || out != nil {
							t.Fatalf("random data compressed to %d of %d bytes, ok %v; want ok false", len(out), n, ok)
						}
						return
					}
					if !ok {
						t.Fatalf("%s data did not compress", kind)
					}
					if len(out) >= n {
						t.Fatalf("ok with %d compressed bytes for a %d-byte cluster", len(out), n)
					}
					dst := make([]byte, n)
					for i := range dst {
						dst[i] = 0xa5 // make sure every byte is written
					}
					if err := decompressCluster(ct.typ, out, dst); err != nil {
						t.Fatal(err)
					}
					if !bytes.Equal(dst, src) {
						t.Fatal("round trip changed the data")
					}
				})
			}
		}
	}
}

// TestDeflateWindow proves the 4 KiB window that QEMU uses: data whose only
// redundancy lies 8 KiB back does not compress, data that repeats every
// 2 KiB does. The result also decodes with the standard library's inflater,
// an implementation independent of the one that wrote it.
func TestDeflateWindow(t *testing.T) {
	tests := []struct {
		period int
		want   bool
	}{
		{2 << 10, true},
		{4<<10 - 64, true},
		{8 << 10, false},
		{16 << 10, false},
	}
	const n = 64 << 10
	for _, tt := range tests {
		t.Run(fmt.Sprint(tt.period), func(t *testing.T) {
			block := clusterData("random", tt.period, 7)
			src := bytes.Repeat(block, n/tt.period+1)[:n]
			out, ok, err := compressCluster(CompressionDeflate, src)
			if err != nil {
				t.Fatal(err)
			}
			if ok != tt.want {
				t.Fatalf("period %d: ok = %v (%d bytes), want %v", tt.period, ok, len(out), tt.want)
			}
			if !ok {
				return
			}
			got, err := io.ReadAll(stdflate.NewReader(bytes.NewReader(out)))
			if err != nil {
				t.Fatalf("compress/flate: %v", err)
			}
			if !bytes.Equal(got, src) {
				t.Fatal("compress/flate decoded different data")
			}
		})
	}
}

// zstdFrame encodes src as a single zstd frame with the library defaults
// and opts, independent of the pooled encoder.
func zstdFrame(t testing.TB, src []byte, opts ...zstd.EOption) []byte {
	t.Helper()
	e, err := zstd.NewWriter(nil, append([]zstd.EOption{zstd.WithEncoderConcurrency(1)}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	return e.EncodeAll(src, nil)
}

func TestDecompressTrailingBytes(t *testing.T) {
	const n = 64 << 10
	src := clusterData("text", n, 2)
	next := clusterData("text", n, 3)
	garbage := clusterData("random", 1000, 4)
	deflated := mustCompress(t, CompressionDeflate, src)
	zstded := mustCompress(t, CompressionZstd, src)
	half1, half2 := zstdFrame(t, src[:n/2]), zstdFrame(t, src[n/2:])
	// Streams holding more than one cluster: decoding stops at the
	// cluster boundary, inside the stream. The zstd frame declares a window
	// of one cluster, as a streaming writer would.
	both := append(bytes.Clone(src), next...)
	long := zstdFrame(t, both, zstd.WithWindowSize(n), zstd.WithSingleSegment(false))
	longDeflate := mustCompress(t, CompressionDeflate, both)

	cat := func(parts ...[]byte) []byte { return bytes.Join(parts, nil) }
	toSector := func(b []byte) []byte { return append(b, make([]byte, 512-len(b)%512)...) }
	tests := []struct {
		name string
		typ  uint8
		in   []byte
	}{
		{"deflate/exact", CompressionDeflate, deflated},
		{"deflate/sector padding", CompressionDeflate, toSector(cat(deflated))},
		{"deflate/garbage", CompressionDeflate, cat(deflated, garbage)},
		{"deflate/next cluster", CompressionDeflate, cat(deflated, mustCompress(t, CompressionDeflate, next))},
		{"deflate/uncompressed tail", CompressionDeflate, cat(deflated, next)},
		{"deflate/stream longer than cluster", CompressionDeflate, longDeflate},
		{"deflate/stream longer than cluster, cut", CompressionDeflate, longDeflate[:len(longDeflate)*2/3]},
		{"zstd/exact", CompressionZstd, zstded},
		{"zstd/sector padding", CompressionZstd, toSector(cat(zstded))},
		{"zstd/garbage", CompressionZstd, cat(zstded, garbage)},
		{"zstd/next cluster", CompressionZstd, cat(zstded, mustCompress(t, CompressionZstd, next))},
		{"zstd/two frames", CompressionZstd, cat(half1, half2)},
		{"zstd/two frames and garbage", CompressionZstd, cat(half1, half2, garbage)},
		{"zstd/frame longer than cluster", CompressionZstd, long},
		{"zstd/frame longer than cluster, cut", CompressionZstd, long[:len(long)*2/3]},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dst := make([]byte, n)
			if err := decompressCluster(tt.typ, tt.in, dst); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(dst, src) {
				t.Fatal("decompressed data differs")
			}
		})
	}
}

// zstdHeader returns a zstd frame header followed by one compressed block
// header, declaring a window of 1<<windowLog bytes and no content size.
func zstdHeader(windowLog uint8) []byte {
	b := []byte{0x28, 0xb5, 0x2f, 0xfd, 0x00, (windowLog - 10) << 3}
	// Block header, 3 bytes little endian: last, compressed, 100 bytes.
	const bh = 100<<3 | 2<<1 | 1
	return append(b, bh&0xff, bh>>8&0xff, bh>>16)
}

func TestDecompressErrors(t *testing.T) {
	const n = 64 << 10
	src := clusterData("text", n, 5)
	deflated := mustCompress(t, CompressionDeflate, src)
	zstded := mustCompress(t, CompressionZstd, src)

	// A frame that declares 256 KiB of content in a single segment: a
	// window four times the cluster.
	big := zstdFrame(t, clusterData("text", 256<<10, 6))

	tests := []struct {
		name    string
		typ     uint8
		in      []byte
		dstLen  int
		corrupt bool
	}{
		{"deflate/empty", CompressionDeflate, nil, n, true},
		{"deflate/truncated to 1 byte", CompressionDeflate, deflated[:1], n, true},
		{"deflate/truncated by half", CompressionDeflate, deflated[:len(deflated)/2], n, true},
		{"deflate/truncated by 16 bytes", CompressionDeflate, deflated[:len(deflated)-16], n, true},
		{"deflate/short stream", CompressionDeflate, mustCompress(t, CompressionDeflate, src[:n/2]), n, true},
		{"deflate/garbage", CompressionDeflate, clusterData("random", 4096, 8), n, true},
		{"deflate/reserved block type", CompressionDeflate, []byte{0x07, 0, 0, 0}, n, true},
		{"zstd/empty", CompressionZstd, nil, n, true},
		{"zstd/truncated to magic", CompressionZstd, zstded[:4], n, true},
		{"zstd/truncated by half", CompressionZstd, zstded[:len(zstded)/2], n, true},
		{"zstd/truncated by 1 byte", CompressionZstd, zstded[:len(zstded)-1], n, true},
		{"zstd/short frame", CompressionZstd, zstdFrame(t, src[:n/2]), n, true},
		{"zstd/short frame and garbage", CompressionZstd, append(zstdFrame(t, src[:n/2]), 1, 2, 3, 4, 5, 6, 7, 8), n, true},
		{"zstd/garbage", CompressionZstd, clusterData("random", 4096, 9), n, true},
		{"zstd/checksum mismatch", CompressionZstd, flipLast(zstded), n, true},
		{"zstd/window 1 GiB", CompressionZstd, zstdHeader(30), n, true},
		{"zstd/window 4x cluster", CompressionZstd, zstdHeader(18), n, true},
		{"zstd/content 4x cluster", CompressionZstd, big, n, true},
		{"unknown type", 2, deflated, n, false},
		{"empty destination", CompressionDeflate, deflated, 0, false},
		{"destination over 2 MiB", CompressionDeflate, deflated, 2<<20 + 512, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := decompressCluster(tt.typ, tt.in, make([]byte, tt.dstLen))
			if err == nil {
				t.Fatal("no error")
			}
			if IsCorrupt(err) != tt.corrupt {
				t.Fatalf("IsCorrupt(%v) = %v, want %v", err, !tt.corrupt, tt.corrupt)
			}
			if tt.corrupt && !bytes.Contains([]byte(err.Error()), []byte("compressed cluster: ")) {
				t.Fatalf("error %q does not name the compressed cluster", err)
			}
			t.Log(err)
		})
	}
}

// flipLast returns a copy of b with the last byte changed; for a zstd frame
// with a checksum, that corrupts the checksum.
func flipLast(b []byte) []byte {
	c := bytes.Clone(b)
	c[len(c)-1] ^= 0xff
	return c
}

func TestCompressErrors(t *testing.T) {
	tests := []struct {
		name string
		typ  uint8
		n    int
	}{
		{"empty", CompressionDeflate, 0},
		{"over 2 MiB", CompressionZstd, 2<<20 + 1},
		{"unknown type", 7, 4096},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			out, ok, err := compressCluster(tt.typ, make([]byte, tt.n))
			if err == nil || ok || out != nil {
				t.Fatalf("compressCluster = %d bytes, ok %v, err %v; want an error", len(out), ok, err)
			}
		})
	}
}

// TestDecompressMemory checks that hostile input cannot make the decoders
// allocate more than a bounded amount, however large a window or content
// size it declares, and that a warm decoder does not allocate at all.
func TestDecompressMemory(t *testing.T) {
	if testing.Short() {
		t.Skip("measures allocations")
	}
	const n = 64 << 10
	src := clusterData("text", n, 10)
	inputs := []struct {
		name string
		typ  uint8
		in   []byte
	}{
		{"zstd/valid", CompressionZstd, mustCompress(t, CompressionZstd, src)},
		{"zstd/window 1 GiB", CompressionZstd, zstdHeader(30)},
		{"zstd/window 2 GiB", CompressionZstd, zstdHeader(31)},
		{"zstd/content 1 MiB", CompressionZstd, zstdFrame(t, clusterData("text", 1<<20, 11))},
		{"deflate/valid", CompressionDeflate, mustCompress(t, CompressionDeflate, src)},
		{"deflate/garbage", CompressionDeflate, clusterData("random", n, 12)},
	}
	dst := make([]byte, n)
	for _, in := range inputs {
		t.Run(in.name, func(t *testing.T) {
			var before, after runtime.MemStats
			runtime.ReadMemStats(&before)
			for range 10 {
				_ = decompressCluster(in.typ, in.in, dst)
			}
			runtime.ReadMemStats(&after)
			// One cold decoder (history for a window of one cluster plus
			// fixed block buffers) is allowed; repeated calls reuse it.
			limit := uint64(1<<20 + 4*n)
			if underRace() {
				// The race detector's sync.Pool drops items at random,
				// so a second cold decoder may be built.
				limit *= 2
			}
			if got := after.TotalAlloc - before.TotalAlloc; got > limit {
				t.Fatalf("10 decompressions allocated %d bytes, limit %d", got, limit)
			}
		})
	}
	t.Run("warm", func(t *testing.T) {
		if underRace() {
			t.Skip("sync.Pool drops items at random under the race detector")
		}
		for _, in := range inputs[:1] {
			allocs := testing.AllocsPerRun(100, func() {
				if err := decompressCluster(in.typ, in.in, dst); err != nil {
					t.Fatal(err)
				}
			})
			// sync.Pool may be emptied by a GC during the run.
			if allocs > 1 {
				t.Errorf("%s: %.1f allocations per warm decompression", in.name, allocs)
			}
		}
	})
}

// underRace reports whether the test binary was built with -race.
func underRace() bool {
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		return false
	}
	for _, s := range bi.Settings {
		if s.Key == "-race" {
			return s.Value == "true"
		}
	}
	return false
}

// TestCompressConcurrent runs compression and decompression of both types
// and several cluster sizes on many goroutines at once; run with -race.
func TestCompressConcurrent(t *testing.T) {
	sizes := []int{512, 4 << 10, 64 << 10, 256 << 10}
	var wg sync.WaitGroup
	errs := make(chan error, 64)
	for g := range 16 {
		wg.Go(func() {
			for i := range 20 {
				typ := compressionTypes[(g+i)%2].typ
				n := sizes[(g*7+i)%len(sizes)]
				kind := []string{"text", "repeat", "random"}[i%3]
				src := clusterData(kind, n, uint64(g*100+i))
				out, ok, err := compressCluster(typ, src)
				if err != nil {
					errs <- err
					return
				}
				if !ok {
					continue
				}
				dst := make([]byte, n)
				if err := decompressCluster(typ, out, dst); err != nil {
					errs <- err
					return
				}
				if !bytes.Equal(dst, src) {
					errs <- fmt.Errorf("goroutine %d: type %d, %d bytes: round trip changed the data", g, typ, n)
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}

// needQemuImg returns the path of qemu-img; a missing tool fails the test
// (scripts/test.sh installs it).
func needQemuImg(t *testing.T) string {
	t.Helper()
	p, err := exec.LookPath("qemu-img")
	if err != nil {
		t.Fatal("qemu-img not installed: run scripts/test.sh, which installs qemu-utils")
	}
	return p
}

func mustRun(t *testing.T, name string, args ...string) string {
	t.Helper()
	out, err := exec.Command(name, args...).CombinedOutput()
	if err != nil {
		t.Fatalf("%s %q: %v\n%s", name, args, err, out)
	}
	return string(out)
}

// interopData returns the guest data used by the QEMU interop tests:
// compressible clusters, zero clusters, incompressible clusters and a
// final partial cluster.
func interopData(clusterSize int) []byte {
	var b []byte
	for i := range 12 {
		switch i % 4 {
		case 0, 1:
			b = append(b, clusterData("text", clusterSize, uint64(i))...)
		case 2:
			b = append(b, make([]byte, clusterSize)...)
		case 3:
			b = append(b, clusterData("random", clusterSize, uint64(i))...)
		}
	}
	// A partial cluster of whole sectors: QEMU rounds sizes to sectors.
	return append(b, clusterData("text", (clusterSize/3+511)&^511, 99)...)
}

var interopClusterBits = []uint32{9, 12, 16, 21}

// TestQEMUCompressedClusters decompresses clusters that qemu-img compressed
// and compares them with the source.
func TestQEMUCompressedClusters(t *testing.T) {
	qimg := needQemuImg(t)
	for _, ct := range compressionTypes {
		for _, cb := range interopClusterBits {
			t.Run(fmt.Sprintf("%s/%d", ct.name, 1<<cb), func(t *testing.T) {
				cs := 1 << cb
				dir := t.TempDir()
				raw, img := filepath.Join(dir, "src.raw"), filepath.Join(dir, "c.qcow2")
				data := interopData(cs)
				if err := os.WriteFile(raw, data, 0o644); err != nil {
					t.Fatal(err)
				}
				mustRun(t, qimg, "convert", "-c", "-f", "raw", "-O", "qcow2",
					"-o", fmt.Sprintf("cluster_size=%d,compression_type=%s", cs, map[uint8]string{0: "zlib", 1: "zstd"}[ct.typ]),
					raw, img)
				file, err := os.ReadFile(img)
				if err != nil {
					t.Fatal(err)
				}
				compressed := 0
				got := readGuest(t, file, ct.typ, func(desc, off, n int64) { compressed++ })
				want := append(data, make([]byte, len(got)-len(data))...)
				if !bytes.Equal(got, want) {
					t.Fatal("guest data read through our decompressor differs from the source")
				}
				// Text clusters and the tail compress; zero and random ones do not.
				if compressed < 7 {
					t.Fatalf("only %d compressed clusters found", compressed)
				}
			})
		}
	}
}

// readGuest reads every guest cluster of the qcow2 image in file through a
// minimal walk of the L1 and L2 tables, decompressing compressed clusters
// with decompressCluster. It calls onCompressed for each compressed
// descriptor. The result is the virtual size rounded up to clusters.
func readGuest(t *testing.T, file []byte, typ uint8, onCompressed func(desc, off, n int64)) []byte {
	t.Helper()
	h, err := ParseHeader(file, int64(len(file)))
	if err != nil {
		t.Fatal(err)
	}
	if h.CompressionType != typ {
		t.Fatalf("image has compression type %d, want %d", h.CompressionType, typ)
	}
	be := binary.BigEndian
	cs := h.ClusterSize()
	const offMask = 0x00ff_ffff_ffff_fe00
	nClusters := (int64(h.Size) + cs - 1) / cs
	guest := make([]byte, nClusters*cs)
	perL2 := cs / 8
	x := 62 - (h.ClusterBits - 8)
	for c := int64(0); c < nClusters; c++ {
		l1e := be.Uint64(file[h.L1TableOffset+uint64(c/perL2)*8:])
		l2 := l1e & offMask
		if l2 == 0 {
			continue
		}
		e := be.Uint64(file[l2+uint64(c%perL2)*8:])
		dst := guest[c*cs : (c+1)*cs]
		switch {
		case e&(1<<62) != 0:
			off := int64(e & (1<<x - 1))
			sectors := int64(e>>x&(1<<(62-x)-1)) + 1
			n := sectors*512 - off%512
			end := min(off+n, int64(len(file)))
			onCompressed(int64(e), off, n)
			if err := decompressCluster(typ, file[off:end], dst); err != nil {
				t.Fatalf("guest cluster %d at %#x+%d: %v", c, off, n, err)
			}
		case e&1 != 0:
			// Zero cluster.
		case e&offMask != 0:
			copy(dst, file[e&offMask:])
		}
	}
	return guest
}

// TestQEMUReadsOurClusters builds an image whose clusters compressCluster
// compressed, packed back to back as QEMU packs them, and has qemu-img
// check it and compare it with the source.
func TestQEMUReadsOurClusters(t *testing.T) {
	qimg := needQemuImg(t)
	for _, ct := range compressionTypes {
		for _, cb := range interopClusterBits {
			t.Run(fmt.Sprintf("%s/%d", ct.name, 1<<cb), func(t *testing.T) {
				dir := t.TempDir()
				raw, img := filepath.Join(dir, "src.raw"), filepath.Join(dir, "ours.qcow2")
				data := interopData(1 << cb)
				if err := os.WriteFile(raw, data, 0o644); err != nil {
					t.Fatal(err)
				}
				file, compressed := buildCompressedImage(t, cb, ct.typ, data)
				if compressed < 7 {
					t.Fatalf("only %d clusters compressed", compressed)
				}
				if err := os.WriteFile(img, file, 0o644); err != nil {
					t.Fatal(err)
				}
				mustRun(t, qimg, "check", "-f", "qcow2", img)
				mustRun(t, qimg, "compare", "-f", "qcow2", "-F", "raw", img, raw)
				// And our own reader agrees.
				got := readGuest(t, file, ct.typ, func(desc, off, n int64) {})
				if !bytes.Equal(got[:len(data)], data) {
					t.Fatal("our reader disagrees with the source")
				}
			})
		}
	}
}

// buildCompressedImage lays out a version 3 image with 16-bit refcounts:
// header, refcount table, one refcount block, L1, L2 tables, then data.
// Compressible clusters are packed at byte granularity; others are stored
// as normal clusters; zero clusters stay unallocated. It returns the file
// and the number of compressed clusters.
func buildCompressedImage(t *testing.T, clusterBits uint32, typ uint8, data []byte) ([]byte, int) {
	t.Helper()
	be := binary.BigEndian
	cs := int64(1) << clusterBits
	nGuest := (int64(len(data)) + cs - 1) / cs
	perL2 := cs / 8
	nL2 := (nGuest + perL2 - 1) / perL2
	l1Bytes := nL2 * 8
	l1Clusters := (l1Bytes + cs - 1) / cs
	const (
		rtCluster = 1
		rbCluster = 2
		l1Cluster = 3
	)
	l2Cluster := l1Cluster + l1Clusters
	dataStart := (l2Cluster + nL2) * cs

	file := make([]byte, dataStart)
	refs := make([]uint16, dataStart/cs)
	for i := range refs {
		refs[i] = 1
	}
	pos := dataStart
	compressed := 0
	for c := range nGuest {
		cluster := make([]byte, cs)
		copy(cluster, data[c*cs:])
		if bytes.Count(cluster, []byte{0}) == len(cluster) {
			continue
		}
		var entry uint64
		out, ok, err := compressCluster(typ, cluster)
		if err != nil {
			t.Fatal(err)
		}
		if ok {
			compressed++
			end := pos + int64(len(out))
			file = append(file[:pos], out...)
			x := 62 - (clusterBits - 8)
			extra := uint64((end-1)/512 - pos/512)
			entry = 1<<62 | extra<<x | uint64(pos)
			for h := pos / cs; h <= (end-1)/cs; h++ {
				for int64(len(refs)) <= h {
					refs = append(refs, 0)
				}
				refs[h]++
			}
			pos = end
		} else {
			pos = (pos + cs - 1) / cs * cs
			file = append(file, make([]byte, pos-int64(len(file)))...)
			file = append(file, cluster...)
			entry = 1<<63 | uint64(pos)
			for int64(len(refs)) <= pos/cs {
				refs = append(refs, 0)
			}
			refs[pos/cs]++
			pos += cs
		}
		be.PutUint64(file[(l2Cluster+c/perL2)*cs+c%perL2*8:], entry)
	}
	// Pad the file to whole sectors, as QEMU does.
	file = append(file, make([]byte, (512-len(file)%512)%512)...)
	if int64(len(refs)) > cs/2 {
		t.Fatalf("test image needs %d refcounts, one block holds %d", len(refs), cs/2)
	}

	be.PutUint32(file[0:], Magic)
	be.PutUint32(file[4:], 3)
	be.PutUint32(file[20:], clusterBits)
	be.PutUint64(file[24:], uint64(len(data)))
	be.PutUint32(file[36:], uint32(nL2))
	be.PutUint64(file[40:], uint64(l1Cluster*cs))
	be.PutUint64(file[48:], uint64(rtCluster*cs))
	be.PutUint32(file[56:], 1)
	be.PutUint32(file[96:], 4)
	be.PutUint32(file[100:], 112)
	if typ != CompressionDeflate {
		be.PutUint64(file[72:], IncompatCompression)
		file[104] = typ
	}
	be.PutUint64(file[rtCluster*cs:], uint64(rbCluster*cs))
	for i, r := range refs {
		be.PutUint16(file[rbCluster*cs+int64(i)*2:], r)
	}
	for i := range nL2 {
		be.PutUint64(file[l1Cluster*cs+i*8:], 1<<63|uint64((l2Cluster+i)*cs))
	}
	return file, compressed
}

func BenchmarkCompressCluster(b *testing.B) {
	for _, ct := range compressionTypes {
		for _, n := range []int{64 << 10, 2 << 20} {
			src := clusterData("text", n, 13)
			b.Run(fmt.Sprintf("%s/%d", ct.name, n), func(b *testing.B) {
				b.SetBytes(int64(n))
				b.ReportAllocs()
				b.RunParallel(func(pb *testing.PB) {
					for pb.Next() {
						if _, _, err := compressCluster(ct.typ, src); err != nil {
							b.Fatal(err)
						}
					}
				})
			})
		}
	}
}

func BenchmarkDecompressCluster(b *testing.B) {
	for _, ct := range compressionTypes {
		for _, n := range []int{64 << 10, 2 << 20} {
			src := mustCompress(b, ct.typ, clusterData("text", n, 14))
			b.Run(fmt.Sprintf("%s/%d", ct.name, n), func(b *testing.B) {
				b.SetBytes(int64(n))
				b.ReportAllocs()
				b.RunParallel(func(pb *testing.PB) {
					dst := make([]byte, n)
					for pb.Next() {
						if err := decompressCluster(ct.typ, src, dst); err != nil {
							b.Fatal(err)
						}
					}
				})
			})
		}
	}
}

// FuzzDecompress feeds arbitrary bytes to both decoders. They must not
// panic, must fill the cluster completely or fail with a *CorruptError,
// must ignore whatever follows the stream, and must stay within a bounded
// amount of memory.
func FuzzDecompress(f *testing.F) {
	for _, ct := range compressionTypes {
		for _, bits := range []uint8{0, 3, 7} {
			n := 512 << bits
			out := mustCompress(f, ct.typ, clusterData("text", n, uint64(bits)))
			f.Add(ct.typ, bits, out)
			f.Add(ct.typ, bits, out[:len(out)/2])
		}
	}
	f.Add(uint8(CompressionZstd), uint8(3), zstdHeader(30))
	f.Fuzz(func(t *testing.T, typ uint8, sizeBits uint8, src []byte) {
		typ %= 2
		n := 512 << (sizeBits % 8) // 512 B .. 64 KiB keeps iterations fast
		dst := make([]byte, n)
		var before, after runtime.MemStats
		measure := sizeBits&0x80 != 0 // ReadMemStats is slow; sample
		if measure {
			runtime.ReadMemStats(&before)
		}
		err := decompressCluster(typ, src, dst)
		if measure {
			runtime.ReadMemStats(&after)
			if got := after.TotalAlloc - before.TotalAlloc; got > 1<<20+4*uint64(n) {
				t.Fatalf("decompressing %d bytes into %d allocated %d bytes", len(src), n, got)
			}
		}
		if err != nil {
			if !IsCorrupt(err) {
				t.Fatalf("error is not a *CorruptError: %v", err)
			}
			return
		}
		// Success must not depend on what follows the stream.
		again := make([]byte, n)
		if err := decompressCluster(typ, append(bytes.Clone(src), 0xff, 0x00, 0x28, 0xb5), again); err != nil {
			t.Fatalf("trailing bytes turned success into %v", err)
		}
		if !bytes.Equal(dst, again) {
			t.Fatal("trailing bytes changed the output")
		}
	})
}
