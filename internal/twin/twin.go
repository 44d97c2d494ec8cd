// Package twin gives qemu-img and ovis the same files to work on and
// compares what they leave: copies that keep a file's holes and data
// where they were (what qemu-img map sees through SEEK_DATA), and
// comparisons of raw files as qemu-img compare makes them, in process.
// It is for tests only.
package twin

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/ovis-storage/ovis/block"
	"github.com/ovis-storage/ovis/internal/testutil"
)

// CopyDir copies the regular files of from into to (SparseCopy), in
// process rather than one cp per file.
func CopyDir(t testing.TB, from, to string) {
	t.Helper()
	ents, err := os.ReadDir(from)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		if !e.Type().IsRegular() {
			continue
		}
		if err := SparseCopy(filepath.Join(from, e.Name()), filepath.Join(to, e.Name())); err != nil {
			t.Fatal(err)
		}
	}
}

// CopyTree copies the folder from into the folder to as CopyDir does,
// and its folders too, recursively.
func CopyTree(t testing.TB, from, to string) {
	t.Helper()
	CopyDir(t, from, to)
	ents, err := os.ReadDir(from)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		if !e.IsDir() {
			continue
		}
		if err := os.Mkdir(filepath.Join(to, e.Name()), 0o755); err != nil {
			t.Fatal(err)
		}
		CopyTree(t, filepath.Join(from, e.Name()), filepath.Join(to, e.Name()))
	}
}

// SparseCopy copies the file from to the file to (replaced if it exists),
// with from's mode for a new file, and with from's holes: what SEEK_DATA
// reports as data is written, zeros included, and its holes stay holes.
// QEMU sees a file's allocation through the same calls, so qemu-img map
// tells the copy from the original in nothing (cp --sparse=always would
// turn the zeros QEMU wrote into holes).
func SparseCopy(from, to string) error {
	src, err := block.OpenFile(from, true)
	if err != nil {
		return fmt.Errorf("copy %s: %w", from, err)
	}
	defer src.Close()
	size, err := src.Size()
	if err != nil {
		return fmt.Errorf("copy %s: %w", from, err)
	}
	fi, err := os.Stat(from)
	if err != nil {
		return fmt.Errorf("copy %s: %w", from, err)
	}
	dst, err := os.OpenFile(to, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, fi.Mode().Perm())
	if err != nil {
		return fmt.Errorf("copy %s: %w", from, err)
	}
	var buf []byte
	for off := int64(0); off < size; {
		hole, end, ok := block.FileRun(src, off)
		end = min(end, size)
		if !ok { // no SEEK_DATA: all data
			hole, end = false, size
		}
		if hole {
			off = end
			continue
		}
		// The kernel copies the run (copy_file_range), with no buffer
		// here for the race detector to account byte by byte; where it
		// cannot, or stops short, the rest goes through a buffer.
		for off < end {
			roff, woff := off, off
			n, err := unix.CopyFileRange(int(src.Fd()), &roff, int(dst.Fd()), &woff, int(end-off), 0)
			if err != nil || n <= 0 {
				break
			}
			off += int64(n)
		}
		if off < end && buf == nil {
			buf = make([]byte, 1<<20)
		}
		for off < end {
			n, err := src.ReadAt(buf[:min(int64(len(buf)), end-off)], off)
			if n == 0 {
				dst.Close()
				return fmt.Errorf("copy %s at %d: %w", from, off, err)
			}
			if _, err := dst.WriteAt(buf[:n], off); err != nil {
				dst.Close()
				return fmt.Errorf("copy %s to %s: %w", from, to, err)
			}
			off += int64(n)
		}
	}
	// The length, a hole at the end included.
	if err := dst.Truncate(size); err != nil {
		dst.Close()
		return fmt.Errorf("copy %s to %s: %w", from, to, err)
	}
	if err := dst.Close(); err != nil {
		return fmt.Errorf("copy %s to %s: %w", from, to, err)
	}
	return nil
}

// RawMismatch compares two raw files as `qemu-img compare -f raw -F raw`
// does, in process (the comparison of two plain files is not what the
// tests judge; QEMU's reading of the images, into those files, is): they
// compare alike when they hold the same bytes up to the shorter's end
// and the rest of the longer is zeros. It returns "" then, or where they
// differ.
func RawMismatch(t testing.TB, a, b string) string {
	t.Helper()
	an, bn, at := FirstFileDiff(t, a, b)
	if at < 0 {
		return ""
	}
	if short := min(an, bn); at < short {
		return fmt.Sprintf("content mismatch at offset %d", at)
	}
	long := a
	if bn > an {
		long = b
	}
	if off := FirstNonZero(t, long, min(an, bn)); off >= 0 {
		return fmt.Sprintf("content mismatch at offset %d (%s is %d bytes, %s %d)", off, a, an, b, bn)
	}
	return ""
}

