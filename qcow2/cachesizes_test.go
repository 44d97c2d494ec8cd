package qcow2

import "testing"

// TestCacheSizes follows QEMU's read_cache_sizes: the L2 cache covers the
// disk up to 32 MiB by default, never holds more than all tables, and a
// cache that cannot cover the disk defaults to 4 KiB entries.
func TestCacheSizes(t *testing.T) {
	const (
		k = int64(1) << 10
		m = k << 10
		g = m << 10
	)
	tests := []struct {
		name             string
		o                Options
		cluster, size    int64
		entries          int
		entrySize        int64
		refcountClusters int
	}{
		// 40 GiB of 64 KiB clusters: 80 tables, 5 MiB in all.
		{"default covers the disk", Options{}, 64 * k, 40 * g, 80, 64 * k, 4},
		{"exactly the disk", Options{L2CacheSize: 80 * 64 * k}, 64 * k, 40 * g, 80, 64 * k, 4},
		{"more than the disk", Options{L2CacheSize: 1 * g}, 64 * k, 40 * g, 80, 64 * k, 4},
		{"too small: 4 KiB entries", Options{L2CacheSize: 78 * 64 * k}, 64 * k, 40 * g, 78 * 16, 4 * k, 4},
		{"too small, entry size given", Options{L2CacheSize: 16 * 64 * k, L2CacheEntrySize: 64 * k}, 64 * k, 40 * g, 16, 64 * k, 4},
		{"too small, smaller entry given", Options{L2CacheSize: 16 * 64 * k, L2CacheEntrySize: 1 * k}, 64 * k, 40 * g, 1024, 1 * k, 4},
		// 1 TiB: 2048 tables, 128 MiB; the default 32 MiB falls short.
		{"default short of a big disk", Options{}, 64 * k, 1 << 40, 8192, 4 * k, 4},
		{"clusters under 4 KiB", Options{L2CacheSize: 4 * k}, 512, 1 * g, 8, 512, 4},
		// The refcount cache takes its minimum, four clusters; L2 the rest.
		{"cache-size split, short", Options{CacheSize: 2 * m}, 64 * k, 40 * g, 448, 4 * k, 4},
		{"cache-size split, enough", Options{CacheSize: 8 * m}, 64 * k, 40 * g, 80, 64 * k, 48},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			n, es, rc, err := tt.o.cacheSizes(tt.cluster, tt.size, 8)
			if err != nil {
				t.Fatal(err)
			}
			if n != tt.entries || es != tt.entrySize || rc != tt.refcountClusters {
				t.Fatalf("cacheSizes = %d entries of %d bytes, %d refcount clusters; want %d of %d, %d",
					n, es, rc, tt.entries, tt.entrySize, tt.refcountClusters)
			}
		})
	}
}
