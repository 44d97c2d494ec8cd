package placement

import (
	"math"
	"testing"
)

func TestNegLog2(t *testing.T) {
	const tol = 1.0 / (1 << 26)
	for _, h := range []uint64{
		1, 2, 3, 1 << 11, 1<<32 - 1, 1 << 32, 1<<63 - 1, 1 << 63, 1<<63 + 1,
		0x9e3779b97f4a7c15, 0xdeadbeefcafebabe, math.MaxUint64 - 1<<20, math.MaxUint64,
	} {
		got := float64(negLog2(h)) / (1 << logFrac)
		want := 64 - math.Log2(float64(h))
		if math.Abs(got-want) > tol {
			t.Errorf("negLog2(%#x) = %.12f, want %.12f", h, got, want)
		}
	}
	// Monotone: a larger uniform value never scores worse.
	prev := negLog2(1)
	for h := uint64(2); h < 1<<20; h += 7 {
		if v := negLog2(h); v > prev {
			t.Fatalf("negLog2 not monotone at %#x: %d > %d", h, v, prev)
		} else {
			prev = v
		}
	}
	if negLog2(0) != negLog2(1) || negLog2(1) != 64<<logFrac {
		t.Errorf("negLog2(0), negLog2(1) = %d, %d; want %d", negLog2(0), negLog2(1), uint64(64)<<logFrac)
	}
}

func TestLog2Table(t *testing.T) {
	for i, v := range log2Table() {
		want := math.Log2(1 + float64(i)/(1<<logTableBits))
		if got := float64(v) / (1 << logFrac); math.Abs(got-want) > 1e-14 {
			t.Errorf("log2Table[%d] = %.17f, want %.17f", i, got, want)
		}
	}
}

func FuzzNegLog2(f *testing.F) {
	for _, h := range []uint64{0, 1, 1 << 40, 1<<63 + 12345, math.MaxUint64} {
		f.Add(h)
	}
	f.Fuzz(func(t *testing.T, h uint64) {
		if h == 0 {
			h = 1
		}
		got := float64(negLog2(h)) / (1 << logFrac)
		want := 64 - math.Log2(float64(h))
		if math.Abs(got-want) > 1.0/(1<<26) {
			t.Fatalf("negLog2(%#x) = %.12f, want %.12f", h, got, want)
		}
	})
}