// FirstNonZero returns the offset of the first byte of the file at path,
// at or after from, that is not zero, or -1. Holes are skipped unread.
func FirstNonZero(t testing.TB, path string, from int64) int64 {
	t.Helper()
	f, err := block.OpenFile(path, true)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	size, err := f.Size()
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 1<<20)
	for off := from; off < size; {
		if hole, end, ok := block.FileRun(f, off); ok && hole {
			off = end
			continue
		}
		n, err := f.ReadAt(buf[:min(int64(len(buf)), size-off)], off)
		if n == 0 && err != nil {
			t.Fatalf("read %s at %d: %v", path, off, err)
		}
		if !block.IsZero(buf[:n]) {
			for i, c := range buf[:n] {
				if c != 0 {
					return off + int64(i)
				}
			}
		}
		off += int64(n)
	}
	return -1
}

// firstDiff is the offset of the first byte where a and b differ.
// FirstFileDiff compares two files a chunk at a time (a repair can grow a
// file to gigabytes, mostly holes, which must not be read into memory)
// and returns their sizes and the offset of the first difference, or -1
// when they are equal.
func FirstFileDiff(t testing.TB, a, b string) (an, bn, at int64) {
	t.Helper()
	var files [2]*block.OSFile
	var sizes [2]int64
	for i, p := range []string{a, b} {
		f, err := block.OpenFile(p, true)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		if sizes[i], err = f.Size(); err != nil {
			t.Fatal(err)
		}
		files[i] = f
	}
	// nextData is where file i's next data starts at or after off, or its
	// end: a file that ends first differs there.
	nextData := func(i int, off int64) int64 {
		if hole, end, ok := block.FileRun(files[i], off); ok && hole {
			return min(end, sizes[i])
		}
		return off
	}
	const chunk = 1 << 20
	for off := int64(0); ; off += chunk {
		// Skip what is a hole in both files.
		if d := min(nextData(0, off), nextData(1, off)) &^ (chunk - 1); d > off {
			off = d
		}
		// The chunks are mapped rather than read: the race detector
		// accounts every byte a read fills in Go's memory, and nothing
		// outside it.
		var n [2]int
		var bufs [2][]byte
		for i, f := range files {
			n[i] = int(max(0, min(chunk, sizes[i]-off)))
			if n[i] == 0 {
				continue
			}
			m, err := unix.Mmap(int(f.Fd()), off, n[i], unix.PROT_READ, unix.MAP_SHARED)
			if err != nil {
				t.Fatalf("map %s at %d: %v", []string{a, b}[i], off, err)
			}
			bufs[i] = m
		}
		at := int64(-1)
		// bytes.Equal first: a byte loop is slow under -race.
		if m := min(n[0], n[1]); !bytes.Equal(bufs[0][:m], bufs[1][:m]) {
			for i := range m {
				if bufs[0][i] != bufs[1][i] {
					at = off + int64(i)
					break
				}
			}
		}
		for _, m := range bufs {
			if m != nil {
				unix.Munmap(m)
			}
		}
		switch {
		case at >= 0:
			return sizes[0], sizes[1], at
		case n[0] != n[1]:
			return sizes[0], sizes[1], off + int64(min(n[0], n[1]))
		case n[0] < chunk:
			return sizes[0], sizes[1], -1
		}
	}
}

// GuestMismatch compares what the image name in folder a and the one of
// the same name in folder b read, as RawMismatch compares their qemu-img
// convert -O raw outputs (qemu-img compare's rules, sizes included), and
// describes the first difference, or returns "" when they read alike.
//
// One qemu-img compare of the two images does it in one run, without
// the raw copies. QEMU 7.2 looks for a relative external data file in
// its working folder, not beside the image, so compare runs in an empty
// folder: such an image does not open there (exit 2), and then, as on
// any other error of compare's, each image is converted in its own
// folder and the raw files are compared (RawMismatch). The test fails if
// a convert fails.
func GuestMismatch(t testing.TB, a, b, name string) string {
	t.Helper()
	pa, err := filepath.Abs(filepath.Join(a, name))
	if err != nil {
		t.Fatal(err)
	}
	pb, err := filepath.Abs(filepath.Join(b, name))
	if err != nil {
		t.Fatal(err)
	}
	out, _, code := testutil.RunIn(t, t.TempDir(), "qemu-img", "compare", "-U", pa, pb)
	switch code {
	case 0:
		return ""
	case 1: // the images differ
		return strings.TrimSpace(out)
	}
	raws := [2]string{filepath.Join(t.TempDir(), "a.raw"), filepath.Join(t.TempDir(), "b.raw")}
	for i, d := range []string{a, b} {
		if _, e, c := testutil.RunIn(t, d, "qemu-img", "convert", "-U", "-O", "raw", name, raws[i]); c != 0 {
			t.Fatalf("qemu-img convert %s in %s: %s", name, d, e)
		}
	}
	return RawMismatch(t, raws[0], raws[1])
}
