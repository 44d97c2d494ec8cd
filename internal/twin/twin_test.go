package twin

import (
	"testing"

	"github.com/ovis-storage/ovis/internal/testutil"
)

// TestGuestMismatch holds GuestMismatch to what the two raw copies'
// RawMismatch says: alike, different, alike through a relative external
// data file each (compare cannot open those and falls back), different
// through them, and alike at two sizes with a zero tail.
func TestGuestMismatch(t *testing.T) {
	mk := func(t *testing.T, dir, opts, size string, cmds ...string) {
		t.Helper()
		args := []string{"create", "-q", "-f", "qcow2"}
		if opts != "" {
			args = append(args, "-o", opts)
		}
		testutil.MustRunIn(t, dir, "qemu-img", append(args, "a.qcow2", size)...)
		if len(cmds) > 0 {
			var io []string
			for _, c := range cmds {
				io = append(io, "-c", c)
			}
			testutil.MustRunIn(t, dir, "qemu-io", append(io, "a.qcow2")...)
		}
	}
	for _, c := range []struct {
		name         string
		opts         string
		asize, bsize string
		a, b         []string
		differ       bool
	}{
		{"alike", "", "1M", "1M", []string{"write -q -P 1 0 64k"}, []string{"write -q -P 1 0 64k"}, false},
		{"different", "", "1M", "1M", []string{"write -q -P 1 0 64k"}, []string{"write -q -P 2 0 64k"}, true},
		{"data file alike", "data_file=a.data", "1M", "1M", []string{"write -q -P 1 0 64k"}, []string{"write -q -P 1 0 64k"}, false},
		{"data file different", "data_file=a.data", "1M", "1M", []string{"write -q -P 1 0 64k"}, []string{"write -q -P 1 4k 4k"}, true},
		{"zero tail", "", "1M", "2M", []string{"write -q -P 1 0 64k"}, []string{"write -q -P 1 0 64k"}, false},
		{"data in the tail", "", "1M", "2M", []string{"write -q -P 1 0 64k"}, []string{"write -q -P 1 0 64k", "write -q -P 3 1536k 4k"}, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			a, b := t.TempDir(), t.TempDir()
			mk(t, a, c.opts, c.asize, c.a...)
			mk(t, b, c.opts, c.bsize, c.b...)
			if d := GuestMismatch(t, a, b, "a.qcow2"); (d != "") != c.differ {
				t.Errorf("GuestMismatch = %q, want a difference: %v", d, c.differ)
			}
		})
	}
}
