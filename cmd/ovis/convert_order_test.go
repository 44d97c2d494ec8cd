package main

import (
	"path/filepath"
	"strings"
	"testing"

	"github.com/ovis-storage/ovis/internal/testutil"
)

// TestConvertOrderedLayout converts with qemu-img's default in-order
// writes: the qcow2 output must have qemu-img's layout exactly (the same
// host offsets in qemu-img map), which out-of-order writes (-W) do not
// promise; both must hold the source's content and check clean.
func TestConvertOrderedLayout(t *testing.T) {
	tests := []struct {
		name string
		src  func(t *testing.T, dir string) string
		args string
	}{
		{"raw to qcow2", rawSource, "-O qcow2"},
		{"raw to qcow2 4k clusters", rawSource, "-O qcow2 -o cluster_size=4k"},
		{"raw to qcow2 one worker", rawSource, "-O qcow2 -m 1"},
		{"raw to qcow2 -S 0", rawSource, "-O qcow2 -S 0"},
		{"raw to raw -S 0", rawSource, "-O raw -S 0"},
		{"qcow2 to qcow2", qcow2Source, "-O qcow2"},
		{"qcow2 to qcow2 compressed", qcow2Source, "-c -O qcow2"},
		{"raw to qcow2 zstd compressed", rawSource, "-c -O qcow2 -o compression_type=zstd"},
		{"raw to qcow2 extended l2", rawSource, "-O qcow2 -o extended_l2=on"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			qdir, odir := twinDirs(t, func(t *testing.T, dir string) { tt.src(t, dir) })
			args := append(append([]string{"convert"}, strings.Fields(tt.args)...), "src", "dst")
			bothRun(t, qdir, odir, args)
			warmDir(t, qdir)
			warmDir(t, odir)
			m := []string{"map", "--output=json", "dst"}
			if q, o := qemuImg(t, qdir, m...), qemuImg(t, odir, m...); q.stdout != o.stdout {
				t.Errorf("layout differs from qemu-img's\nqemu-img's: %s\n    ovis's: %s", q.stdout, o.stdout)
			}
			checkConverted(t, odir, "src", "dst")
			// Out of order: same content, any layout.
			mustOvisImg(t, odir, append(append([]string{"convert", "-W"}, strings.Fields(tt.args)...), "src", "dstW")...)
			checkConverted(t, odir, "src", "dstW")
		})
	}
}

// TestConvertTargetIsZero checks --target-is-zero: refused without -n and
// with a backing file, as qemu-img refuses it; with -n the zero ranges of
// the source are left alone, so a sparse target stays sparse.
func TestConvertTargetIsZero(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	rawSource(t, dir)
	testutil.QemuImg(t, "create", "-q", "-f", "raw", filepath.Join(dir, "dst.raw"), "64M")
	testutil.QemuImg(t, "create", "-q", "-f", "qcow2", filepath.Join(dir, "dst.qcow2"), "64M")
	for _, a := range []string{
		"--target-is-zero -O raw src dst.raw",
		"-n --target-is-zero -B x -O qcow2 src dst.qcow2",
		"--target-is-zero -O raw nonexist dst.raw",
		"-n --target-is-zero -O raw nonexist dst.raw",
		"-t foo -O raw src x.raw",
		"-T foo -O raw src x.raw",
	} {
		args := append([]string{"convert"}, strings.Fields(a)...)
		sameResult(t, a, qemuImg(t, dir, args...), ovisImg(t, dir, args...))
	}
	for _, f := range []string{"raw", "qcow2"} {
		mustOvisImg(t, dir, "convert", "-n", "--target-is-zero", "-O", f, "src", "dst."+f)
		checkConverted(t, dir, "src", "dst."+f)
	}
	if got := testutil.AllocatedBytes(t, filepath.Join(dir, "dst.raw")); got > 16<<20 {
		t.Errorf("dst.raw takes %d bytes: zeros were written into a target said to be zero", got)
	}
	// Cache modes are accepted, and sync (or not) at the end.
	for _, c := range []string{"writeback", "writethrough", "none", "directsync", "unsafe"} {
		mustOvisImg(t, dir, "convert", "-t", c, "-T", c, "-O", "qcow2", "src", "c-"+c)
		checkConverted(t, dir, "src", "c-"+c)
	}
}
