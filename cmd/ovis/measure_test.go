package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestMeasureMatchesQemu measures many sources for many output options
// with both tools and requires the same figures (JSON and human) and the
// same errors: qcow2 sources of several layouts, with zero and compressed
// clusters, bitmaps and backing files; raw files, holes and a partial
// last sector; and --size alone.
func TestMeasureMatchesQemu(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	data := []string{"-c", "write -P 1 0 1M", "-c", "write -z 4M 1M", "-c", "write -P 3 10000000 1000", "-c", "write -P 4 60M 3M"}
	for _, s := range []step{
		run("qemu-img", "create", "-q", "-f", "qcow2", "a.qcow2", "64M"),
		run("qemu-io", append(append([]string{"-f", "qcow2"}, data...), "-c", "write -c -P 2 8M 64k", "a.qcow2")...),
		run("qemu-img", "convert", "-O", "raw", "a.qcow2", "a.raw"),
		run("qemu-img", "create", "-q", "-f", "qcow2", "-o", "compat=0.10,cluster_size=4k", "v2.qcow2", "10M"),
		run("qemu-io", "-f", "qcow2", "-c", "write -P 1 1M 1M", "v2.qcow2"),
		run("cp", "a.qcow2", "bm.qcow2"),
		run("qemu-img", "bitmap", "--add", "bm.qcow2", "b0"),
		run("qemu-img", "bitmap", "--add", "-g", "4k", "bm.qcow2", "bitmap-with-a-longer-name"),
		run("qemu-img", "create", "-q", "-f", "qcow2", "-b", "a.raw", "-F", "raw", "top.qcow2", "100M"),
		run("qemu-io", "-f", "qcow2", "-c", "write -P 5 70M 1M", "top.qcow2"),
		run("qemu-img", "create", "-q", "-f", "qcow2", "-o", "cluster_size=2M,extended_l2=on", "big.qcow2", "3G"),
		run("qemu-io", "-f", "qcow2", "-c", "write -P 1 1G 3M", "big.qcow2"),
		run("qemu-img", "create", "-q", "-f", "qcow2", "empty.qcow2", "1T"),
		run("qemu-img", "create", "-q", "-f", "qcow2", "snap.qcow2", "64M"),
		run("qemu-io", "-f", "qcow2", "-c", "write -P 1 0 1M", "snap.qcow2"),
		run("qemu-img", "snapshot", "-c", "s1", "snap.qcow2"),
		run("qemu-io", "-f", "qcow2", "-c", "write -P 2 8M 3M", "-c", "write -z 0 512k", "snap.qcow2"),
	} {
		s(t, dir)
	}
	if err := os.WriteFile(filepath.Join(dir, "odd.raw"), []byte(strings.Repeat("x", 1001)), 0o644); err != nil {
		t.Fatal(err)
	}
	warmDir(t, dir)
	sources := []string{"a.qcow2", "a.raw", "v2.qcow2", "bm.qcow2", "top.qcow2", "big.qcow2", "empty.qcow2", "odd.raw", "-f raw a.qcow2"}
	outputs := []string{
		"", "-O raw", "-O qcow2", "-O qcow2 -o cluster_size=512", "-O qcow2 -o cluster_size=4k,refcount_bits=1",
		"-O qcow2 -o cluster_size=2M,refcount_bits=64", "-O qcow2 -o extended_l2=on,cluster_size=32k",
		"-O qcow2 -o compat=0.10", "-O qcow2 -o preallocation=full", "-O qcow2 -o preallocation=metadata",
		"-O qcow2 -o backing_file=x.qcow2", "-O qcow2 -o size=5G",
	}
	measure := func(a string) {
		t.Helper()
		args := append([]string{"measure"}, strings.Fields(a)...)
		sameResult(t, a, qemuImg(t, dir, args...), ovisImg(t, dir, args...))
	}
	// Every source with a third of the outputs, a different third for
	// each source, so that every pair of kinds meets across sources.
	for s, src := range sources {
		for i, out := range outputs {
			if (i+s)%3 != 0 {
				continue
			}
			measure("--output=json " + out + " " + src)
			if i%4 == 0 {
				measure(out + " " + src)
			}
		}
	}
	for _, a := range []string{
		"--size 1G", "--size 1G -O qcow2", "--size 1000 -O raw", "--size 0 -O qcow2", "--size 100T -O qcow2",
		"--size 8E -O qcow2 -o cluster_size=2M", "--size 1G -O qcow2 -o cluster_size=4k,extended_l2=on",
		"--size 1000 -O qcow2 -o size=5G", "--output=json --size 3T -O qcow2 -o refcount_bits=16,cluster_size=1M",
		// Errors.
		"", "--size 1G a.qcow2", "a.qcow2 a.raw", "--size 1X", "--size -1", "-O qcow2 -o cluster_size=512 --size 100T",
		"-O qcow2 -o help", "-O qcow2 -o help a.qcow2", "-O foo --size 1G", "-O qcow2 -o foo=bar --size 1G",
		"-O qcow2 -o preallocation=foo a.qcow2", "-O qcow2 -o compat=0.11 a.qcow2", "-O qcow2 -o compat=v2 --size 1G",
		"-O qcow2 -o cluster_size=3k a.qcow2", "-O qcow2 -o refcount_bits=3 a.qcow2",
		"-O qcow2 -o compat=0.10,refcount_bits=8 a.qcow2", "-O qcow2 -o extended_l2=on,cluster_size=4k a.qcow2",
		"-O qcow2 -o extended_l2=foo --size 1G", "-O raw -o preallocation=foo a.qcow2", "-O raw -o cluster_size=4k a.qcow2",
		"-f raw --size 1000", "--output=foo --size 1G", "nonexist", "-f qcow2 a.raw",
		// Internal snapshots (-l), which hold less than the image.
		"-O qcow2 snap.qcow2", "-O qcow2 -l s1 snap.qcow2", "--output=json -O raw -l 1 snap.qcow2",
		"-O qcow2 -l snapshot.name=s1 snap.qcow2", "-O qcow2 -l snapshot.id=1,snapshot.name=s1 snap.qcow2",
		"-l nosuch snap.qcow2", "-l snapshot.id=2 snap.qcow2", "-l s1 a.raw", "-l s1", "-l snapshot.x=1 snap.qcow2",
	} {
		measure(a)
	}
}
