package qcow2

import (
	"path/filepath"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

func TestCollector(t *testing.T) {
	p := filepath.Join(t.TempDir(), "m.qcow2")
	if err := Create(p, CreateOptions{Size: 1 << 30, ClusterSize: 4096, Preallocation: PreallocMetadata}); err != nil {
		t.Fatal(err)
	}
	img, err := Open(p, Options{ReadOnly: true, L2CacheSize: 4 * 4096})
	if err != nil {
		t.Fatal(err)
	}
	defer img.Close()
	buf := make([]byte, 512)
	// 8 tables, twice each, through a cache of 4: 16 misses.
	for r := 0; r < 2; r++ {
		for i := int64(0); i < 8; i++ {
			if _, err := img.ReadAt(ctx, buf, i<<21); err != nil {
				t.Fatal(err)
			}
		}
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(NewCollector(img, "m"))
	want := `
# HELP ovis_qcow2_cache_misses_total Lookups that had to read a table.
# TYPE ovis_qcow2_cache_misses_total counter
ovis_qcow2_cache_misses_total{cache="l2",image="m"} 16
ovis_qcow2_cache_misses_total{cache="refcount",image="m"} 0
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "ovis_qcow2_cache_misses_total"); err != nil {
		t.Fatal(err)
	}
}
