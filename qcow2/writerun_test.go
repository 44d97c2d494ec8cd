package qcow2

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"math/rand"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/ovis-storage/ovis/block"
)

// countingFile counts the writes that reach the image file.
type countingFile struct {
	block.File
	mu     sync.Mutex
	writes []int // lengths
}

func (f *countingFile) WriteAt(p []byte, off int64) (int, error) {
	f.mu.Lock()
	f.writes = append(f.writes, len(p))
	f.mu.Unlock()
	return f.File.WriteAt(p, off)
}

func (f *countingFile) take() []int {
	f.mu.Lock()
	defer f.mu.Unlock()
	w := f.writes
	f.writes = nil
	return w
}

// hostOf returns the host offset guest cluster c maps to (0: none).
func hostOf(t *testing.T, img *Image, c int64) uint64 {
	t.Helper()
	var h uint64
	err := img.withMetadata(ctx, func() error {
		m, err := img.lookupLocked(c)
		if err != nil {
			return err
		}
		h, _ = img.host(m)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return h
}

// TestWriteRunOneHostRun checks that a write over new clusters lands in
// one contiguous host run with one pwrite straight from the caller's
// buffer, that a rewrite of it is one in-place pwrite, and that partial
// clusters at either end cost one more pwrite each and keep their old
// bytes.
func TestWriteRunOneHostRun(t *testing.T) {
	for _, tc := range []struct {
		name string
		o    CreateOptions
	}{
		{"c64k", CreateOptions{ClusterSize: 64 << 10}},
		{"c4k", CreateOptions{ClusterSize: 4 << 10}},
		{"extl2-c64k", CreateOptions{ClusterSize: 64 << 10, ExtendedL2: true}},
		{"c512-rc64", CreateOptions{ClusterSize: 512, RefcountBits: 64}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			path := filepath.Join(t.TempDir(), "a.qcow2")
			o := tc.o
			o.Size = 16 << 20
			if err := Create(path, o); err != nil {
				t.Fatal(err)
			}
			var cf *countingFile
			img, err := Open(path, Options{OpenFile: func(name string, ro bool) (block.File, error) {
				f, err := block.OpenFile(name, ro)
				if err != nil {
					return nil, err
				}
				cf = &countingFile{File: f}
				return cf, nil
			}})
			if err != nil {
				t.Fatal(err)
			}
			defer img.Close()
			cs := img.ClusterSize()
			model := make([]byte, o.Size)
			write := func(off int64, n int) {
				t.Helper()
				p := make([]byte, n)
				rand.New(rand.NewSource(off + int64(n))).Read(p)
				if _, err := img.WriteAt(ctx, p, off, 0); err != nil {
					t.Fatalf("WriteAt(%d, %d): %v", off, n, err)
				}
				copy(model[off:], p)
			}
			// The longest run one write makes: an L2 slice, and half a
			// refcount block's range.
			maxRun := min(img.slEntries, max(img.rcPerBlock/2, 1))

			// Aligned, over new clusters: one pwrite per run.
			n := int64(32)
			off := 16 * cs
			cf.take()
			write(off, int(n*cs))
			runs := (n + maxRun - 1) / maxRun
			if got := cf.take(); int64(len(got)) != runs {
				t.Errorf("fresh write of %d clusters: %d pwrites %v, want %d", n, len(got), got, runs)
			}
			first := hostOf(t, img, off/cs)
			for k := int64(1); k < min(n, maxRun); k++ {
				if h := hostOf(t, img, off/cs+k); h != first+uint64(k*cs) {
					t.Fatalf("cluster %d of the run is at host %#x, want %#x", k, h, first+uint64(k*cs))
				}
			}

			// The same range again: in place.
			write(off, int(n*cs))
			if got := cf.take(); int64(len(got)) > runs {
				t.Errorf("in-place rewrite of %d clusters: %d pwrites %v, want at most %d", n, len(got), got, runs)
			}

			// Unaligned, half over the written clusters and half over new
			// ones: the in-place part, then a fresh run whose last cluster
			// is partial.
			write(off+n*cs/2+100, int(n*cs))
			cf.take()
			// Unaligned over new clusters only.
			write(off+4*n*cs+7, int(3*cs))
			got := cf.take()
			if tc.o.ExtendedL2 {
				// Partial clusters go through the general path.
				if len(got) < 2 {
					t.Errorf("extended L2, unaligned fresh write: %d pwrites %v, want at least 2", len(got), got)
				}
			} else if maxRun >= 4 && len(got) != 3 {
				t.Errorf("unaligned fresh write over 4 clusters: %d pwrites %v, want 3 (head, middle, tail)", len(got), got)
			}

			buf := make([]byte, o.Size)
			if _, err := img.ReadAt(ctx, buf, 0); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(buf, model) {
				t.Fatal("the image does not read back as written")
			}
			if err := img.Close(); err != nil {
				t.Fatal(err)
			}
			qemuReadsAs(t, path, model)
		})
	}
}

// TestWriteRunConcurrentOverlap runs writers whose multi-cluster writes
// overlap each other's, with a flusher and a reader beside them. Every
// sector must end up whole from one write that covered it, and from that
// writer's last write to cover it; the image must check clean.
func TestWriteRunConcurrentOverlap(t *testing.T) {
	for _, tc := range []struct {
		name    string
		o       CreateOptions
		open    Options
		backing bool
	}{
		{name: "c4k", o: CreateOptions{ClusterSize: 4 << 10}},
		{name: "c512-rc64", o: CreateOptions{ClusterSize: 512, RefcountBits: 64}},
		{name: "c64k-small-slices", o: CreateOptions{ClusterSize: 64 << 10}, open: Options{L2CacheSize: 16 << 10, L2CacheEntrySize: 4096}},
		{name: "c4k-tiny-cache", o: CreateOptions{ClusterSize: 4 << 10}, open: Options{L2CacheSize: 8 << 10, L2CacheEntrySize: 1024, RefcountCacheSize: 4 << 10}},
		{name: "extl2-c32k-backing", o: CreateOptions{ClusterSize: 32 << 10, ExtendedL2: true}, backing: true},
		{name: "c16k-backing", o: CreateOptions{ClusterSize: 16 << 10}, backing: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			dir := t.TempDir()
			const size = 8 << 20
			o := tc.o
			o.Size = size
			var base []byte
			if tc.backing {
				base = make([]byte, size)
				rand.New(rand.NewSource(1)).Read(base)
				if err := os.WriteFile(filepath.Join(dir, "base.raw"), base, 0o644); err != nil {
					t.Fatal(err)
				}
				o.BackingFile, o.BackingFormat = "base.raw", "raw"
			}
			path := filepath.Join(dir, "a.qcow2")
			if err := Create(path, o); err != nil {
				t.Fatal(err)
			}
			img, err := Open(path, tc.open)
			if err != nil {
				t.Fatal(err)
			}
			cs := img.ClusterSize()
			const writers, perWriter, sector = 4, 60, 512
			type wr struct{ off, n int64 }
			done := make([][]wr, writers)
			var wg sync.WaitGroup
			errs := make(chan error, writers+2)
			for w := range writers {
				wg.Add(1)
				go func() {
					defer wg.Done()
					r := rand.New(rand.NewSource(int64(w) + 10))
					for seq := range perWriter {
						// Sector aligned, up to 48 clusters, in a 2 MiB
						// window all writers share.
						off := r.Int63n(2<<20/sector) * sector
						n := min((r.Int63n(48*cs/sector)+1)*sector, size-off)
						if r.Intn(3) == 0 {
							off = off / cs * cs
							n = min((n+cs-1)/cs*cs, size-off)
						}
						p := make([]byte, n)
						for s := int64(0); s < n; s += sector {
							v := uint64(w+1)<<56 | uint64(seq)<<32 | uint64((off+s)/sector)
							for i := int64(0); i < sector; i += 8 {
								binary.LittleEndian.PutUint64(p[s+i:], v)
							}
						}
						if _, err := img.WriteAt(ctx, p, off, block.FUAIf(r.Intn(10) == 0)); err != nil {
							errs <- fmt.Errorf("writer %d: WriteAt(%d, %d): %v", w, off, n, err)
							return
						}
						done[w] = append(done[w], wr{off, n})
					}
				}()
			}
			stop := make(chan struct{})
			var bg sync.WaitGroup
			bg.Add(2)
			go func() {
				defer bg.Done()
				for {
					select {
					case <-stop:
						return
					default:
					}
					if err := img.Flush(ctx); err != nil {
						errs <- fmt.Errorf("flusher: %v", err)
						return
					}
					time.Sleep(200 * time.Microsecond)
				}
			}()
			go func() {
				defer bg.Done()
				r := rand.New(rand.NewSource(99))
				p := make([]byte, 64*cs)
				for {
					select {
					case <-stop:
						return
					default:
					}
					off := r.Int63n(size - int64(len(p)))
					if _, err := img.ReadAt(ctx, p, off); err != nil {
						errs <- fmt.Errorf("reader: ReadAt(%d): %v", off, err)
						return
					}
				}
			}()
			wg.Wait()
			close(stop)
			bg.Wait()
			close(errs)
			for err := range errs {
				t.Fatal(err)
			}

			verify := func(what string, got []byte) {
				t.Helper()
				unwritten := make([]byte, sector)
				for s := int64(0); s < size; s += sector {
					if base != nil {
						copy(unwritten, base[s:])
					}
					if bytes.Equal(got[s:s+sector], unwritten) {
						// Never written: as the backing file (or zeros).
						for w := range writers {
							for _, x := range done[w] {
								if s >= x.off && s < x.off+x.n {
									t.Fatalf("%s: sector %d lost every write (writer %d wrote it)", what, s/sector, w)
								}
							}
						}
						continue
					}
					v := binary.LittleEndian.Uint64(got[s:])
					for i := int64(8); i < sector; i += 8 {
						if binary.LittleEndian.Uint64(got[s+i:]) != v {
							t.Fatalf("%s: sector %d is torn", what, s/sector)
						}
					}
					w, seq, at := int(v>>56)-1, int(v>>32&0xffffff), int64(v&0xffffffff)
					if at != s/sector || w < 0 || w >= writers || seq >= len(done[w]) {
						t.Fatalf("%s: sector %d holds %#x", what, s/sector, v)
					}
					if x := done[w][seq]; s < x.off || s >= x.off+x.n {
						t.Fatalf("%s: sector %d holds writer %d's write %d, which did not cover it", what, s/sector, w, seq)
					}
					for later := seq + 1; later < len(done[w]); later++ {
						if x := done[w][later]; s >= x.off && s < x.off+x.n {
							t.Fatalf("%s: sector %d holds writer %d's write %d; its later write %d is lost", what, s/sector, w, seq, later)
						}
					}
				}
			}
			got := make([]byte, size)
			if _, err := img.ReadAt(ctx, got, 0); err != nil {
				t.Fatal(err)
			}
			verify("ovis", got)
			if err := img.Close(); err != nil {
				t.Fatal(err)
			}
			qemuReadsAs(t, path, got)
		})
	}
}

