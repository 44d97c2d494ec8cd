package block

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
)

// memFile is a File in memory that counts syncs; it is not an *OSFile, so
// Raw falls back to writing zeros and reports everything as data.
type memFile struct {
	mu     sync.Mutex
	b      []byte
	syncs  atomic.Int64
	closed bool
}

func (m *memFile) ReadAt(p []byte, off int64) (int, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if off >= int64(len(m.b)) {
		return 0, io.EOF
	}
	n := copy(p, m.b[off:])
	if n < len(p) {
		return n, io.EOF
	}
	return n, nil
}

func (m *memFile) WriteAt(p []byte, off int64) (int, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if end := off + int64(len(p)); end > int64(len(m.b)) {
		m.b = append(m.b, make([]byte, end-int64(len(m.b)))...)
	}
	return copy(m.b[off:], p), nil
}

func (m *memFile) Sync() error { m.syncs.Add(1); return nil }
func (m *memFile) Truncate(size int64) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.b = append(m.b[:0:0], m.b[:min(size, int64(len(m.b)))]...)
	m.b = append(m.b, make([]byte, size-int64(len(m.b)))...)
	return nil
}
func (m *memFile) Size() (int64, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	return int64(len(m.b)), nil
}
func (m *memFile) Close() error { m.closed = true; return nil }

// sparseFile creates a file of size bytes with pattern data in the given
// [start, end) ranges and holes elsewhere.
func sparseFile(t *testing.T, size int64, data ...[2]int64) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "disk.raw")
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := f.Truncate(size); err != nil {
		t.Fatal(err)
	}
	for _, r := range data {
		if _, err := f.WriteAt(bytes.Repeat([]byte{0xa5}, int(r[1]-r[0])), r[0]); err != nil {
			t.Fatal(err)
		}
	}
	return path
}

func allocated(t *testing.T, path string) int64 {
	t.Helper()
	st, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	return st.Sys().(*syscall.Stat_t).Blocks * 512
}

// extents walks the whole device.
func extents(t *testing.T, d Device) []Extent {
	t.Helper()
	var out []Extent
	for off := int64(0); off < d.Size(); {
		e, err := FirstExtent(context.Background(), d, off, d.Size()-off)
		if err != nil {
			t.Fatalf("Extent(%d): %v", off, err)
		}
		if e.Length <= 0 {
			t.Fatalf("Extent(%d) returned length %d", off, e.Length)
		}
		if n := len(out); n > 0 && out[n-1].Status == e.Status && out[n-1].Depth == e.Depth {
			out[n-1].Length += e.Length
		} else {
			out = append(out, e)
		}
		off += e.Length
	}
	return out
}

const hz = StatusHole | StatusZero

func TestRawReadWrite(t *testing.T) {
	path := sparseFile(t, 1<<20)
	r, err := OpenRaw(path, false)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if r.Size() != 1<<20 {
		t.Fatalf("Size = %d", r.Size())
	}
	p := []byte("hello, raw")
	if n, err := r.WriteAt(context.Background(), p, 4097, 0); err != nil || n != len(p) {
		t.Fatalf("WriteAt = %d, %v", n, err)
	}
	got := make([]byte, len(p))
	if n, err := r.ReadAt(context.Background(), got, 4097); err != nil || n != len(p) || !bytes.Equal(got, p) {
		t.Fatalf("ReadAt = %d, %v, %q", n, err, got)
	}
	tail := make([]byte, 10)
	if _, err := r.ReadAt(context.Background(), tail, 1<<20-10); err != nil || !bytes.Equal(tail, make([]byte, 10)) {
		t.Fatalf("read of the tail = %v %x", err, tail)
	}
}

func TestRawRange(t *testing.T) {
	r, err := OpenRaw(sparseFile(t, 8192), false)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	buf := make([]byte, 512)
	tests := []struct {
		name string
		err  error
	}{
		{"read past end", func() error { _, err := r.ReadAt(context.Background(), buf, 8192-511); return err }()},
		{"read negative", func() error { _, err := r.ReadAt(context.Background(), buf, -1); return err }()},
		{"write past end", func() error { _, err := r.WriteAt(context.Background(), buf, 8192, 0); return err }()},
		{"zeroes past end", r.WriteZeroes(context.Background(), 4096, 4097, 0)},
		{"discard past end", r.Discard(context.Background(), 8191, 2, 0)},
		{"extent past end", func() error { _, err := FirstExtent(context.Background(), r, 8192, 1); return err }()},
	}
	for _, tt := range tests {
		if !errors.Is(tt.err, ErrOutOfRange) {
			t.Errorf("%s: err = %v, want ErrOutOfRange", tt.name, tt.err)
		}
	}
	if _, err := r.ReadAt(context.Background(), buf[:0], 8192); err != nil {
		t.Errorf("empty read at the end: %v", err)
	}
}

