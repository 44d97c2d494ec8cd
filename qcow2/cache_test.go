package qcow2

import (
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/ovis-storage/ovis/block"
)

// gatedFile holds reads of chosen offsets until released, counting how
// many are waiting at once.
type gatedFile struct {
	block.File
	mu      sync.Mutex
	gate    map[int64]bool // offsets whose reads block
	waiting int
	peak    int
	reads   map[int64]int
	release chan struct{}
	arrived chan struct{}
}

func (g *gatedFile) ReadAt(p []byte, off int64) (int, error) {
	g.mu.Lock()
	gated := g.gate[off]
	if gated {
		g.reads[off]++
		g.waiting++
		g.peak = max(g.peak, g.waiting)
	}
	g.mu.Unlock()
	if gated {
		g.arrived <- struct{}{}
		<-g.release
		g.mu.Lock()
		g.waiting--
		g.mu.Unlock()
	}
	return g.File.ReadAt(p, off)
}

func openGated(t *testing.T, path string, o Options) (*Image, *gatedFile) {
	t.Helper()
	g := &gatedFile{gate: map[int64]bool{}, reads: map[int64]int{}, release: make(chan struct{}), arrived: make(chan struct{}, 64)}
	o.OpenFile = func(name string, ro bool) (block.File, error) {
		f, err := block.OpenFile(name, ro)
		if err != nil {
			return nil, err
		}
		g.File = f
		return g, nil
	}
	img, err := Open(path, o)
	if err != nil {
		t.Fatal(err)
	}
	return img, g
}

func waitArrivals(t *testing.T, g *gatedFile, n int) {
	t.Helper()
	for i := 0; i < n; i++ {
		select {
		case <-g.arrived:
		case <-time.After(10 * time.Second):
			t.Fatalf("only %d of %d table loads started concurrently", i, n)
		}
	}
}

// TestCacheParallelMisses: misses on different L2 tables load in parallel
// (the lock is not held across the read), and concurrent misses on one
// table load it once.
func TestCacheParallelMisses(t *testing.T) {
	path := filepath.Join(t.TempDir(), "p.qcow2")
	// 64 KiB clusters: one L2 table maps 512 MiB; 8 tables.
	if err := Create(path, CreateOptions{Size: 4 << 30, Preallocation: PreallocMetadata}); err != nil {
		t.Fatal(err)
	}
	img, g := openGated(t, path, Options{ReadOnly: true})
	defer img.Close()
	const tables = 8
	for i := 0; i < tables; i++ {
		g.gate[int64(img.l1[i]&l1OffsetMask)] = true
	}

	var wg sync.WaitGroup
	read := func(off int64) {
		defer wg.Done()
		buf := make([]byte, 4096)
		if _, err := img.ReadAt(ctx, buf, off); err != nil {
			t.Error(err)
		}
	}
	for i := 0; i < tables; i++ {
		wg.Add(1)
		go read(int64(i) << 29)
	}
	waitArrivals(t, g, tables)
	close(g.release)
	wg.Wait()
	if g.peak != tables {
		t.Fatalf("peak concurrent loads %d, want %d", g.peak, tables)
	}
	l2, _ := img.CacheStats()
	if l2.MaxLoading != tables {
		t.Fatalf("cache saw at most %d loads in flight, want %d", l2.MaxLoading, tables)
	}

	// Same table from many readers: one load.
	img2, g2 := openGated(t, path, Options{ReadOnly: true})
	defer img2.Close()
	off := int64(img2.l1[3] & l1OffsetMask)
	g2.gate[off] = true
	for i := 0; i < 16; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			buf := make([]byte, 4096)
			if _, err := img2.ReadAt(ctx, buf, 3<<29+int64(i)<<20); err != nil {
				t.Error(err)
			}
		}(i)
	}
	waitArrivals(t, g2, 1)
	// Give the other readers time to pile up behind the first load.
	time.Sleep(100 * time.Millisecond)
	close(g2.release)
	wg.Wait()
	if n := g2.reads[off]; n != 1 {
		t.Fatalf("table at %#x read %d times, want once", off, n)
	}
	if l2, _ := img2.CacheStats(); l2.Loads != 1 {
		t.Fatalf("%d loads, want 1", l2.Loads)
	}
}

// TestCacheBounded sweeps reads over a disk with many more L2 tables than
// the cache holds; the cache never holds more than its capacity.
func TestCacheBounded(t *testing.T) {
	for _, policy := range []string{PolicyLRU, PolicyHitCount, PolicyHitCountFloor} {
		t.Run(policy, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "b.qcow2")
			// 4 KiB clusters: one L2 table maps 2 MiB; 512 tables.
			if err := Create(path, CreateOptions{Size: 1 << 30, ClusterSize: 4096, Preallocation: PreallocMetadata}); err != nil {
				t.Fatal(err)
			}
			img, err := Open(path, Options{ReadOnly: true, L2CacheSize: 16 * 4096, L2CachePolicy: policy})
			if err != nil {
				t.Fatal(err)
			}
			defer img.Close()
			var wg sync.WaitGroup
			for w := 0; w < 8; w++ {
				wg.Add(1)
				go func(w int) {
					defer wg.Done()
					buf := make([]byte, 512)
					for off := int64(w) << 21; off < img.Size(); off += 8 << 21 {
						if _, err := img.ReadAt(ctx, buf, off); err != nil {
							t.Error(err)
							return
						}
						img.mu.Lock()
						n := len(img.l2.entries)
						img.mu.Unlock()
						// Each of the 8 readers may pin one table beyond
						// the capacity while its load is in flight.
						if n > 16+8 {
							t.Errorf("cache holds %d entries, capacity 16", n)
							return
						}
					}
				}(w)
			}
			wg.Wait()
			l2, _ := img.CacheStats()
			if l2.Entries > l2.Capacity {
				t.Fatalf("after the sweep the cache holds %d entries, capacity %d", l2.Entries, l2.Capacity)
			}
			if l2.Misses < 512 || l2.Evictions < 512-16 {
				t.Fatalf("stats %+v: expected a miss per table and evictions", l2)
			}
		})
	}
}

// TestHitCountPolicyShape checks the policies on a deterministic cyclic
// access pattern over N tables with a cache of N entries: LRU and the
// floored hit count keep everything after warm-up; QEMU's original hit
// count keeps replacing its first slots and never warms up.
func TestHitCountPolicyShape(t *testing.T) {
	const n = 8
	run := func(policy string) (misses uint64) {
		c := newTableCache("t", nil, 8, n, policy, &sync.Mutex{})
		for round := 0; round < 50; round++ {
			for i := uint64(0); i < n; i++ {
				if _, err := c.peekLocked(i * 8); err != nil {
					c.stats.Misses++
					c.makeRoomLocked()
					c.addLocked(&cacheEntry{off: i * 8, buf: make([]byte, 8)})
				}
			}
		}
		return c.stats.Misses
	}
	lru, floor, orig := run(PolicyLRU), run(PolicyHitCountFloor), run(PolicyHitCount)
	if lru != n || floor != n {
		t.Fatalf("lru %d, hitcount-floor %d misses; want %d (cold misses only)", lru, floor, n)
	}
	if orig < 10*n {
		t.Fatalf("original hitcount had %d misses; expected it to keep missing", orig)
	}
}
