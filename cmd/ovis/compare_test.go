package main

import (
	"strings"
	"testing"
)

// TestCompareMatchesQemu compares pairs of images with both tools and
// requires the same messages and exit codes: identical images of
// different formats and layouts, content and allocation differences
// (strict mode), images of different sizes with and without data past
// the smaller one's end, chains, progress output and failures.
func TestCompareMatchesQemu(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	for _, s := range []step{
		run("qemu-img", "create", "-q", "-f", "qcow2", "a.qcow2", "64M"),
		run("qemu-io", "-f", "qcow2", "-c", "write -P 1 0 1M", "-c", "write -z 2M 1M", "-c", "write -c -P 2 8M 64k", "a.qcow2"),
		run("qemu-img", "convert", "-O", "raw", "a.qcow2", "a.raw"),
		run("qemu-img", "convert", "-O", "qcow2", "-o", "cluster_size=4k", "a.raw", "b.qcow2"),
		run("qemu-img", "convert", "-c", "-O", "qcow2", "a.raw", "c.qcow2"),
		// One byte changed inside the data, one past it.
		run("cp", "a.raw", "d1.raw"),
		run("qemu-io", "-f", "raw", "-c", "write -P 9 700000 1", "d1.raw"),
		run("cp", "a.raw", "d2.raw"),
		run("qemu-io", "-f", "raw", "-c", "write -P 1 3000000 1", "d2.raw"),
		// Larger images: zeros past 64M, data past 64M, data inside.
		run("qemu-img", "create", "-q", "-f", "raw", "big0.raw", "65M"),
		run("qemu-io", "-f", "raw", "-c", "write -P 1 0 1M", "-c", "write -P 2 8M 64k", "big0.raw"),
		run("cp", "big0.raw", "big1.raw"),
		run("qemu-io", "-f", "raw", "-c", "write -P 3 67109000 10", "big1.raw"),
		run("qemu-img", "create", "-q", "-f", "qcow2", "big2.qcow2", "65M"),
		run("qemu-io", "-f", "qcow2", "-c", "write -P 1 0 1M", "-c", "write -P 2 8M 64k", "-c", "write -z 64M 1M", "big2.qcow2"),
		// A chain that reads as a.raw.
		run("qemu-img", "create", "-q", "-f", "raw", "base.raw", "64M"),
		run("qemu-io", "-f", "raw", "-c", "write -P 1 0 512k", "-c", "write -P 7 8M 64k", "base.raw"),
		run("qemu-img", "create", "-q", "-f", "qcow2", "-b", "base.raw", "-F", "raw", "top.qcow2"),
		run("qemu-io", "-f", "qcow2", "-c", "write -P 1 512k 512k", "-c", "write -P 2 8M 64k", "top.qcow2"),
		run("qemu-img", "create", "-q", "-f", "qcow2", "empty.qcow2", "64M"),
		run("qemu-img", "create", "-q", "-f", "raw", "empty.raw", "64M"),
	} {
		s(t, dir)
	}
	warmDir(t, dir)
	for _, a := range []string{
		"a.qcow2 a.raw", "a.raw a.qcow2", "a.qcow2 b.qcow2", "a.qcow2 c.qcow2", "b.qcow2 c.qcow2",
		"-s a.qcow2 a.raw", "-s a.qcow2 b.qcow2", "-s a.raw a.raw", "-s a.qcow2 a.qcow2", "-s empty.qcow2 empty.raw",
		"a.qcow2 d1.raw", "d1.raw a.qcow2", "a.qcow2 d2.raw", "d2.raw a.raw", "-q a.qcow2 d1.raw",
		"a.qcow2 big0.raw", "big0.raw a.qcow2", "a.qcow2 big1.raw", "big1.raw a.raw", "-s a.qcow2 big0.raw",
		"a.qcow2 big2.qcow2", "big2.qcow2 big0.raw", "-s big2.qcow2 big0.raw",
		"top.qcow2 a.raw", "top.qcow2 a.qcow2", "-s top.qcow2 a.qcow2", "base.raw top.qcow2",
		"empty.qcow2 empty.raw", "empty.raw a.raw",
		"-p a.qcow2 a.raw", "-p a.qcow2 d2.raw", "-p -q a.qcow2 a.raw", "-p a.qcow2 big1.raw",
		"-f raw -F qcow2 a.raw a.qcow2", "-f qcow2 a.raw a.qcow2", "-F raw a.qcow2 a.qcow2", "-f foo a.raw a.raw",
		"nonexist a.raw", "a.raw nonexist", "a.raw", "a.raw a.raw a.raw", "-U a.raw a.raw",
	} {
		args := append([]string{"compare"}, strings.Fields(a)...)
		sameResult(t, a, qemuImg(t, dir, args...), ovisImg(t, dir, args...))
	}
}