func TestRawReadOnly(t *testing.T) {
	r, err := OpenRaw(sparseFile(t, 8192, [2]int64{0, 4096}), true)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := r.WriteAt(context.Background(), []byte{1}, 0, 0); !errors.Is(err, ErrReadOnly) {
		t.Errorf("WriteAt: %v", err)
	}
	if err := r.WriteZeroes(context.Background(), 0, 512, 0); !errors.Is(err, ErrReadOnly) {
		t.Errorf("WriteZeroes: %v", err)
	}
	if err := r.Discard(context.Background(), 0, 512, 0); !errors.Is(err, ErrReadOnly) {
		t.Errorf("Discard: %v", err)
	}
	if err := r.Flush(context.Background()); err != nil {
		t.Errorf("Flush: %v", err)
	}
	buf := make([]byte, 4)
	if _, err := r.ReadAt(context.Background(), buf, 0); err != nil || buf[0] != 0xa5 {
		t.Errorf("ReadAt: %v %x", err, buf)
	}
	if err := r.Close(); err != nil {
		t.Fatal(err)
	}
}

func TestRawCloseTwice(t *testing.T) {
	r, err := OpenRaw(sparseFile(t, 4096), false)
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Close(); err != nil {
		t.Fatalf("first Close: %v", err)
	}
	if err := r.Close(); !errors.Is(err, ErrClosed) {
		t.Fatalf("second Close: %v, want ErrClosed", err)
	}
	if _, err := r.ReadAt(context.Background(), make([]byte, 1), 0); !errors.Is(err, ErrClosed) {
		t.Errorf("ReadAt after Close: %v", err)
	}
	if err := r.Flush(context.Background()); !errors.Is(err, ErrClosed) {
		t.Errorf("Flush after Close: %v", err)
	}
	if _, err := FirstExtent(context.Background(), r, 0, 1); !errors.Is(err, ErrClosed) {
		t.Errorf("Extent after Close: %v", err)
	}
}

func TestRawOpenMissing(t *testing.T) {
	if _, err := OpenRaw(filepath.Join(t.TempDir(), "nope"), true); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("OpenRaw of a missing file: %v", err)
	}
}

func TestRawExtent(t *testing.T) {
	const size = 10 << 20
	path := sparseFile(t, size, [2]int64{512 << 10, 640 << 10}, [2]int64{4 << 20, 5 << 20})
	r, err := OpenRaw(path, true)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	want := []Extent{
		{512 << 10, hz, 1},
		{128 << 10, StatusData, 1},
		{4<<20 - 640<<10, hz, 1},
		{1 << 20, StatusData, 1},
		{size - 5<<20, hz, 1},
	}
	if got := extents(t, r); fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("extents\n got %v\nwant %v", got, want)
	}
	// Extent clamps to n.
	if e, err := FirstExtent(context.Background(), r, 0, 4096); err != nil || e != (Extent{4096, hz, 1}) {
		t.Errorf("Extent(0, 4096) = %v, %v", e, err)
	}
	if e, err := FirstExtent(context.Background(), r, 520<<10, 4096); err != nil || e != (Extent{4096, StatusData, 1}) {
		t.Errorf("Extent inside data = %v, %v", e, err)
	}
	if e, err := FirstExtent(context.Background(), r, 0, 0); err != nil || e.Length != 0 {
		t.Errorf("Extent(0, 0) = %v, %v", e, err)
	}
}

// qemuMapEntry is one element of qemu-img map --output=json.
type qemuMapEntry struct {
	Start   int64 `json:"start"`
	Length  int64 `json:"length"`
	Depth   int   `json:"depth"`
	Present bool  `json:"present"`
	Zero    bool  `json:"zero"`
	Data    bool  `json:"data"`
}

