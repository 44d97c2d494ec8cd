package main

import (
	"strings"
	"testing"

	"github.com/ovis-storage/ovis/internal/testutil"
)

// TestReproEmptyBackingNames: -b "", -F "" and their -o spellings are
// refused as qemu-img refuses them, instead of being taken for "no backing
// file" (create -b "" made an image without one and exited 0).
func TestReproEmptyBackingNames(t *testing.T) {
	t.Parallel()
	for _, args := range [][]string{
		{"create", "-f", "qcow2", "-b", "", "x.qcow2", "1M"},
		{"create", "-f", "qcow2", "-b", "", "-F", "qcow2", "x.qcow2", "1M"},
		{"create", "-f", "qcow2", "-o", "backing_file=", "x.qcow2", "1M"},
		{"create", "-f", "raw", "-b", "", "x.raw", "1M"},
		{"create", "-f", "raw", "-F", "", "x.raw", "1M"},
		{"create", "-f", "qcow2", "-b", "base.qcow2", "-F", "", "x.qcow2"},
		{"create", "-f", "qcow2", "-b", "base.qcow2", "-F", "foo", "x.qcow2"},
		{"create", "-f", "qcow2", "-o", "backing_fmt=", "-b", "base.qcow2", "x.qcow2"},
		{"create", "-u", "-f", "qcow2", "-b", "base.qcow2", "-F", "", "x.qcow2", "1M"},
		{"create", "-u", "-f", "qcow2", "-b", "base.qcow2", "x.qcow2", "1M"},
		{"convert", "-O", "qcow2", "-B", "", "base.qcow2", "x.qcow2"},
		{"convert", "-O", "qcow2", "-B", "base.qcow2", "-F", "", "base.qcow2", "x.qcow2"},
		{"convert", "-O", "qcow2", "-F", "", "base.qcow2", "x.qcow2"},
	} {
		name := strings.Join(args, " ")
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			run := func(bin string) result {
				dir := t.TempDir()
				testutil.QemuImg(t, "create", "-q", "-f", "qcow2", dir+"/base.qcow2", "1M")
				if bin == "qemu-img" {
					return qemuImg(t, dir, args...)
				}
				return ovisImg(t, dir, args...)
			}
			q := run("qemu-img")
			if q.code == 0 {
				t.Fatalf("qemu-img accepts %s", name)
			}
			sameResult(t, name, q, run(ovisBin))
		})
	}
	// qemu-img 7.2 crashes on this one (SIGSEGV); ovis refuses it with
	// the message its create gives for an empty backing file name.
	dir := t.TempDir()
	testutil.QemuImg(t, "create", "-q", "-f", "qcow2", dir+"/base.qcow2", "1M")
	r := ovisImg(t, dir, "convert", "-O", "qcow2", "-B", "", "-F", "qcow2", "base.qcow2", "x.qcow2")
	if want := "ovis: x.qcow2: error while converting qcow2: Expected backing file name, got empty string\n"; r.code != 1 || r.stderr != want {
		t.Errorf("convert -B '' -F qcow2: exit %d, stderr %q; want 1, %q", r.code, r.stderr, want)
	}
}