// TestCrashConsistencyBigWrites runs the crash harness over writes of
// many clusters (new, in place, partly both, unaligned), over discards
// that free clusters for reuse: every allocating write is a host run.
func TestCrashConsistencyBigWrites(t *testing.T) {
	bigOps := func(t *testing.T, img *Image, m *crashModel, rf *recFile, rng *rand.Rand) {
		size, cs := img.Size(), img.ClusterSize()
		for range 40 {
			off := rng.Int63n(size)
			if rng.Intn(2) == 0 {
				off = off / cs * cs
			}
			n := min(rng.Int63n(40*cs)+1, size-off)
			switch k := rng.Intn(10); {
			case k < 7:
				crashWrite(t, img, m, rf, rng, off, n, 5)
			case k < 8:
				crashDiscard(t, img, m, off, n)
			default:
				crashFlush(t, img, m, rf)
			}
		}
	}
	for _, wl := range []crashWorkload{
		{name: "big-c4k", create: CreateOptions{Size: 4 << 20, ClusterSize: 4096}, extra: bigOps},
		{name: "big-c512-growth", create: CreateOptions{Size: 2 << 20, ClusterSize: 512}, extra: bigOps},
		{name: "big-extl2", create: CreateOptions{Size: 4 << 20, ClusterSize: 32768, ExtendedL2: true}, extra: bigOps},
		{name: "big-rc1-c4k", create: CreateOptions{Size: 2 << 20, ClusterSize: 4096, RefcountBits: 1}, extra: bigOps},
	} {
		t.Run(wl.name, func(t *testing.T) {
			t.Parallel()
			if err := runCrashWorkload(t, wl, *crashStates); err != nil {
				t.Fatal(err)
			}
		})
	}
}
