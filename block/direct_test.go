package block

import (
	"bytes"
	"math/rand"
	"os"
	"path/filepath"
	"sync"
	"testing"
)

// TestDirectFileMatchesBuffered applies the same random unaligned writes
// through O_DIRECT and through a plain file and compares.
func TestDirectFileMatchesBuffered(t *testing.T) {
	dir := t.TempDir()
	dp, bp := filepath.Join(dir, "d"), filepath.Join(dir, "b")
	const size = 1<<20 + 777
	for _, p := range []string{dp, bp} {
		if err := os.WriteFile(p, make([]byte, size), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	d, err := OpenFileDirect(dp, false)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	b, err := OpenFile(bp, false)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	rng := rand.New(rand.NewSource(7))
	for i := 0; i < 500; i++ {
		off := rng.Int63n(size)
		n := rng.Intn(int(min(20000, size-off))) + 1
		p := make([]byte, n)
		rng.Read(p)
		if _, err := d.WriteAt(p, off); err != nil {
			t.Fatal(err)
		}
		if _, err := b.WriteAt(p, off); err != nil {
			t.Fatal(err)
		}
		q1, q2 := make([]byte, n), make([]byte, n)
		roff := rng.Int63n(size - int64(n) + 1)
		if err := ReadFull(d, q1, roff); err != nil {
			t.Fatal(err)
		}
		if err := ReadFull(b, q2, roff); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(q1, q2) {
			t.Fatalf("op %d: read %d@%d differs", i, n, roff)
		}
	}
	if sz, _ := d.Size(); sz != size {
		t.Fatalf("direct file size %d, want %d", sz, size)
	}
}

// TestDirectFileConcurrentSubBlockWrites: writers to disjoint 512-byte
// pieces of the same 4 KiB blocks must not undo each other.
func TestDirectFileConcurrentSubBlockWrites(t *testing.T) {
	p := filepath.Join(t.TempDir(), "d")
	if err := os.WriteFile(p, make([]byte, 64<<10), 0o644); err != nil {
		t.Fatal(err)
	}
	d, err := OpenFileDirect(p, false)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	var wg sync.WaitGroup
	for w := 0; w < 8; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			for blk := int64(0); blk < 16; blk++ {
				buf := bytes.Repeat([]byte{byte(w + 1)}, 512)
				if _, err := d.WriteAt(buf, blk*4096+int64(w)*512); err != nil {
					t.Error(err)
				}
			}
		}(w)
	}
	wg.Wait()
	got := make([]byte, 64<<10)
	if err := ReadFull(d, got, 0); err != nil {
		t.Fatal(err)
	}
	for i, c := range got {
		if want := byte((i%4096)/512 + 1); c != want {
			t.Fatalf("byte %d = %d, want %d", i, c, want)
		}
	}
}
