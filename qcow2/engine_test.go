package qcow2

import (
	"bytes"
	"math/rand"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/ovis-storage/ovis/block"
)

// qemuCheck runs qemu-img check and fails on any error or leak.
func qemuCheck(t *testing.T, path string) {
	t.Helper()
	out, err := exec.Command("qemu-img", "check", path).CombinedOutput()
	if err != nil {
		t.Fatalf("qemu-img check %s: %v\n%s", path, err, out)
	}
}

// qemuReadsAs requires the image at path to pass qemu-img check and to
// read as want through qemu-img convert.
func qemuReadsAs(t *testing.T, path string, want []byte) {
	t.Helper()
	qemuCheck(t, path)
	out, err := exec.Command("qemu-img", "convert", "-O", "raw", path, path+".raw").CombinedOutput()
	if err != nil {
		t.Fatalf("qemu-img convert: %v\n%s", err, out)
	}
	b, err := os.ReadFile(path + ".raw")
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(b, want) {
		t.Fatal("qemu-img reads other bytes than were written")
	}
}

func TestEngineSmoke(t *testing.T) {
	for _, tc := range []struct {
		name string
		o    CreateOptions
	}{
		{"default", CreateOptions{}},
		{"512", CreateOptions{ClusterSize: 512}},
		{"v2", CreateOptions{Compat: "0.10"}},
		{"rc1", CreateOptions{RefcountBits: 1, ClusterSize: 4096}},
		{"rc64", CreateOptions{RefcountBits: 64, ClusterSize: 4096}},
		{"extl2", CreateOptions{ExtendedL2: true}},
		{"lazy", CreateOptions{LazyRefcounts: true}},
		{"tinycache512", CreateOptions{ClusterSize: 512}},
		{"tinycache4k-extl2", CreateOptions{ClusterSize: 16384, ExtendedL2: true}},
		{"slices", CreateOptions{ClusterSize: 65536}},
		{"slices-extl2", CreateOptions{ClusterSize: 65536, ExtendedL2: true}},
		{"hitcount", CreateOptions{ClusterSize: 4096}},
		{"hitcount-floor", CreateOptions{ClusterSize: 4096}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			dir := t.TempDir()
			path := filepath.Join(dir, "a.qcow2")
			o := tc.o
			o.Size = 16 << 20
			if err := Create(path, o); err != nil {
				t.Fatal(err)
			}
			qemuCheck(t, path)
			var opts Options
			if strings.HasPrefix(tc.name, "tinycache") {
				// Two L2 tables and four refcount blocks: every path
				// that drops the lock to load a table gets exercised.
				opts = Options{L2CacheSize: 2 * o.ClusterSize, RefcountCacheSize: 4 * o.ClusterSize}
			}
			if strings.HasPrefix(tc.name, "slices") {
				// Two 4 KiB slices of 64 KiB L2 tables.
				opts = Options{L2CacheSize: 8192, L2CacheEntrySize: 4096}
			}
			if strings.HasPrefix(tc.name, "hitcount") {
				opts = Options{L2CacheSize: 3 * o.ClusterSize, L2CachePolicy: tc.name}
			}
			img, err := Open(path, opts)
			if err != nil {
				t.Fatal(err)
			}
			model := make([]byte, o.Size)
			rng := rand.New(rand.NewSource(1))
			for i := 0; i < 300; i++ {
				off := rng.Int63n(o.Size)
				n := rng.Int63n(min(200000, o.Size-off)) + 1
				switch rng.Intn(4) {
				case 0, 1:
					p := make([]byte, n)
					rng.Read(p)
					if _, err := img.WriteAt(ctx, p, off, block.FUAIf(rng.Intn(10) == 0)); err != nil {
						t.Fatalf("write %d@%d: %v", n, off, err)
					}
					copy(model[off:], p)
				case 2:
					if err := img.WriteZeroes(ctx, off, n, block.ZeroFlags(rng.Intn(2) == 0, false)); err != nil {
						t.Fatalf("zero %d@%d: %v", n, off, err)
					}
					clear(model[off : off+n])
				case 3:
					if rng.Intn(5) == 0 {
						if err := img.Flush(ctx); err != nil {
							t.Fatal(err)
						}
					}
				}
			}
			got := make([]byte, o.Size)
			if _, err := img.ReadAt(ctx, got, 0); err != nil {
				t.Fatal(err)
			}
			if i := firstDiff(got, model); i >= 0 {
				t.Fatalf("differs at %d before close", i)
			}
			if err := img.Close(); err != nil {
				t.Fatal(err)
			}
			qemuCheck(t, path)
			raw := filepath.Join(dir, "a.raw")
			os.WriteFile(raw, model, 0o644)
			if out, err := exec.Command("qemu-img", "compare", "-f", "qcow2", "-F", "raw", path, raw).CombinedOutput(); err != nil {
				t.Fatalf("compare: %v %s", err, out)
			}
		})
	}
}

func firstDiff(a, b []byte) int {
	if bytes.Equal(a, b) {
		return -1
	}
	for i := range a {
		if a[i] != b[i] {
			return i
		}
	}
	return len(a)
}

// TestLazyRefcountsDirtyRebuild: an image left dirty by a killed writer
// (QEMU's own, and ours) has its refcounts rebuilt before the next write,
// after which qemu-img check finds nothing wrong.
func TestLazyRefcountsDirtyRebuild(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "lazy.qcow2")
	if out, err := exec.Command("qemu-img", "create", "-f", "qcow2", "-o", "lazy_refcounts=on", path, "64M").CombinedOutput(); err != nil {
		t.Fatalf("%v %s", err, out)
	}
	// qemu-io dies by SIGKILL after writing: the dirty bit stays set and
	// refcounts were never updated.
	exec.Command("qemu-io", "-f", "qcow2", "-c", "write -P 0x5a 0 3M", "-c", "sigraise 9", path).Run()
	h := readHeader(t, path)
	if h.IncompatibleFeatures&IncompatDirty == 0 {
		t.Fatal("qemu-io did not leave the image dirty")
	}
	img, err := Open(path, Options{})
	if err != nil {
		t.Fatal(err)
	}
	p := bytes.Repeat([]byte{0xa5}, 1<<20)
	if _, err := img.WriteAt(ctx, p, 8<<20, 0); err != nil {
		t.Fatal(err)
	}
	// Crash ourselves: drop the image without Close.
	if err := img.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	img.closeFiles()
	if h := readHeader(t, path); h.IncompatibleFeatures&IncompatDirty == 0 {
		t.Fatal("ovis did not set the dirty bit while writing a lazy-refcounts image")
	}
	img, err = Open(path, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := img.WriteAt(ctx, p[:4096], 20<<20, 0); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, 1<<20)
	for _, c := range []struct {
		off  int64
		want byte
	}{{0, 0x5a}, {2 << 20, 0x5a}, {8 << 20, 0xa5}} {
		if _, err := img.ReadAt(ctx, got, c.off); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, bytes.Repeat([]byte{c.want}, len(got))) {
			t.Fatalf("data at %#x lost", c.off)
		}
	}
	if err := img.Close(); err != nil {
		t.Fatal(err)
	}
	if h := readHeader(t, path); h.IncompatibleFeatures&IncompatDirty != 0 {
		t.Fatal("dirty bit still set after a clean close")
	}
	qemuCheck(t, path)
}

func readHeader(t *testing.T, path string) *Header {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	h, err := ParseHeader(b[:min(len(b), 1<<21)], int64(len(b)))
	if err != nil {
		t.Fatal(err)
	}
	return h
}
