package store

import (
	"math"
	"testing"
)

func TestVersion(t *testing.T) {
	for _, c := range []struct {
		name       string
		old, epoch uint64
		want       uint64
	}{
		{"first write of epoch 0", 0, 0, Version(0, 1)},
		{"format-1 counter goes on", 41, 0, 42},
		{"first write of a new epoch", Version(3, 17), 5, Version(5, 1)},
		{"same epoch counts up", Version(5, 1), 5, Version(5, 2)},
		{"an older epoch's request counts up", Version(5, 7), 4, Version(5, 8)},
		{"count 0 (a Put's) in its epoch", Version(5, 0), 5, Version(5, 1)},
		{"saturated count stays", Version(5, math.MaxUint32), 5, Version(5, math.MaxUint32)},
		{"saturated, older request", Version(5, math.MaxUint32), 2, Version(5, math.MaxUint32)},
		{"saturated, newer epoch", Version(5, math.MaxUint32), 6, Version(6, 1)},
		{"highest epoch", Version(MaxEpoch, math.MaxUint32), MaxEpoch, math.MaxUint64},
	} {
		t.Run(c.name, func(t *testing.T) {
			got := nextVersion(c.old, c.epoch)
			if got != c.want {
				t.Fatalf("nextVersion(%#x, %d) = %#x, want %#x", c.old, c.epoch, got, c.want)
			}
			if got < c.old {
				t.Fatalf("version went down: %#x after %#x", got, c.old)
			}
			if e := VersionEpoch(got); e < c.epoch || e < VersionEpoch(c.old) {
				t.Fatalf("epoch %d of %#x, want at least %d and %d", e, got, c.epoch, VersionEpoch(c.old))
			}
		})
	}
	if v := Version(7, 9); VersionEpoch(v) != 7 || VersionCount(v) != 9 {
		t.Fatalf("Version(7, 9) = %#x splits into %d, %d", v, VersionEpoch(v), VersionCount(v))
	}
}
