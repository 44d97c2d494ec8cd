package export

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/ovis-storage/ovis/block"
)

// recorder is a block.Device that records the calls that reach it.
type recorder struct {
	size  int64
	calls []string
}

func (r *recorder) ReadAt(_ context.Context, p []byte, off int64) (int, error) { return len(p), nil }
func (r *recorder) WriteAt(_ context.Context, p []byte, off int64, f block.Flags) (int, error) {
	r.calls = append(r.calls, fmt.Sprintf("write %d+%d fua=%v", off, len(p), f.Has(block.FUA)))
	return len(p), nil
}
func (r *recorder) WriteZeroes(_ context.Context, off, n int64, f block.Flags) error {
	r.calls = append(r.calls, fmt.Sprintf("zero %d+%d unmap=%v fua=%v", off, n, !f.Has(block.NoUnmap), f.Has(block.FUA)))
	return nil
}
func (r *recorder) Discard(_ context.Context, off, n int64, _ block.Flags) error {
	if err := block.CheckRange(off, n, r.size); err != nil {
		return err
	}
	r.calls = append(r.calls, fmt.Sprintf("discard %d+%d", off, n))
	return nil
}
func (r *recorder) Flush(context.Context) error { return nil }
func (r *recorder) Extents(_ context.Context, off, n int64, dst []block.Extent) ([]block.Extent, error) {
	return append(dst, block.Extent{Length: n}), nil
}
func (r *recorder) Size() int64  { return r.size }
func (r *recorder) Close() error { return nil }

// TestPolicy checks what each --discard and --detect-zeroes combination
// sends to the device, as QEMU's block layer would.
func TestPolicy(t *testing.T) {
	zeros := make([]byte, 100<<10)
	data := make([]byte, 100<<10)
	data[len(data)-1] = 1
	for _, tc := range []struct {
		discard Discard
		zeroes  DetectZeroes
		want    []string
	}{
		{DiscardIgnore, DetectZeroesOff, []string{
			"write 0+102400 fua=false", "write 4096+102400 fua=true",
			"zero 0+8192 unmap=true fua=false", "zero 0+8192 unmap=false fua=true"}},
		{DiscardUnmap, DetectZeroesOff, []string{
			"write 0+102400 fua=false", "write 4096+102400 fua=true",
			"zero 0+8192 unmap=true fua=false", "zero 0+8192 unmap=false fua=true", "discard 512+4096"}},
		{DiscardIgnore, DetectZeroesOn, []string{
			"zero 0+102400 unmap=false fua=false", "write 4096+102400 fua=true",
			"zero 0+8192 unmap=true fua=false", "zero 0+8192 unmap=false fua=true"}},
		{DiscardUnmap, DetectZeroesUnmap, []string{
			"zero 0+102400 unmap=true fua=false", "write 4096+102400 fua=true",
			"zero 0+8192 unmap=true fua=false", "zero 0+8192 unmap=false fua=true", "discard 512+4096"}},
	} {
		t.Run(tc.discard.String()+"/"+tc.zeroes.String(), func(t *testing.T) {
			r := &recorder{size: 1 << 20}
			d := WithPolicy(r, tc.discard, tc.zeroes)
			if n, err := d.WriteAt(ctx, zeros, 0, 0); n != len(zeros) || err != nil {
				t.Fatalf("WriteAt zeros: %d, %v", n, err)
			}
			if _, err := d.WriteAt(ctx, data, 4096, block.FUA); err != nil {
				t.Fatal(err)
			}
			if err := d.WriteZeroes(ctx, 0, 8192, 0); err != nil {
				t.Fatal(err)
			}
			if err := d.WriteZeroes(ctx, 0, 8192, block.NoUnmap|block.FUA); err != nil {
				t.Fatal(err)
			}
			if err := d.Discard(ctx, 512, 4096, 0); err != nil {
				t.Fatal(err)
			}
			if err := d.Discard(ctx, 1<<20, 1, 0); !errors.Is(err, block.ErrOutOfRange) {
				t.Errorf("Discard past the end: %v, want ErrOutOfRange", err)
			}
			if got, want := strings.Join(r.calls, "\n"), strings.Join(tc.want, "\n"); got != want {
				t.Errorf("calls:\n%s\nwant:\n%s", got, want)
			}
		})
	}
}
