package convert

import (
	"context"
	"math/rand"
	"sync"
	"testing"
	"time"

	"github.com/ovis-storage/ovis/block"
)

// fakeDev is a sparse device in memory whose calls take random short
// pauses, to vary how the copier's goroutines interleave. Even MiBs hold
// data, odd MiBs are holes.
type fakeDev struct {
	size int64
	mu   sync.Mutex
	r    *rand.Rand
	data map[int64][]byte // writes by offset
}

func newFakeDev(size int64, seed int64) *fakeDev {
	return &fakeDev{size: size, r: rand.New(rand.NewSource(seed)), data: map[int64][]byte{}}
}

func (d *fakeDev) pause() {
	d.mu.Lock()
	n := d.r.Intn(4)
	d.mu.Unlock()
	switch n {
	case 0:
		time.Sleep(50 * time.Microsecond)
	case 1:
		time.Sleep(time.Microsecond)
	}
}

func (d *fakeDev) ReadAt(_ context.Context, p []byte, off int64) (int, error) {
	d.pause()
	for i := range p {
		if (off+int64(i))>>20&1 == 0 {
			p[i] = byte(off + int64(i))
		} else {
			p[i] = 0
		}
	}
	return len(p), nil
}

func (d *fakeDev) WriteAt(_ context.Context, p []byte, off int64, _ block.Flags) (int, error) {
	d.pause()
	d.mu.Lock()
	d.data[off] = append([]byte(nil), p...)
	d.mu.Unlock()
	return len(p), nil
}

func (d *fakeDev) WriteZeroes(context.Context, int64, int64, block.Flags) error {
	d.pause()
	return nil
}
func (d *fakeDev) Discard(context.Context, int64, int64, block.Flags) error { return nil }
func (d *fakeDev) Flush(context.Context) error                              { return nil }
func (d *fakeDev) Size() int64                                              { return d.size }
func (d *fakeDev) Close() error                                             { return nil }

func (d *fakeDev) Extents(_ context.Context, off, n int64, dst []block.Extent) ([]block.Extent, error) {
	return block.AppendRuns(off, n, dst, d.extent)
}

func (d *fakeDev) extent(off, n int64) (block.Extent, error) {
	d.pause()
	end := min((off>>20+1)<<20, off+n)
	if off>>20&1 == 0 {
		return block.Extent{Length: end - off, Status: block.StatusData, Depth: 1}, nil
	}
	return block.Extent{Length: end - off, Status: block.StatusZero | block.StatusHole}, nil
}

// TestCopierOrderedStress runs Copy (mostly ordered) many times
// over devices with random pauses, with 1 to 16 workers: it must finish
// (no lost job or buffer) and write every data byte once.
func TestCopierOrderedStress(t *testing.T) {
	iters := 100
	if testing.Short() {
		iters = 20
	}
	for i := range iters {
		src := newFakeDev(32<<20, int64(i))
		dst := newFakeDev(32<<20, int64(i)+1000)
		o := Options{Workers: 1 + i%16, TargetIsZero: true, OutOfOrder: i%4 == 3}
		done := make(chan error, 1)
		go func() { done <- Copy(context.Background(), dst, src, o) }()
		select {
		case err := <-done:
			if err != nil {
				t.Fatalf("iteration %d: %v", i, err)
			}
		case <-time.After(30 * time.Second):
			t.Fatalf("iteration %d (workers %d, ordered %v): the copy did not finish", i, o.Workers, !o.OutOfOrder)
		}
		var n int64
		for _, p := range dst.data {
			n += int64(len(p))
		}
		if n != 16<<20 {
			t.Fatalf("iteration %d: %d bytes written, want %d", i, n, 16<<20)
		}
	}
}
