package main

import (
	"fmt"
	"math/rand"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// rssKiB reads a process's resident set size.
func rssKiB(t *testing.T, pid int) int64 {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.Fields(l); len(f) >= 2 && f[0] == "VmRSS:" {
			n, _ := strconv.ParseInt(f[1], 10, 64)
			return n
		}
	}
	t.Fatal("no VmRSS")
	return 0
}

// TestNBDCacheMemoryBounded: `ovis nbd` with a 1 MiB L2 cache on a 1 TiB
// image whose metadata is fully allocated (2048 L2 tables, 128 MiB of
// them) keeps its resident memory bounded while reads sweep every table.
func TestNBDCacheMemoryBounded(t *testing.T) {
	dir := shortTempDir(t)
	img := filepath.Join(dir, "big.qcow2")
	runTool(t, "qemu-img", "create", "-f", "qcow2", "-o", "preallocation=metadata", img, "1T")
	bounded := sweepRSS(t, img, "1M")
	if bounded > 48<<10 {
		t.Fatalf("RSS grew by %d KiB while sweeping 128 MiB of L2 tables through a 1 MiB cache", bounded)
	}
	// Control: with a cache that holds every table the same sweep must
	// grow the process by roughly the metadata, or the measurement above
	// proves nothing.
	if whole := sweepRSS(t, img, "128M"); whole < 64<<10 {
		t.Fatalf("with a 128 MiB cache RSS grew by only %d KiB: the sweep does not load the tables", whole)
	}
}

// sweepRSS serves img with the given L2 cache size, reads two places of
// every L2 table's range, and returns how much the server's RSS grew.
func sweepRSS(t *testing.T, img, cache string) int64 {
	s := startNBD(t, nbdRun{args: []string{"-t", "-f", "qcow2", "--cache=none", "--l2-cache-size=" + cache, img}})
	pid := s.cmd.Process.Pid
	before := rssKiB(t, pid)
	rng := rand.New(rand.NewSource(1))
	const table = 512 << 20 // guest bytes one L2 table maps
	var cmds []string
	for i := int64(0); i < (1<<40)/table; i++ {
		// Two reads per table at random places: two different slices.
		for k := 0; k < 2; k++ {
			off := i*table + rng.Int63n(table/4096)*4096
			cmds = append(cmds, fmt.Sprintf("read %d 4k", off))
		}
	}
	var peak int64
	for len(cmds) > 0 {
		n := min(len(cmds), 512)
		qemuIONBD(t, s.uri, cmds[:n]...)
		cmds = cmds[n:]
		peak = max(peak, rssKiB(t, pid))
	}
	t.Logf("l2-cache-size=%s: RSS before the sweep %d KiB, peak during it %d KiB", cache, before, peak)
	s.stop(15)
	return peak - before
}
