package node

import "testing"

func TestSpaceFull(t *testing.T) {
	const reserve = 100 << 20
	for _, c := range []struct {
		was  bool
		free int64
		want bool
	}{
		{false, reserve + fullMargin, false},
		{false, reserve + fullMargin - 1, true},
		{true, reserve + roomMargin - 1, true}, // not back until well clear
		{true, reserve + roomMargin, false},
		{false, 0, true},
	} {
		if got := spaceFull(c.was, c.free, reserve); got != c.want {
			t.Errorf("spaceFull(%v, %d) = %v, want %v", c.was, c.free, got, c.want)
		}
	}
}