// TestRawExtentMatchesQemu checks the mapping documented on Raw: qemu-img
// map's depth 0 is Depth 1, "data" is StatusData, "zero" without data is
// StatusHole|StatusZero.
func TestRawExtentMatchesQemu(t *testing.T) {
	if _, err := exec.LookPath("qemu-img"); err != nil {
		t.Skip("qemu-img not installed (scripts/test.sh installs qemu-utils)")
	}
	path := sparseFile(t, 3<<20+4096, [2]int64{0, 4096}, [2]int64{1 << 20, 1<<20 + 64<<10}, [2]int64{3 << 20, 3<<20 + 4096})
	out, err := exec.Command("qemu-img", "map", "--output=json", "-f", "raw", path).Output()
	if err != nil {
		t.Fatalf("qemu-img map: %v", err)
	}
	var m []qemuMapEntry
	if err := json.Unmarshal(out, &m); err != nil {
		t.Fatalf("qemu-img map output %s: %v", out, err)
	}
	var want []Extent
	for _, e := range m {
		if !e.Present || e.Depth != 0 {
			t.Fatalf("qemu-img map of a raw file gave %+v", e)
		}
		st := StatusData
		if !e.Data {
			st = hz
		}
		if n := len(want); n > 0 && want[n-1].Status == st {
			want[n-1].Length += e.Length
			continue
		}
		want = append(want, Extent{Length: e.Length, Status: st, Depth: e.Depth + 1})
	}
	r, err := OpenRaw(path, true)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if got := extents(t, r); fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("extents\n  ovis %v\n qemu %v", got, want)
	}
}

func TestRawWriteZeroes(t *testing.T) {
	const size = 4 << 20
	tests := []struct {
		name     string
		mayUnmap bool
		discard  bool
		// wantHole: the range is deallocated afterwards.
		wantHole bool
	}{
		{"punch", true, false, true},
		{"zero range", false, false, false},
		{"discard", false, true, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			path := sparseFile(t, size, [2]int64{0, size})
			r, err := OpenRaw(path, false)
			if err != nil {
				t.Fatal(err)
			}
			defer r.Close()
			before := allocated(t, path)
			if tt.discard {
				err = r.Discard(context.Background(), 1<<20, 2<<20, 0)
			} else {
				err = r.WriteZeroes(context.Background(), 1<<20, 2<<20, ZeroFlags(tt.mayUnmap, false))
			}
			if err != nil {
				t.Fatal(err)
			}
			buf := make([]byte, size)
			if _, err := r.ReadAt(context.Background(), buf, 0); err != nil {
				t.Fatal(err)
			}
			for i, b := range buf {
				inside := i >= 1<<20 && i < 3<<20
				if (inside && b != 0) || (!inside && b != 0xa5) {
					t.Fatalf("byte %d = %#x after zeroing [1M, 3M)", i, b)
				}
			}
			after := allocated(t, path)
			e, err := FirstExtent(context.Background(), r, 1<<20, 2<<20)
			if err != nil {
				t.Fatal(err)
			}
			if tt.wantHole {
				if after > before-2<<20 {
					t.Errorf("allocation went from %d to %d, want 2 MiB less", before, after)
				}
				if e != (Extent{2 << 20, hz, 1}) {
					t.Errorf("Extent of the zeroed range = %v, want a hole", e)
				}
			} else if after < before {
				t.Errorf("allocation went from %d to %d; ZERO_RANGE must keep it", before, after)
			}
		})
	}
}

func TestRawNonOSFile(t *testing.T) {
	m := &memFile{b: bytes.Repeat([]byte{7}, 64<<10)}
	r, err := NewRaw(m, false)
	if err != nil {
		t.Fatal(err)
	}
	if e, err := FirstExtent(context.Background(), r, 0, r.Size()); err != nil || e != (Extent{64 << 10, StatusData, 1}) {
		t.Fatalf("Extent = %v, %v", e, err)
	}
	if err := r.WriteZeroes(context.Background(), 100, 3<<10, FUA); err != nil {
		t.Fatal(err)
	}
	if err := r.Discard(context.Background(), 10<<10, 5, 0); err != nil {
		t.Fatal(err)
	}
	for i, b := range m.b {
		zero := (i >= 100 && i < 100+3<<10) || (i >= 10<<10 && i < 10<<10+5)
		if (zero && b != 0) || (!zero && b != 7) {
			t.Fatalf("byte %d = %d", i, b)
		}
	}
	if got := m.syncs.Load(); got != 1 {
		t.Errorf("FUA WriteZeroes synced %d times, want 1", got)
	}
	if _, err := r.WriteAt(context.Background(), []byte{1}, 0, FUA); err != nil {
		t.Fatal(err)
	}
	if _, err := r.WriteAt(context.Background(), []byte{1}, 1, 0); err != nil {
		t.Fatal(err)
	}
	if got := m.syncs.Load(); got != 2 {
		t.Errorf("after a FUA write and a plain write: %d syncs, want 2", got)
	}
	if err := r.Close(); err != nil {
		t.Fatal(err)
	}
	if !m.closed {
		t.Error("Close did not close the File")
	}
}

