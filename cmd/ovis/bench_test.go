package main

import (
	"regexp"
	"strings"
	"testing"
)

var (
	// runTimeRE matches the duration of a bench run.
	runTimeRE = regexp.MustCompile(`(Run completed in )[0-9.]+`)
	// cacheLineRE matches the cache counters ovis adds to bench's output.
	cacheLineRE = regexp.MustCompile(`(?m)^(L2|Refcount) cache: \d+ hits, \d+ misses, \d+ evictions, \d+ writebacks\n`)
)

// TestBenchMatchesQemu runs short benchmarks with both tools on twin
// images and requires the same lines (but for the time taken and the
// cache counters ovis adds), the same errors, and images that read alike
// after write runs.
func TestBenchMatchesQemu(t *testing.T) {
	t.Parallel()
	qdir, odir := twinDirs(t, func(t *testing.T, dir string) {
		qemuCreate("-f qcow2 a.qcow2 64M")(t, dir)
		qemuCreate("-f raw r.raw 64M")(t, dir)
	})
	for _, a := range []string{
		"-c 1000 -d 4 a.qcow2", "-c 200 -w -s 64k -S 128k -o 1M --pattern=0x5a a.qcow2",
		"-c 100 -w --flush-interval=10 -d 4 a.qcow2", "-c 100 -w --no-drain --flush-interval=64 a.qcow2",
		"-c 0x10 -t none -n a.qcow2", "-c 50 -w -t writethrough -s 1k -f raw r.raw", "-c 300 -s 1M -S 3M r.raw",
		"-c 10 -s 0 a.qcow2", "-c 10 -S 0 -s 1k a.qcow2", "-c 0 a.qcow2", "-c 20 -w -o 63M -s 2M a.qcow2",
		"--flush-interval=10 a.qcow2", "-w --flush-interval=2 a.qcow2", "-c -1 a.qcow2", "-c 10 -t foo a.qcow2",
		"-c 10 -s 1X a.qcow2", "-c 10 -o 1X a.qcow2", "--pattern=256 a.qcow2", "-c 3 -o 70M a.qcow2",
		"nonexist", "a.qcow2 r.raw",
	} {
		args := append([]string{"bench"}, strings.Fields(a)...)
		q := qemuImg(t, qdir, args...)
		o := ovisImg(t, odir, args...)
		if o.code == 0 && strings.HasSuffix(a, ".qcow2") && len(cacheLineRE.FindAllString(o.stdout, -1)) != 2 {
			t.Errorf("bench %s: no cache counters in %q", a, o.stdout)
		}
		o.stdout = cacheLineRE.ReplaceAllString(o.stdout, "")
		for _, r := range []*result{&q, &o} {
			r.stdout = runTimeRE.ReplaceAllString(r.stdout, "${1}X")
		}
		sameResult(t, a, q, o)
	}
	sameImages(t, qdir, odir, "a.qcow2", "r.raw")
}
