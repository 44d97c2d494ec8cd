package main

import (
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// mapVariants are images with data in every kind of place: data, zero
// and compressed clusters, partial clusters, backing chains (qcow2 and
// raw, longer and shorter than the top), every layout option, raw files
// with holes and a partial last sector. Each returns the image to map.
func mapVariants() []imageVariant {
	write := func(img, format string, cmds ...string) step {
		args := []string{"-f", format}
		for _, c := range cmds {
			args = append(args, "-c", c)
		}
		return run("qemu-io", append(args, img)...)
	}
	data := func(opts string) func(t *testing.T, dir string) string {
		args := "-f qcow2 a.qcow2 64M"
		if opts != "" {
			args = "-f qcow2 -o " + opts + " a.qcow2 64M"
		}
		cmds := []string{"write -P 1 0 1M", "write -P 2 1500000 70000", "write -z 3M 1M",
			"write -P 0 9M 64k", "write -P 4 40000000 5", "write -P 5 67108352 512"}
		if !strings.Contains(opts, "data_file") && !strings.Contains(opts, "2M") {
			cmds = append(cmds, "write -c -P 3 8M 64k")
		}
		return qemuCreate(args, write("a.qcow2", "qcow2", cmds...))
	}
	return []imageVariant{
		{"v3", data("")},
		{"v2", data("compat=0.10")},
		{"4k clusters", data("cluster_size=4k")},
		{"512 clusters", data("cluster_size=512")},
		{"2M clusters", data("cluster_size=2M")},
		{"extended l2", data("extended_l2=on")},
		{"extended l2 32k", data("extended_l2=on,cluster_size=32k")},
		{"extended l2 over backing", after(qemuCreate("-f qcow2 -o extended_l2=on -b base.qcow2 -F qcow2 a.qcow2 64M",
			write("a.qcow2", "qcow2", "write -P 2 36k 4k", "write -P 2 1M 8k", "write -z 40M 4k")),
			run("qemu-img", "create", "-q", "-f", "qcow2", "base.qcow2", "32M"),
			write("base.qcow2", "qcow2", "write -P 1 0 2M"))},
		{"zstd", data("compression_type=zstd")},
		{"refcount bits 1", data("refcount_bits=1")},
		{"lazy refcounts", data("lazy_refcounts=on")},
		{"data file", data("data_file=a.data")},
		{"prealloc metadata", qemuCreate("-f qcow2 -o preallocation=metadata a.qcow2 16M",
			write("a.qcow2", "qcow2", "write -P 1 1M 1M"))},
		{"prealloc full", qemuCreate("-f qcow2 -o preallocation=full a.qcow2 8M",
			write("a.qcow2", "qcow2", "write -P 1 1M 1M"))},
		{"empty", qemuCreate("-f qcow2 a.qcow2 1G")},
		{"raw", qemuCreate("-f raw a.raw 64M", write("a.raw", "raw",
			"write -P 1 0 1M", "write -P 2 1500000 70000", "write -P 3 60M 4k"))},
		{"raw odd size", func(t *testing.T, dir string) string {
			t.Helper()
			if err := os.WriteFile(filepath.Join(dir, "a.raw"), []byte(strings.Repeat("x", 1001)), 0o644); err != nil {
				t.Fatal(err)
			}
			return "a.raw"
		}},
		{"backing raw", after(qemuCreate("-f qcow2 -b base.raw -F raw a.qcow2",
			write("a.qcow2", "qcow2", "write -P 2 1M 1M", "write -z 3M 1M", "write -c -P 3 10M 64k")),
			run("qemu-img", "create", "-q", "-f", "raw", "base.raw", "64M"),
			write("base.raw", "raw", "write -P 1 0 8M"))},
		{"backing shorter than top", after(qemuCreate("-f qcow2 -b base.qcow2 -F qcow2 a.qcow2 64M",
			write("a.qcow2", "qcow2", "write -P 2 30M 1M")),
			run("qemu-img", "create", "-q", "-f", "qcow2", "base.qcow2", "32M"),
			write("base.qcow2", "qcow2", "write -P 1 0 1M", "write -P 1 31M 1M"))},
		{"three-deep chain", after(qemuCreate("-f qcow2 -b mid.qcow2 -F qcow2 a.qcow2",
			write("a.qcow2", "qcow2", "write -P 3 5M 2M", "write -z 1M 512k")),
			run("qemu-img", "create", "-q", "-f", "raw", "base.raw", "16M"),
			write("base.raw", "raw", "write -P 1 0 4M"),
			run("qemu-img", "create", "-q", "-f", "qcow2", "-b", "base.raw", "-F", "raw", "mid.qcow2"),
			write("mid.qcow2", "qcow2", "write -P 2 2M 4M", "write -z 9M 100k"))},
		{"chain in a subfolder", func(t *testing.T, dir string) string {
			t.Helper()
			if err := os.Mkdir(filepath.Join(dir, "sub"), 0o755); err != nil {
				t.Fatal(err)
			}
			run("qemu-img", "create", "-q", "-f", "qcow2", "sub/base.qcow2", "16M")(t, dir)
			write("sub/base.qcow2", "qcow2", "write -P 1 0 2M")(t, dir)
			run("qemu-img", "create", "-q", "-f", "qcow2", "-b", "base.qcow2", "-F", "qcow2", "sub/a.qcow2")(t, dir)
			write("sub/a.qcow2", "qcow2", "write -P 2 1M 64k")(t, dir)
			return "sub/a.qcow2"
		}},
	}
}

// TestMapMatchesQemu maps every variant with both tools, as JSON and as
// the human table, whole and in windows, and requires the same bytes and
// exit codes (the human table fails alike on compressed clusters).
func TestMapMatchesQemu(t *testing.T) {
	// Each window is mapped as JSON, and the whole image and one window
	// as the human table too.
	windows := [][]string{
		nil,
		{"--start-offset", "1000", "--max-length", "3M"},
		{"--max-length", "1500001"},
		{"--start-offset", "8M", "--max-length", "64k"},
		{"--start-offset", "100M"},
	}
	for _, v := range mapVariants() {
		t.Run(v.name, func(t *testing.T) {
			t.Parallel()
			dir := t.TempDir()
			name := v.build(t, dir)
			// QEMU zeroes the untouched part of a new cluster with
			// fallocate, whose unwritten extents ext4 reports as holes
			// only while none of their pages is cached: the first map
			// (its readahead) would change what the second sees. Read
			// every file first so that both see the same.
			warmDir(t, dir)
			for i, w := range windows {
				for _, out := range []string{"json", "human"} {
					if out == "human" && i > 1 {
						continue
					}
					args := append(append([]string{"map", "--output=" + out}, w...), name)
					sameResult(t, strings.Join(args, " "), qemuImg(t, dir, args...), ovisImg(t, dir, args...))
				}
			}
			args := []string{"map", "-f", "raw", "--output=json", name}
			sameResult(t, strings.Join(args, " "), qemuImg(t, dir, args...), ovisImg(t, dir, args...))
		})
	}
}

// TestMapErrorsMatchQemu compares map's refusals.
func TestMapErrorsMatchQemu(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	qemuCreate("-f qcow2 a.qcow2 1M")(t, dir)
	for _, a := range []string{
		"map", "map a.qcow2 a.qcow2", "map nonexist", "map --output=xml a.qcow2",
		"map --start-offset 1X a.qcow2", "map --max-length -5 a.qcow2", "map -f foo a.qcow2",
	} {
		args := strings.Fields(a)
		sameResult(t, a, qemuImg(t, dir, args...), ovisImg(t, dir, args...))
	}
}

// warmDir syncs and reads every file under dir.
func warmDir(t *testing.T, dir string) {
	t.Helper()
	err := filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error {
		if err != nil || !d.Type().IsRegular() {
			return err
		}
		f, err := os.OpenFile(p, os.O_RDWR, 0)
		if err != nil {
			return err
		}
		defer f.Close()
		if err := f.Sync(); err != nil {
			return err
		}
		_, err = io.Copy(io.Discard, f)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
}