// TestRawConcurrent runs overlapping-in-time requests on disjoint ranges,
// for the race detector, and closes while they run.
func TestRawConcurrent(t *testing.T) {
	const (
		workers = 8
		span    = 256 << 10
	)
	r, err := OpenRaw(sparseFile(t, workers*span), false)
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			base := int64(w * span)
			p := bytes.Repeat([]byte{byte(w + 1)}, 4096)
			got := make([]byte, 4096)
			for i := int64(0); i < span/4096; i++ {
				off := base + i*4096
				if _, err := r.WriteAt(context.Background(), p, off, FUAIf(i%16 == 0)); err != nil {
					t.Error(err)
					return
				}
				if _, err := r.ReadAt(context.Background(), got, off); err != nil || !bytes.Equal(got, p) {
					t.Errorf("worker %d read back %v at %d", w, err, off)
					return
				}
				if i%8 == 0 {
					if err := r.WriteZeroes(context.Background(), off, 4096, ZeroFlags(i%16 == 0, false)); err != nil {
						t.Error(err)
						return
					}
				}
				if _, err := FirstExtent(context.Background(), r, base, span); err != nil {
					t.Error(err)
					return
				}
			}
			if err := r.Flush(context.Background()); err != nil {
				t.Error(err)
			}
		}()
	}
	wg.Wait()
	done := make(chan error, workers)
	for range workers {
		go func() {
			_, err := r.ReadAt(context.Background(), make([]byte, 512), 0)
			done <- err
		}()
	}
	if err := r.Close(); err != nil {
		t.Fatal(err)
	}
	for range workers {
		if err := <-done; err != nil && !errors.Is(err, ErrClosed) {
			t.Errorf("read racing Close: %v", err)
		}
	}
}

// TestRawCopyFrom copies ranges between raw files in the kernel, and
// refuses what it cannot offload: a file without a host descriptor, a
// read-only target and ranges past either end.
func TestRawCopyFrom(t *testing.T) {
	dir := t.TempDir()
	srcPath, dstPath := filepath.Join(dir, "src"), filepath.Join(dir, "dst")
	data := make([]byte, 3<<20)
	for i := range data {
		data[i] = byte(i*7 + i>>12)
	}
	if err := os.WriteFile(srcPath, data, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(dstPath, make([]byte, 4<<20), 0o644); err != nil {
		t.Fatal(err)
	}
	src, err := OpenRaw(srcPath, true)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	dst, err := OpenRaw(dstPath, false)
	if err != nil {
		t.Fatal(err)
	}
	defer dst.Close()
	tests := []struct {
		name              string
		srcOff, dstOff, n int64
		wantErr           error
	}{
		{"aligned", 0, 0, 1 << 20, nil},
		{"unaligned", 12345, 2<<20 + 77, 1<<20 - 1000, nil},
		{"to the source's end", 2 << 20, 3 << 20, 1 << 20, nil},
		{"past the source's end", 2 << 20, 0, 2 << 20, ErrOutOfRange},
		{"past the target's end", 0, 4<<20 - 10, 20, ErrOutOfRange},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := dst.CopyFrom(src, tt.srcOff, tt.dstOff, tt.n)
			if !errors.Is(err, tt.wantErr) {
				t.Fatalf("CopyFrom = %v, want %v", err, tt.wantErr)
			}
			if err != nil {
				return
			}
			got := make([]byte, tt.n)
			if _, err := dst.ReadAt(context.Background(), got, tt.dstOff); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, data[tt.srcOff:tt.srcOff+tt.n]) {
				t.Fatal("copied bytes differ from the source's")
			}
		})
	}
	mem, err := NewRaw(&memFile{b: make([]byte, 1<<20)}, false)
	if err != nil {
		t.Fatal(err)
	}
	if err := mem.CopyFrom(src, 0, 0, 4096); !errors.Is(err, ErrCopyUnsupported) {
		t.Fatalf("CopyFrom into a memory file = %v, want ErrCopyUnsupported", err)
	}
	if err := src.CopyFrom(dst, 0, 0, 4096); !errors.Is(err, ErrReadOnly) {
		t.Fatalf("CopyFrom into a read-only file = %v, want ErrReadOnly", err)
	}
}
