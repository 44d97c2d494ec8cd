package testutil

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"
)

// ConvertToRawFile converts the image at path to a raw file in a fresh
// temporary folder with `qemu-img convert -O raw` and returns the raw
// file's path. qemu-img writes zeros as holes, so the raw file of a large
// sparse image stays small; compare it with CompareDeviceWithRaw.
func ConvertToRawFile(t testing.TB, path string) string {
	t.Helper()
	out := filepath.Join(t.TempDir(), filepath.Base(path)+".raw")
	QemuImg(t, "convert", "-O", "raw", path, out)
	return out
}

// ConvertToRaw returns the whole guest content of the image at path, as
// `qemu-img convert -O raw` reads it. Use it only for small images; the
// caller owns the returned slice.
func ConvertToRaw(t testing.TB, path string) []byte {
	t.Helper()
	b, err := os.ReadFile(ConvertToRawFile(t, path))
	if err != nil {
		t.Fatalf("testutil: read converted %s: %v", path, err)
	}
	return b
}

const (
	// chunk is the unit of comparison.
	chunk = 1 << 20
	// fullHoleCheck is the largest hole of the raw file that is read back
	// from the device in full; larger holes are sampled.
	fullHoleCheck = 64 << 20
	// holeSamples is how many 64 KiB samples a large hole gets, besides
	// its first and last chunk.
	holeSamples = 64
)

var zeros = make([]byte, chunk)

// CompareDeviceWithRaw compares the first size bytes of dev with the raw
// file at rawPath, 1 MiB at a time, and reports the first differing offset
// with the bytes expected and got (t.Errorf); it returns whether they were
// equal. Bytes past the end of the raw file count as zeros, and a raw file
// whose size is not size is an error too.
//
// The raw file's holes are found with SEEK_DATA/SEEK_HOLE. A hole up to
// 64 MiB is read back from dev in full and must be zero; a larger hole is
// sampled (its first and last MiB and 64 spread 64 KiB pieces), so that a
// 1 TiB sparse disk compares in seconds.
func CompareDeviceWithRaw(t testing.TB, dev io.ReaderAt, size int64, rawPath string) bool {
	t.Helper()
	f, err := os.Open(rawPath)
	if err != nil {
		t.Fatalf("testutil: %v", err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		t.Fatalf("testutil: %v", err)
	}
	sameSize := st.Size() == size
	if !sameSize {
		t.Errorf("compare %s: raw file is %d bytes, device is %d bytes", rawPath, st.Size(), size)
	}
	c := comparer{t: t, dev: dev, raw: f, rawPath: rawPath, got: make([]byte, chunk), want: make([]byte, chunk)}
	fd := int(f.Fd())
	limit := min(size, st.Size())
	for off := int64(0); off < size; {
		data, err := unix.Seek(fd, off, unix.SEEK_DATA)
		if errors.Is(err, unix.ENXIO) || data > limit {
			data = size // a hole runs to the end of the file
		} else if err != nil {
			t.Fatalf("testutil: SEEK_DATA %s at %d: %v", rawPath, off, err)
		}
		if data > off && !c.zeroRange(off, data) {
			return false
		}
		if data >= size {
			break
		}
		hole, err := unix.Seek(fd, data, unix.SEEK_HOLE)
		if err != nil {
			t.Fatalf("testutil: SEEK_HOLE %s at %d: %v", rawPath, data, err)
		}
		hole = min(hole, size)
		if !c.dataRange(data, hole) {
			return false
		}
		off = hole
	}
	return sameSize
}

type comparer struct {
	t         testing.TB
	dev       io.ReaderAt
	raw       *os.File
	rawPath   string
	got, want []byte
}

// readDev reads len(p) bytes of the device at off.
func (c *comparer) readDev(p []byte, off int64) bool {
	c.t.Helper()
	n, err := c.dev.ReadAt(p, off)
	if n == len(p) && (err == nil || err == io.EOF) {
		return true
	}
	c.t.Errorf("compare with %s: device ReadAt(%d bytes at %d) = %d, %v", c.rawPath, len(p), off, n, err)
	return false
}

// dataRange compares [off, end) of the device with the raw file.
func (c *comparer) dataRange(off, end int64) bool {
	c.t.Helper()
	for off < end {
		n := min(end-off, chunk)
		want, got := c.want[:n], c.got[:n]
		m, err := c.raw.ReadAt(want, off)
		if err != nil && err != io.EOF {
			c.t.Fatalf("testutil: read %s at %d: %v", c.rawPath, off, err)
		}
		clear(want[m:])
		if !c.readDev(got, off) {
			return false
		}
		if !c.equal(got, want, off) {
			return false
		}
		off += n
	}
	return true
}

// zeroRange checks that the device reads zeros over [off, end), in full
// or by samples (see CompareDeviceWithRaw).
func (c *comparer) zeroRange(off, end int64) bool {
	c.t.Helper()
	if end-off <= fullHoleCheck {
		for off < end {
			if !c.zeroPiece(off, min(end-off, chunk)) {
				return false
			}
			off += chunk
		}
		return true
	}
	if !c.zeroPiece(off, chunk) || !c.zeroPiece(end-chunk, chunk) {
		return false
	}
	const piece = 64 << 10
	span := (end - off - 2*chunk - piece) / holeSamples
	for i := range int64(holeSamples) {
		// Spread the samples, and shift each by an odd amount so that
		// they land at different offsets within a cluster.
		p := off + chunk + i*span + (i*4099)%span
		if !c.zeroPiece(p, piece) {
			return false
		}
	}
	return true
}

func (c *comparer) zeroPiece(off, n int64) bool {
	c.t.Helper()
	got := c.got[:n]
	if !c.readDev(got, off) {
		return false
	}
	return c.equal(got, zeros[:n], off)
}

// equal reports the first difference between got and want, which were read
// at off.
func (c *comparer) equal(got, want []byte, off int64) bool {
	c.t.Helper()
	if bytes.Equal(got, want) {
		return true
	}
	i := 0
	for got[i] == want[i] {
		i++
	}
	j := i
	for j < len(got) && got[j] != want[j] {
		j++
	}
	c.t.Errorf("compare with %s: first difference at offset %d (%#x), %d differing bytes from there\n want %s\n got  %s",
		c.rawPath, off+int64(i), off+int64(i), j-i, snippet(want, i), snippet(got, i))
	return false
}

// snippet formats up to 16 bytes of b from i.
func snippet(b []byte, i int) string {
	return fmt.Sprintf("% x", b[i:min(i+16, len(b))])
}
