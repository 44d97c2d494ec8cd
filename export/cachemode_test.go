package export

import (
	"context"
	"testing"

	"github.com/ovis-storage/ovis/block"
)

// recDevice records the FUA flags and flushes it receives.
type recDevice struct {
	block.Device
	fua     []bool
	flushes int
}

func (r *recDevice) WriteAt(_ context.Context, p []byte, off int64, f block.Flags) (int, error) {
	r.fua = append(r.fua, f.Has(block.FUA))
	return len(p), nil
}
func (r *recDevice) WriteZeroes(_ context.Context, off, n int64, f block.Flags) error {
	r.fua = append(r.fua, f.Has(block.FUA))
	return nil
}
func (r *recDevice) Flush(context.Context) error { r.flushes++; return nil }

func TestWithCacheMode(t *testing.T) {
	for _, tc := range []struct {
		mode          block.CacheMode
		fuaIn, fuaOut bool
		flushes       int
	}{
		{block.CacheWriteback, false, false, 1},
		{block.CacheWriteback, true, true, 1},
		{block.CacheNone, false, false, 1},
		{block.CacheWritethrough, false, true, 1},
		{block.CacheDirectSync, false, true, 1},
		{block.CacheUnsafe, true, false, 0},
	} {
		r := &recDevice{}
		d := WithCacheMode(r, tc.mode)
		d.WriteAt(context.Background(), []byte{1}, 0, block.FUAIf(tc.fuaIn))
		d.WriteZeroes(context.Background(), 0, 1, block.FUAIf(tc.fuaIn))
		d.Flush(context.Background())
		if r.fua[0] != tc.fuaOut || r.fua[1] != tc.fuaOut || r.flushes != tc.flushes {
			t.Errorf("%v fua=%v: got fua %v flushes %d, want fua %v flushes %d", tc.mode, tc.fuaIn, r.fua, r.flushes, tc.fuaOut, tc.flushes)
		}
	}
}
