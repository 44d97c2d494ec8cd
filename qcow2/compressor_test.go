package qcow2

import (
	"bytes"
	"math/rand"
	"path/filepath"
	"sync"
	"testing"
)

// TestCompressorWritePrecompressed compresses clusters on several
// goroutines, each with its own Compressor, and stores them with
// WritePrecompressed from one goroutine in order, as convert does: the
// short last cluster, clusters that do not shrink and rewrites of
// compressed clusters included. QEMU must read the image as written.
func TestCompressorWritePrecompressed(t *testing.T) {
	for _, tc := range []struct {
		name string
		o    CreateOptions
	}{
		{"zlib-c64k", CreateOptions{ClusterSize: 64 << 10, Size: 8<<20 + 4096}},
		{"zstd-c64k", CreateOptions{ClusterSize: 64 << 10, Size: 8<<20 + 4096, CompressionType: "zstd"}},
		{"zstd-c4k", CreateOptions{ClusterSize: 4 << 10, Size: 2<<20 + 512, CompressionType: "zstd"}},
		{"zlib-c512-rc1", CreateOptions{ClusterSize: 512, Size: 1<<20 + 512, RefcountBits: 1}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			path := filepath.Join(t.TempDir(), "a.qcow2")
			if err := Create(path, tc.o); err != nil {
				t.Fatal(err)
			}
			img, err := Open(path, Options{})
			if err != nil {
				t.Fatal(err)
			}
			defer img.Close()
			cs, size := img.ClusterSize(), img.Size()
			nc := (size + cs - 1) / cs
			model := make([]byte, size)
			r := rand.New(rand.NewSource(int64(cs)))
			for c := int64(0); c < nc; c++ {
				q := model[c*cs : min((c+1)*cs, size)]
				switch c % 4 {
				case 0: // does not shrink
					r.Read(q)
				default:
					for i := range q {
						q[i] = byte(r.Intn(3))
					}
				}
			}

			type result struct {
				z  []byte
				ok bool
			}
			// Two rounds: the second rewrites every cluster, compressed
			// over compressed.
			for round := range 2 {
				if round == 1 {
					for i := range model {
						model[i] ^= 0x5a
					}
				}
				res := make([]result, nc)
				var wg sync.WaitGroup
				const goroutines = 3
				for g := range goroutines {
					comp, err := img.NewCompressor()
					if err != nil {
						t.Fatal(err)
					}
					wg.Add(1)
					go func() {
						defer wg.Done()
						for c := int64(g); c < nc; c += goroutines {
							q := model[c*cs : min((c+1)*cs, size)]
							dst := make([]byte, 0, cs)
							z, ok, err := comp.Compress(dst, q)
							if err != nil {
								t.Error(err)
								return
							}
							if ok && &z[:1][0] != &dst[:1][0] {
								t.Errorf("cluster %d: compressed outside dst", c)
							}
							res[c] = result{z, ok}
						}
					}()
				}
				wg.Wait()
				for c := int64(0); c < nc; c++ {
					q := model[c*cs : min((c+1)*cs, size)]
					if c%4 == 0 && c < nc-1 && res[c].ok { // the short last one is padded with zeros
						t.Errorf("cluster %d: random data shrank", c)
					}
					if err := img.WritePrecompressed(ctx, res[c].z, q, c*cs); err != nil {
						t.Fatalf("WritePrecompressed(cluster %d): %v", c, err)
					}
				}
			}
			if err := img.WritePrecompressed(ctx, make([]byte, cs), model[:cs], 0); err == nil {
				t.Error("WritePrecompressed took a compressed cluster as large as a cluster")
			}
			got := make([]byte, size)
			if _, err := img.ReadAt(ctx, got, 0); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, model) {
				t.Fatal("ovis reads other bytes than were written")
			}
			if err := img.Close(); err != nil {
				t.Fatal(err)
			}
			qemuReadsAs(t, path, model)
		})
	}
}
