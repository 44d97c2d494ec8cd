package main

import (
	"encoding/json"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/ovis-storage/ovis/internal/testutil"
)

// createFixtures makes the files create cases refer to: backing images and
// a subfolder.
func createFixtures(t *testing.T, dir string) {
	t.Helper()
	testutil.QemuImg(t, "create", "-q", "-f", "qcow2", filepath.Join(dir, "base.qcow2"), "64M")
	testutil.QemuImg(t, "create", "-q", "-f", "raw", filepath.Join(dir, "base.raw"), "32M")
	if err := os.Mkdir(filepath.Join(dir, "sub"), 0o755); err != nil {
		t.Fatal(err)
	}
}

// TestCreateMatchesQemu runs qemu-img create and ovis img create with the
// same arguments in twin folders and requires the same output, messages and
// exit code, and images that qemu-img describes alike and checks clean.
func TestCreateMatchesQemu(t *testing.T) {
	tests := []struct {
		name string
		args string // split on spaces
	}{
		{"default qcow2", "-f qcow2 x.qcow2 1G"},
		{"default format is raw", "x.img 10M"},
		{"raw sparse", "-f raw x.raw 10M"},
		{"raw falloc", "-f raw -o preallocation=falloc x.raw 10M"},
		{"raw full", "-f raw -o preallocation=full x.raw 1M"},
		{"raw size rounds up", "-f raw x.raw 1331"},
		{"compat 0.10", "-f qcow2 -o compat=0.10 x.qcow2 1G"},
		{"compat v2", "-f qcow2 -o compat=v2 x.qcow2 1G"},
		{"compat v3", "-f qcow2 -o compat=v3 x.qcow2 1G"},
		{"compat 1.1", "-f qcow2 -o compat=1.1 x.qcow2 1G"},
		{"small clusters", "-f qcow2 -o cluster_size=4k,refcount_bits=8,lazy_refcounts=on x.qcow2 1.5G"},
		{"512-byte clusters", "-f qcow2 -o cluster_size=512,refcount_bits=64 x.qcow2 100M"},
		{"2M clusters 1-bit refcounts", "-f qcow2 -o cluster_size=2M,refcount_bits=1 x.qcow2 3T"},
		{"extended l2 zstd", "-f qcow2 -o extended_l2=on,compression_type=zstd x.qcow2 100M"},
		{"prealloc metadata", "-f qcow2 -o preallocation=metadata x.qcow2 10M"},
		{"prealloc falloc", "-f qcow2 -o preallocation=falloc x.qcow2 10M"},
		{"prealloc full", "-f qcow2 -o preallocation=full x.qcow2 4M"},
		{"data file", "-f qcow2 -o data_file=x.data x.qcow2 10M"},
		{"data file raw", "-f qcow2 -o data_file=x.data,data_file_raw=on x.qcow2 10M"},
		{"flags and no-flags", "-f qcow2 -o lazy_refcounts,noextended_l2 x.qcow2 1M"},
		{"hex and octal numbers", "-f qcow2 -o refcount_bits=010,cluster_size=0x1000 x.qcow2 1M"},
		{"last option wins", "-f qcow2 -o lazy_refcounts=on,lazy_refcounts=off x.qcow2 1M"},
		{"two -o", "-f qcow2 -o size=1M -o cluster_size=4k x.qcow2"},
		{"comma escape", "-f qcow2 -u -o backing_file=a,,b,backing_fmt=raw x.qcow2 1M"},
		{"size fraction", "-f qcow2 x.qcow2 1.3k"},
		{"size bytes suffix", "-f qcow2 x.qcow2 1b"},
		{"size hex", "-f qcow2 x.qcow2 0x100000"},
		{"size 100T", "-f qcow2 x.qcow2 100T"},
		{"backing size from backing", "-f qcow2 -b base.qcow2 -F qcow2 x.qcow2"},
		{"backing raw", "-f qcow2 -b base.raw -F raw x.qcow2"},
		{"backing with size", "-f qcow2 -b base.raw -F raw x.qcow2 1G"},
		{"backing via -o", "-f qcow2 -o backing_file=base.qcow2,backing_fmt=qcow2 x.qcow2"},
		{"backing relative to image", "-f qcow2 -b ../base.raw -F raw sub/x.qcow2"},
		{"backing unsafe", "-f qcow2 -b nonexist -F qcow2 -u x.qcow2 1M"},
		{"backing prealloc extl2", "-f qcow2 -b base.qcow2 -F qcow2 -o preallocation=metadata,extended_l2=on x.qcow2 1M"},
		{"quiet", "-q -f qcow2 x.qcow2 1M"},

		{"help qcow2", "-f qcow2 -o help"},
		{"help raw", "-f raw -o help"},
		{"help with other options", "-f qcow2 -o compat=0.10,help"},
		{"question mark help", "-f raw -o ?"},

		{"no size", "-f qcow2 x.qcow2"},
		{"no file", "-f qcow2"},
		{"extra argument", "-f qcow2 x.qcow2 1M extra"},
		{"bad size suffix", "-f qcow2 x.qcow2 1X"},
		{"fraction without suffix", "-f qcow2 x.qcow2 1.5"},
		{"size too large", "-f qcow2 x.qcow2 8E"},
		{"size exponent", "-f qcow2 x.qcow2 1.5e3k"},
		{"size twice", "-f qcow2 -o size=1M x.qcow2 2M"},
		{"unknown format", "-f vmdk2 x 1M"},
		{"unknown option", "-f qcow2 -o foo=bar x.qcow2 1M"},
		{"empty option name", "-f qcow2 -o =4k x.qcow2 1M"},
		{"leading comma", "-f qcow2 -o ,cluster_size=4k x.qcow2 1M"},
		{"trailing comma", "-f qcow2 -o cluster_size=4k, x.qcow2 1M"},
		{"bad bool", "-f qcow2 -o lazy_refcounts=maybe x.qcow2 1M"},
		{"bad number", "-f qcow2 -o refcount_bits=abc x.qcow2 1M"},
		{"bad size option", "-f qcow2 -o cluster_size=abc x.qcow2 1M"},
		{"bad cluster size", "-f qcow2 -o cluster_size=3000 x.qcow2 1M"},
		{"cluster size too big", "-f qcow2 -o cluster_size=4M x.qcow2 1M"},
		{"bad compat", "-f qcow2 -o compat=1.2 x.qcow2 1M"},
		{"bad preallocation", "-f qcow2 -o preallocation=bad x.qcow2 1M"},
		{"bad compression", "-f qcow2 -o compression_type=lz4 x.qcow2 1M"},
		{"v2 lazy refcounts", "-f qcow2 -o compat=0.10,lazy_refcounts=on x.qcow2 1M"},
		{"v2 refcount bits", "-f qcow2 -o compat=0.10,refcount_bits=8 x.qcow2 1M"},
		{"v2 extended l2", "-f qcow2 -o compat=0.10,extended_l2=on,cluster_size=3000 x.qcow2 1M"},
		{"v2 zstd", "-f qcow2 -o compat=0.10,compression_type=zstd x.qcow2 1M"},
		{"v2 data file", "-f qcow2 -o compat=0.10,data_file=x.data x.qcow2 1M"},
		{"refcount bits 3", "-f qcow2 -o refcount_bits=3 x.qcow2 1M"},
		{"refcount bits 128", "-f qcow2 -o refcount_bits=128 x.qcow2 1M"},
		{"extended l2 small clusters", "-f qcow2 -o extended_l2=on,cluster_size=4k x.qcow2 1M"},
		{"data file raw alone", "-f qcow2 -o data_file_raw=on x.qcow2 1M"},
		{"data file raw and backing", "-f qcow2 -b base.raw -F raw -o data_file=x.data,data_file_raw=on x.qcow2"},
		{"backing format alone", "-f qcow2 -o backing_fmt=raw x.qcow2 1M"},
		{"backing and preallocation", "-f qcow2 -b base.qcow2 -F qcow2 -o preallocation=metadata x.qcow2 1M"},
		{"backing without format", "-f qcow2 -b base.qcow2 x.qcow2"},
		{"backing without format unsafe", "-f qcow2 -b base.qcow2 -u x.qcow2 1M"},
		{"backing unsafe without size", "-f qcow2 -b base.qcow2 -F qcow2 -u x.qcow2"},
		{"backing missing", "-f qcow2 -b nonexist -F raw sub/x.qcow2"},
		{"backing wrong format", "-f qcow2 -b base.raw -F qcow2 x.qcow2"},
		{"backing is self", "-f qcow2 -b x.qcow2 -F qcow2 x.qcow2 1M"},
		{"raw with backing", "-f raw -b base.raw -F raw x.raw 1M"},
		{"raw unknown option", "-f raw -o cluster_size=4k x.raw 1M"},
		{"raw prealloc metadata", "-f raw -o preallocation=metadata x.raw 1M"},
		{"raw bad prealloc", "-f raw -o preallocation=bad x.raw 1M"},
		{"raw too large", "-f raw x.raw 1P"},
		{"qcow2 too large", "-f qcow2 x.qcow2 4P"},
		{"qcow2 too large small clusters", "-f qcow2 -o cluster_size=512 x.qcow2 1T"},
		{"missing folder", "-f qcow2 nonexist/x.qcow2 1M"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			args := append([]string{"create"}, strings.Fields(tt.args)...)
			qdir, odir := t.TempDir(), t.TempDir()
			fromFixture(t, "create", createFixtures, qdir, odir)
			q := qemuImg(t, qdir, args...)
			o := ovisImg(t, odir, args...)
			sameResult(t, "create "+tt.args, q, o)
			if q.code != 0 || o.code != 0 {
				return
			}
			for _, name := range []string{"x.qcow2", "x.raw", "x.img", "sub/x.qcow2"} {
				if _, err := os.Stat(filepath.Join(qdir, name)); err == nil {
					sameImage(t, filepath.Join(qdir, name), filepath.Join(odir, name))
				}
			}
		})
	}
}

