package qcow2

import (
	"bytes"
	"math/rand/v2"
	"path/filepath"
	"testing"
)

// TestReadNoWait: whatever ReadNoWait serves equals ReadAt, on an image
// with data, zero clusters, unallocated ranges over a backing file,
// compressed clusters and preallocated clusters that are host holes; and
// it does serve the cases it promises to (cached mappings of zeros,
// unallocated ranges, host holes, and data in the page cache).
func TestReadNoWait(t *testing.T) {
	dir := t.TempDir()
	base := filepath.Join(dir, "base.qcow2")
	top := filepath.Join(dir, "top.qcow2")
	const size = 8 << 20
	if err := Create(base, CreateOptions{Size: size}); err != nil {
		t.Fatal(err)
	}
	b, err := Open(base, Options{})
	if err != nil {
		t.Fatal(err)
	}
	fill := func(seed byte, n int) []byte {
		p := make([]byte, n)
		for i := range p {
			p[i] = seed + byte(i%251)
		}
		return p
	}
	if _, err := b.WriteAt(fill(1, 1<<20), 2<<20, false); err != nil {
		t.Fatal(err)
	}
	b.Close()
	if err := Create(top, CreateOptions{Size: size, BackingFile: base, BackingFormat: "qcow2", Preallocation: "metadata"}); err != nil {
		t.Fatal(err)
	}
	img, err := Open(top, Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer img.Close()
	if _, err := img.WriteAt(fill(7, 256<<10), 0, false); err != nil {
		t.Fatal(err)
	}
	if err := img.WriteZeroes(1<<20, 128<<10, false, false); err != nil {
		t.Fatal(err)
	}
	if err := img.WriteCompressed(fill(9, 64<<10), 4<<20); err != nil {
		t.Fatal(err)
	}

	cases := []struct {
		name   string
		off, n int64
		served bool // ReadNoWait must serve it
	}{
		{"data in page cache", 0, 4096, true},
		{"zero clusters", 1 << 20, 64 << 10, true},
		{"preallocated host hole", 6 << 20, 4096, true},
		{"compressed", 4 << 20, 4096, false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			want := make([]byte, c.n)
			if _, err := img.ReadAt(want, c.off); err != nil {
				t.Fatal(err)
			}
			got := make([]byte, c.n)
			ok := img.ReadNoWait(got, c.off)
			if ok != c.served {
				t.Fatalf("served %v, want %v", ok, c.served)
			}
			if ok && !bytes.Equal(got, want) {
				t.Fatal("ReadNoWait differs from ReadAt")
			}
		})
	}
	// Random ranges: never a wrong byte.
	r := rand.New(rand.NewPCG(1, 2))
	served := 0
	for i := 0; i < 2000; i++ {
		off := r.Int64N(size - 1)
		n := 1 + r.Int64N(min(size-off, 200<<10))
		want := make([]byte, n)
		if _, err := img.ReadAt(want, off); err != nil {
			t.Fatal(err)
		}
		got := make([]byte, n)
		if img.ReadNoWait(got, off) {
			served++
			if !bytes.Equal(got, want) {
				t.Fatalf("ReadNoWait(%d, %#x) differs from ReadAt", n, off)
			}
		}
	}
	if served == 0 {
		t.Fatal("ReadNoWait served none of 2000 random reads")
	}
}
