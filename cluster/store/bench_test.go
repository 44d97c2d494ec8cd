package store

import (
	"fmt"
	"math/rand/v2"
	"os"
	"testing"

	"github.com/ovis-storage/ovis/cluster/object"
)

// BenchmarkWrite measures WriteAt: 4 KiB random writes over 16 objects
// of 4 MiB, and 1 MiB sequential writes, buffered and sync, on the disk
// (/tmp) and on tmpfs (/dev/shm). Objects exist before the timer starts,
// so the numbers are those of overwrites of journaled objects; buffered
// writes are never flushed here (see BenchmarkFlush).
func BenchmarkWrite(b *testing.B) {
	for _, fs := range []string{"/tmp", "/dev/shm"} {
		for _, size := range []int{4 << 10, 1 << 20} {
			for _, sync := range []bool{false, true} {
				mode := "buffered"
				if sync {
					mode = "sync"
				}
				b.Run(fmt.Sprintf("fs=%s/size=%dk/%s", fs, size>>10, mode), func(b *testing.B) {
					benchWrite(b, fs, size, sync)
				})
			}
		}
	}
}

func benchWrite(b *testing.B, fs string, size int, sync bool) {
	dir, err := os.MkdirTemp(fs, "storebench")
	if err != nil {
		b.Skip(err)
	}
	defer os.RemoveAll(dir)
	s := openT(b, dir, Options{})
	defer s.Close()
	const objects, objSize = 16, 4 << 20
	p := make([]byte, size)
	for i := range p {
		p[i] = byte(i*7 + 1)
	}
	for i := range objects {
		if _, err := s.WriteAt(object.Make(1, uint32(i)), Stamp{Token: 1}, make([]byte, objSize), 0, true); err != nil {
			b.Fatal(err)
		}
	}
	r := rand.New(rand.NewPCG(1, 2))
	b.SetBytes(int64(size))
	b.ResetTimer()
	var seq int64
	for b.Loop() {
		var id object.ID
		var off int64
		if size < 1<<20 {
			id = object.Make(1, uint32(r.IntN(objects)))
			off = r.Int64N(objSize/int64(size)) * int64(size)
		} else {
			id = object.Make(1, uint32(seq/objSize%objects))
			off = seq % objSize
			seq += int64(size)
		}
		if _, err := s.WriteAt(id, Stamp{Token: 1}, p, off, sync); err != nil {
			b.Fatal(err)
		}
	}
	b.StopTimer()
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "IOPS")
}

// BenchmarkFlush measures a Flush after 64 buffered 4 KiB writes spread
// over 16 objects (each Flush syncs up to 16 files and one journal
// batch); ns/op is per Flush.
func BenchmarkFlush(b *testing.B) {
	for _, fs := range []string{"/tmp", "/dev/shm"} {
		b.Run("fs="+fs, func(b *testing.B) {
			dir, err := os.MkdirTemp(fs, "storebench")
			if err != nil {
				b.Skip(err)
			}
			defer os.RemoveAll(dir)
			s := openT(b, dir, Options{})
			defer s.Close()
			p := make([]byte, 4096)
			r := rand.New(rand.NewPCG(1, 2))
			for b.Loop() {
				for range 64 {
					if _, err := s.WriteAt(object.Make(1, uint32(r.IntN(16))), Stamp{Token: 1}, p, r.Int64N(1024)*4096, false); err != nil {
						b.Fatal(err)
					}
				}
				if err := s.Flush(1); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkSyncNewObjects measures the first sync write to each object:
// creation, the journal record and the directory sync.
func BenchmarkSyncNewObjects(b *testing.B) {
	for _, fs := range []string{"/tmp", "/dev/shm"} {
		b.Run("fs="+fs, func(b *testing.B) {
			dir, err := os.MkdirTemp(fs, "storebench")
			if err != nil {
				b.Skip(err)
			}
			defer os.RemoveAll(dir)
			s := openT(b, dir, Options{})
			defer s.Close()
			p := make([]byte, 4096)
			for i := 0; b.Loop(); i++ {
				if _, err := s.WriteAt(object.Make(1, uint32(i)), Stamp{Token: 1}, p, 0, true); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "IOPS")
		})
	}
}

// BenchmarkRead measures 4 KiB random reads.
func BenchmarkRead(b *testing.B) {
	dir := b.TempDir()
	s := openT(b, dir, Options{})
	defer s.Close()
	for i := range 16 {
		if _, err := s.WriteAt(object.Make(1, uint32(i)), Stamp{Token: 1}, make([]byte, 4<<20), 0, false); err != nil {
			b.Fatal(err)
		}
	}
	r := rand.New(rand.NewPCG(1, 2))
	p := make([]byte, 4096)
	b.SetBytes(4096)
	for b.Loop() {
		if _, err := s.ReadAt(object.Make(1, uint32(r.IntN(16))), p, r.Int64N(1024)*4096); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "IOPS")
}
