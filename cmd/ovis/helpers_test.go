package main

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/ovis-storage/ovis/block"
	"github.com/ovis-storage/ovis/internal/twin"
)

// TestRawMismatchLikeQemuCompare holds rawMismatch, which the image
// comparisons use in place of `qemu-img compare -f raw -F raw`, to
// qemu-img compare's verdict on pairs of raw files: equal, differing
// inside, one longer with a zero tail (a hole or written zeros), one
// longer with data in its tail, differing only past a hole.
func TestRawMismatchLikeQemuCompare(t *testing.T) {
	t.Parallel()
	data := func(n int, fill byte) []byte {
		b := make([]byte, n)
		for i := range b {
			b[i] = fill + byte(i%7)
		}
		return b
	}
	withByte := func(b []byte, off int, v byte) []byte {
		b = append([]byte(nil), b...)
		b[off] = v
		return b
	}
	base := data(3<<20, 1)
	for _, c := range []struct {
		name string
		a, b []byte
		// bSize, when larger than len(b), extends b with a hole.
		bSize int64
		alike bool
	}{
		{"equal", base, base, 0, true},
		{"last byte", base, withByte(base, len(base)-1, 0xff), 0, false},
		{"first byte", base, withByte(base, 0, 0), 0, false},
		{"tail hole", base, base, 5 << 20, true},
		{"tail zeros", base, append(append([]byte(nil), base...), make([]byte, 1<<20)...), 0, true},
		{"tail data", base, append(append([]byte(nil), base...), data(100, 3)...), 0, false},
		{"tail data after a hole", base, append(append(append([]byte(nil), base...), make([]byte, 2<<20)...), 9), 0, false},
		{"shorter is not zero-padded", append(append([]byte(nil), base...), 5), base, 0, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			dir := t.TempDir()
			a, b := filepath.Join(dir, "a.raw"), filepath.Join(dir, "b.raw")
			if err := os.WriteFile(a, c.a, 0o644); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(b, c.b, 0o644); err != nil {
				t.Fatal(err)
			}
			if c.bSize > 0 {
				if err := os.Truncate(b, c.bSize); err != nil {
					t.Fatal(err)
				}
			}
			q := qemuImg(t, dir, "compare", "-f", "raw", "-F", "raw", a, b)
			if q.code > 1 {
				t.Fatalf("qemu-img compare: exit %d\n%s%s", q.code, q.stdout, q.stderr)
			}
			got := twin.RawMismatch(t, a, b)
			if (q.code == 0) != (got == "") || (q.code == 0) != c.alike {
				t.Errorf("rawMismatch says %q, qemu-img compare exits %d (%s), the case expects alike=%v", got, q.code, q.stdout, c.alike)
			}
		})
	}
}

// TestSameFolders: sameFolders tells folders apart by a name, a byte, a
// length or a file in a subfolder, and takes holes for zeros.
func TestSameFolders(t *testing.T) {
	t.Parallel()
	fill := func(t *testing.T, dir string, change func(dir string)) {
		t.Helper()
		must := func(err error) {
			t.Helper()
			if err != nil {
				t.Fatal(err)
			}
		}
		must(os.WriteFile(filepath.Join(dir, "a"), []byte("abc"), 0o644))
		must(os.Mkdir(filepath.Join(dir, "sub"), 0o755))
		must(os.WriteFile(filepath.Join(dir, "sub", "b"), make([]byte, 8192), 0o644))
		if change != nil {
			change(dir)
		}
	}
	for _, c := range []struct {
		name   string
		change func(dir string)
		same   bool
	}{
		{"same", nil, true},
		{"hole for zeros", func(d string) {
			os.Truncate(filepath.Join(d, "sub", "b"), 0)
			os.Truncate(filepath.Join(d, "sub", "b"), 8192)
		}, true},
		{"byte", func(d string) { os.WriteFile(filepath.Join(d, "a"), []byte("abd"), 0o644) }, false},
		{"length", func(d string) { os.Truncate(filepath.Join(d, "sub", "b"), 8193) }, false},
		{"name", func(d string) { os.Rename(filepath.Join(d, "a"), filepath.Join(d, "c")) }, false},
		{"extra file", func(d string) { os.WriteFile(filepath.Join(d, "sub", "c"), nil, 0o644) }, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			a, b := t.TempDir(), t.TempDir()
			fill(t, a, nil)
			fill(t, b, c.change)
			if got := sameFolders(t, a, b); got != c.same {
				t.Errorf("sameFolders = %v, want %v", got, c.same)
			}
		})
	}
}

// TestSparseCopyKeepsLayout: sparseCopy keeps a file's holes where they
// are and its written zeros written, as SEEK_DATA sees them (and so
// qemu-img map), and its bytes and length.
func TestSparseCopyKeepsLayout(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	from, to := filepath.Join(dir, "from"), filepath.Join(dir, "to")
	f, err := os.Create(from)
	if err != nil {
		t.Fatal(err)
	}
	// Data, a hole, written zeros, a hole, data, and a hole to the end.
	for _, w := range []struct {
		off int64
		b   []byte
	}{{0, []byte("data")}, {1 << 20, make([]byte, 64<<10)}, {3 << 20, []byte("more")}} {
		if _, err := f.WriteAt(w.b, w.off); err != nil {
			t.Fatal(err)
		}
	}
	if err := f.Truncate(5 << 20); err != nil {
		t.Fatal(err)
	}
	f.Close()
	if err := twin.SparseCopy(from, to); err != nil {
		t.Fatal(err)
	}
	if an, bn, at := twin.FirstFileDiff(t, from, to); at >= 0 || an != bn {
		t.Fatalf("the copy differs: %d and %d bytes, first difference at %d", an, bn, at)
	}
	runs := func(path string) []string {
		f, err := block.OpenFile(path, true)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		var out []string
		for off := int64(0); off < 5<<20; {
			hole, end, ok := block.FileRun(f, off)
			if !ok {
				t.Fatalf("%s: the file system does not report holes (no SEEK_DATA)", path)
			}
			end = min(end, 5<<20)
			out = append(out, fmt.Sprintf("[%d, %d) hole=%v", off, end, hole))
			off = end
		}
		return out
	}
	if a, b := runs(from), runs(to); !slices.Equal(a, b) {
		t.Errorf("the copy's layout differs\nfrom: %v\n  to: %v", a, b)
	}
}
