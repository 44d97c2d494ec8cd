package block

import "testing"

// recDevice records the FUA flags and flushes it receives.
type recDevice struct {
	Device
	fua     []bool
	flushes int
}

func (r *recDevice) WriteAt(p []byte, off int64, fua bool) (int, error) {
	r.fua = append(r.fua, fua)
	return len(p), nil
}
func (r *recDevice) WriteZeroes(off, n int64, mayUnmap, fua bool) error {
	r.fua = append(r.fua, fua)
	return nil
}
func (r *recDevice) Flush() error { r.flushes++; return nil }

func TestWithCacheMode(t *testing.T) {
	for _, tc := range []struct {
		mode          CacheMode
		fuaIn, fuaOut bool
		flushes       int
	}{
		{CacheWriteback, false, false, 1},
		{CacheWriteback, true, true, 1},
		{CacheNone, false, false, 1},
		{CacheWritethrough, false, true, 1},
		{CacheDirectSync, false, true, 1},
		{CacheUnsafe, true, false, 0},
	} {
		r := &recDevice{}
		d := WithCacheMode(r, tc.mode)
		d.WriteAt([]byte{1}, 0, tc.fuaIn)
		d.WriteZeroes(0, 1, true, tc.fuaIn)
		d.Flush()
		if r.fua[0] != tc.fuaOut || r.fua[1] != tc.fuaOut || r.flushes != tc.flushes {
			t.Errorf("%v fua=%v: got fua %v flushes %d, want fua %v flushes %d", tc.mode, tc.fuaIn, r.fua, r.flushes, tc.fuaOut, tc.flushes)
		}
	}
}
