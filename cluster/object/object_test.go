package object

import "testing"

func TestIDRoundTrip(t *testing.T) {
	for _, c := range []struct {
		vdi   VDI
		index uint32
		s     string
	}{
		{1, 0, "0000000100000000"},
		{0xabcdef, 7, "00abcdef00000007"},
		{0xffffffff, 0xffffffff, "ffffffffffffffff"},
	} {
		id := Make(c.vdi, c.index)
		if id.VDI() != c.vdi || id.Index() != c.index {
			t.Errorf("Make(%#x, %d) = %v: VDI %#x index %d", c.vdi, c.index, id, id.VDI(), id.Index())
		}
		if id.String() != c.s {
			t.Errorf("Make(%#x, %d).String() = %s, want %s", c.vdi, c.index, id, c.s)
		}
		p, err := Parse(c.s)
		if err != nil || p != id {
			t.Errorf("Parse(%s) = %v, %v; want %v", c.s, p, err, id)
		}
	}
	for _, bad := range []string{"", "123", "000000010000000g", "00000001000000001"} {
		if _, err := Parse(bad); err == nil {
			t.Errorf("Parse(%q) succeeded", bad)
		}
	}
}

func TestValidSize(t *testing.T) {
	for _, c := range []struct {
		size int64
		ok   bool
	}{
		{1 << 20, true}, {4 << 20, true}, {64 << 20, true},
		{512 << 10, false}, {128 << 20, false}, {3 << 20, false}, {0, false}, {-1 << 20, false},
	} {
		if err := ValidSize(c.size); (err == nil) != c.ok {
			t.Errorf("ValidSize(%d) = %v, want ok=%v", c.size, err, c.ok)
		}
	}
	// A VDI of 64 TiB must fit with the smallest objects.
	if MaxVDISize(1<<MinSizeShift) < 64<<40 {
		t.Errorf("MaxVDISize(1 MiB) = %d, below 64 TiB", MaxVDISize(1<<MinSizeShift))
	}
}
