package qcow2

import (
	"math/rand"
	"path/filepath"
	"testing"
)

// BenchmarkRandRead4K: 4 KiB random reads from a fully allocated image
// (page cache warm), in parallel.
func BenchmarkRandRead4K(b *testing.B) {
	p := filepath.Join(b.TempDir(), "b.qcow2")
	const size = 1 << 30
	if err := Create(p, CreateOptions{Size: size, Preallocation: PreallocFull}); err != nil {
		b.Fatal(err)
	}
	img, err := Open(p, Options{ReadOnly: true})
	if err != nil {
		b.Fatal(err)
	}
	defer img.Close()
	b.SetBytes(4096)
	b.RunParallel(func(pb *testing.PB) {
		rng := rand.New(rand.NewSource(rand.Int63()))
		buf := make([]byte, 4096)
		for pb.Next() {
			off := rng.Int63n(size/4096) * 4096
			if _, err := img.ReadAt(ctx, buf, off); err != nil {
				b.Fatal(err)
			}
		}
	})
}