// sameImage requires qemu-img to describe two images alike (but for their
// folder and allocation), and, when qemu-img can open the first image with
// its backing and data files, to find the second one clean and equal in
// content to the first. Both run in the images' folders, as relative
// data file names resolve against the working folder.
func sameImage(t *testing.T, qpath, opath string) {
	t.Helper()
	qi, oi := infoFor(t, qpath), infoFor(t, opath)
	if !reflect.DeepEqual(qi, oi) {
		t.Errorf("qemu-img info of the images differs\nqemu-img's: %v\n    ovis's: %v", qi, oi)
	}
	qdir, odir := filepath.Dir(qpath), filepath.Dir(opath)
	if qemuImg(t, qdir, "check", filepath.Base(qpath)).code != 0 {
		return // a missing backing file, for one
	}
	if r := qemuImg(t, odir, "check", filepath.Base(opath)); r.code != 0 {
		t.Errorf("qemu-img check %s: exit %d\n%s%s", opath, r.code, r.stdout, r.stderr)
	}
	rel, err := filepath.Rel(odir, qpath)
	if err != nil {
		t.Fatal(err)
	}
	if r := qemuImg(t, odir, "compare", rel, filepath.Base(opath)); r.code != 0 {
		t.Errorf("qemu-img compare %s %s: exit %d\n%s%s", qpath, opath, r.code, r.stdout, r.stderr)
	}
}

// infoFor is qemu-img info --output=json of path, run in the image's folder
// on its base name, without actual-size.
func infoFor(t *testing.T, path string) map[string]any {
	t.Helper()
	r := qemuImg(t, filepath.Dir(path), "info", "--output=json", filepath.Base(path))
	if r.code != 0 {
		t.Fatalf("qemu-img info %s: %s", path, r.stderr)
	}
	var m map[string]any
	if err := json.Unmarshal([]byte(r.stdout), &m); err != nil {
		t.Fatal(err)
	}
	delete(m, "actual-size")
	return m
}
