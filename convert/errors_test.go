package convert

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"testing"

	"github.com/ovis-storage/ovis/block"
)

// memDev is a device in memory, all data, whose reads fail in bad (byte
// offsets of whole sectors).
type memDev struct {
	mu  sync.Mutex
	b   []byte
	bad map[int64]bool
}

func (d *memDev) ReadAt(_ context.Context, p []byte, off int64) (int, error) {
	for s := off / 512 * 512; s < off+int64(len(p)); s += 512 {
		if d.bad[s] {
			return 0, syscall.EIO
		}
	}
	return copy(p, d.b[off:]), nil
}

func (d *memDev) WriteAt(_ context.Context, p []byte, off int64, _ block.Flags) (int, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	return copy(d.b[off:], p), nil
}

func (d *memDev) WriteZeroes(_ context.Context, off, n int64, _ block.Flags) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	clear(d.b[off : off+n])
	return nil
}
func (d *memDev) Discard(context.Context, int64, int64, block.Flags) error { return nil }
func (d *memDev) Flush(context.Context) error                              { return nil }
func (d *memDev) Size() int64                                              { return int64(len(d.b)) }
func (d *memDev) Close() error                                             { return nil }
func (d *memDev) Extents(_ context.Context, off, n int64, dst []block.Extent) ([]block.Extent, error) {
	return append(dst, block.Extent{Length: n, Status: block.StatusData, Depth: 1}), nil
}

// pattern returns n bytes of a sequence with no zero sector.
func pattern(n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(i%251 + 1)
	}
	return b
}

// TestCopyErrors: a failed read stops the copy with an *Error naming the
// step and offset, Salvage zeroes exactly the bad sectors and reports
// each, and the checks before the copy return their errors.
func TestCopyErrors(t *testing.T) {
	const size = 3 << 20
	bad := map[int64]bool{5 << 9: true, 2<<20 + 512: true}
	newSrc := func() *memDev { return &memDev{b: pattern(size), bad: bad} }

	err := Copy(ctx, &memDev{b: make([]byte, size)}, newSrc(), Options{})
	var ce *Error
	if !errors.As(err, &ce) || ce.Op != OpRead || !errors.Is(err, syscall.EIO) {
		t.Fatalf("Copy from a failing source = %v, want an *Error of Op read wrapping EIO", err)
	}
	if ce.Off != 0 && ce.Off != 2<<20 {
		t.Fatalf("read error at %d, want the start of a failing buffer (0 or 2 MiB)", ce.Off)
	}

	dst := &memDev{b: make([]byte, size)}
	var got []int64
	err = Copy(ctx, dst, newSrc(), Options{Salvage: true, Salvaged: func(e *Error) {
		if e.Op != OpRead {
			t.Errorf("salvaged %v, want Op read", e)
		}
		got = append(got, e.Off)
	}})
	if err != nil {
		t.Fatalf("Copy with Salvage: %v", err)
	}
	if len(got) != len(bad) {
		t.Fatalf("salvaged %v, want the %d bad sectors", got, len(bad))
	}
	want := pattern(size)
	for s := range bad {
		clear(want[s : s+512])
	}
	if !bytes.Equal(dst.b, want) {
		t.Fatal("salvaged copy differs from the source with its bad sectors zeroed")
	}

	if err := Copy(ctx, &memDev{b: make([]byte, size-512)}, newSrc(), Options{}); !errors.Is(err, ErrOutputTooSmall) {
		t.Fatalf("Copy onto a smaller output = %v, want ErrOutputTooSmall", err)
	}
	if err := Copy(ctx, &memDev{b: make([]byte, size)}, newSrc(), Options{Compress: true}); !errors.Is(err, ErrCompressUnsupported) {
		t.Fatalf("Copy compressed onto a non-qcow2 output = %v, want ErrCompressUnsupported", err)
	}
	if err := Copy(ctx, &memDev{b: make([]byte, size)}, newSrc(), Options{Workers: 99}); err == nil {
		t.Fatal("Copy with 99 workers succeeded")
	}
}

// TestCopyProgress: Progress ends at the source's size and never goes
// back, over a sparse source copied out of order; DataProgress counts the
// data only and ends at its total.
func TestCopyProgress(t *testing.T) {
	for _, outOfOrder := range []bool{false, true} {
		src := newFakeDev(16<<20, 1)
		dst := newFakeDev(16<<20, 2)
		var last, calls int64
		var dataLast, dataTotal int64
		err := Copy(ctx, dst, src, Options{
			OutOfOrder:   outOfOrder,
			TargetIsZero: true,
			Progress: func(done, total int64) {
				if done < last || total != src.Size() {
					t.Errorf("progress %d of %d after %d", done, total, last)
				}
				last = done
				calls++
			},
			DataProgress: func(queued, total int64) { dataLast, dataTotal = queued, total },
		})
		if err != nil {
			t.Fatal(err)
		}
		if last != src.Size() || calls < 2 {
			t.Errorf("out of order %v: progress ended at %d after %d calls, want %d", outOfOrder, last, calls, src.Size())
		}
		// Even MiBs hold data: half of the source.
		if dataLast != 8<<20 || dataTotal != 8<<20 {
			t.Errorf("out of order %v: data progress ended at %d of %d, want %d of %d", outOfOrder, dataLast, dataTotal, 8<<20, 8<<20)
		}
	}
}

// TestCopyRawOffload copies between raw files with CopyRange: the output
// must equal the source, holes included.
func TestCopyRawOffload(t *testing.T) {
	dir := t.TempDir()
	b := make([]byte, 3<<20)
	copy(b[1<<20:], pattern(1<<20))
	srcPath, dstPath := filepath.Join(dir, "src"), filepath.Join(dir, "dst")
	if err := os.WriteFile(srcPath, b, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(dstPath, make([]byte, len(b)), 0o644); err != nil {
		t.Fatal(err)
	}
	src, err := block.OpenRaw(srcPath, true)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	dst, err := block.OpenRaw(dstPath, false)
	if err != nil {
		t.Fatal(err)
	}
	if err := Copy(ctx, dst, src, Options{CopyRange: true, MinSparse: -1}); err != nil {
		t.Fatal(err)
	}
	if err := dst.Close(); err != nil {
		t.Fatal(err)
	}
	got, err := os.ReadFile(dstPath)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, b) {
		t.Fatal("offloaded copy differs from the source")
	}
}
