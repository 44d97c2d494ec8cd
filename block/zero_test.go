package block

import (
	"bytes"
	"testing"
)

func TestIsZero(t *testing.T) {
	for _, n := range []int{0, 1, 4095, 64 << 10, 64<<10 + 1, 200 << 10} {
		b := make([]byte, n)
		if !IsZero(b) {
			t.Errorf("IsZero(%d zeros) = false", n)
		}
		if n == 0 {
			continue
		}
		for _, i := range []int{0, n / 2, n - 1} {
			c := bytes.Clone(b)
			c[i] = 0x80
			if IsZero(c) {
				t.Errorf("IsZero(%d bytes, byte %d set) = true", n, i)
			}
		}
	}
}
