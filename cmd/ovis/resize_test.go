package main

import (
	"strings"
	"testing"
)

// TestResizeMatchesQemu runs the same resize sequences with both tools
// on twin images, qcow2 of several layouts and raw, and requires the
// same messages and exit codes at every step and images that read, check
// and are described alike at the end. The sequences grow (with every
// preallocation mode), shrink (refused without --shrink), and fail.
func TestResizeMatchesQemu(t *testing.T) {
	seqQcow2 := []string{
		"a.qcow2 +1M", "a.qcow2 -1M", "--shrink a.qcow2 -1M", "a.qcow2 1000", "--shrink a.qcow2 1000000",
		"--preallocation=metadata a.qcow2 +3M", "--preallocation=falloc a.qcow2 +1M", "--preallocation=full a.qcow2 +2M",
		"--preallocation=full a.qcow2 1M", "--preallocation=foo a.qcow2 +1M", "a.qcow2 0", "a.qcow2 -- -100G",
		"a.qcow2 1X", "a.qcow2 +", "a.qcow2", "a.qcow2 18E", "a.qcow2 8E", "-q a.qcow2 +1M",
		"--shrink a.qcow2 30M", "--shrink -q a.qcow2 5M", "a.qcow2 3G", "-f qcow2 a.qcow2 +64k", "nonexist +1M",
	}
	seqRaw := []string{
		"a.raw 1000", "--shrink a.raw 1000", "-f raw a.raw 1001", "-f raw a.raw +1001",
		"--preallocation=full -f raw a.raw +1M", "--preallocation=falloc -f raw a.raw +1M",
		"--preallocation=metadata -f raw a.raw +1M", "-f raw a.raw 10M", "--shrink -f raw a.raw 3M",
	}
	tests := []struct {
		name, create string
		seq          []string
		snapshot     bool // take a snapshot after the first writes, then write more
	}{
		{"qcow2", "-f qcow2 a.qcow2 64M", seqQcow2, false},
		{"qcow2 4k clusters", "-f qcow2 -o cluster_size=4k a.qcow2 64M", seqQcow2[:9], false},
		{"qcow2 v2", "-f qcow2 -o compat=0.10 a.qcow2 64M", seqQcow2[:9], false},
		{"qcow2 extended l2", "-f qcow2 -o extended_l2=on a.qcow2 64M", seqQcow2, false},
		{"qcow2 data file", "-f qcow2 -o data_file=a.data a.qcow2 64M", seqQcow2[:9], false},
		{"raw", "-f raw a.raw 64M", seqRaw, false},
		{"qcow2 with a snapshot", "-f qcow2 a.qcow2 64M", seqQcow2, true},
		{"qcow2 v2 with a snapshot", "-f qcow2 -o compat=0.10 a.qcow2 64M", seqQcow2[:9], true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			name := imageArg(strings.Fields(tt.create))
			format := "qcow2"
			if strings.HasSuffix(name, ".raw") {
				format = "raw"
			}
			steps := []step{run("qemu-io", "-f", format, "-c", "write -P 1 0 1M", "-c", "write -P 2 30M 2M", "-c", "write -P 3 63M 1M", name)}
			if tt.snapshot {
				steps = append(steps, run("qemu-img", "snapshot", "-c", "s1", name),
					run("qemu-io", "-f", format, "-c", "write -P 4 30M 1M", "-c", "write -P 5 63M 64k", name))
			}
			qdir, odir := twinDirs(t, qemuCreateStep(tt.create, steps...))
			for _, a := range tt.seq {
				bothRun(t, qdir, odir, append([]string{"resize"}, strings.Fields(a)...))
			}
			sameImages(t, qdir, odir, name)
			if tt.snapshot {
				// The snapshot keeps its size and data in both.
				for _, dir := range []string{qdir, odir} {
					run("qemu-img", "snapshot", "-a", "s1", name)(t, dir)
				}
				sameImages(t, qdir, odir, name)
			}
		})
	}
}
