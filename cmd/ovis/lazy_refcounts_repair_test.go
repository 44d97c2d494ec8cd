package main

import (
	"path/filepath"
	"testing"

	"github.com/ovis-storage/ovis/internal/testutil"
)

// dirtyLazyImage makes a qcow2 image with lazy refcounts that a killed
// qemu-io left dirty, its refcounts behind its L2 tables.
func dirtyLazyImage(t *testing.T, path string, extra ...string) {
	t.Helper()
	args := append([]string{"create", "-q", "-f", "qcow2", "-o", "lazy_refcounts=on"}, extra...)
	testutil.QemuImg(t, append(args, path, "1M")...)
	testutil.QemuIOExit(t, path, "qcow2", "write -q -P 0x5a 0 64k", "sigraise 9")
	if _, code := testutil.QemuImgExit(t, "check", path); code != 2 {
		t.Fatalf("qemu-img check of the dirty image exits %d, want 2 (corrupt until repaired)", code)
	}
}

// TestReproDirtyRepairOnWritableOpen: every verb that opens a dirty
// lazy-refcounts image read-write repairs it as qemu-img does, printing
// the repair on stderr, and leaves it clean; the read-only verbs leave it
// alone.
func TestReproDirtyRepairOnWritableOpen(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name  string
		args  []string
		base  bool // the image has a backing file base.qcow2
		clean bool // the image is clean afterwards
	}{
		{"resize", []string{"resize", "a.qcow2", "2M"}, false, true},
		{"resize-shrink-fails", []string{"resize", "a.qcow2", "512K"}, false, true},
		{"snapshot-create", []string{"snapshot", "-c", "s1", "a.qcow2"}, false, true},
		{"snapshot-delete-missing", []string{"snapshot", "-d", "s1", "a.qcow2"}, false, true},
		{"snapshot-list", []string{"snapshot", "-l", "a.qcow2"}, false, false},
		{"bitmap-add", []string{"bitmap", "--add", "a.qcow2", "b0"}, false, true},
		{"rebase-unsafe", []string{"rebase", "-u", "-b", "", "a.qcow2"}, false, true},
		{"rebase-safe", []string{"rebase", "-b", "", "a.qcow2"}, true, true},
		{"commit-no-backing", []string{"commit", "a.qcow2"}, false, true},
		{"commit", []string{"commit", "a.qcow2"}, true, true},
		{"amend", []string{"amend", "-o", "lazy_refcounts=off", "a.qcow2"}, false, true},
		{"convert-existing", []string{"convert", "-n", "-f", "raw", "-O", "qcow2", "s.raw", "a.qcow2"}, false, true},
		{"convert-existing-quiet", []string{"convert", "-q", "-n", "-f", "raw", "-O", "qcow2", "s.raw", "a.qcow2"}, false, true},
		{"resize-quiet", []string{"resize", "-q", "a.qcow2", "2M"}, false, true},
		{"check", []string{"check", "a.qcow2"}, false, false},
		{"check-repair", []string{"check", "-r", "all", "a.qcow2"}, false, true},
		{"info", []string{"info", "a.qcow2"}, false, false},
		{"map", []string{"map", "a.qcow2"}, false, false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			src := t.TempDir()
			var extra []string
			if c.base {
				testutil.QemuImg(t, "create", "-q", "-f", "qcow2", filepath.Join(src, "base.qcow2"), "1M")
				testutil.QemuIO(t, filepath.Join(src, "base.qcow2"), "qcow2", "write -q -P 0x11 0 1M")
				extra = []string{"-b", "base.qcow2", "-F", "qcow2"}
			}
			dirtyLazyImage(t, filepath.Join(src, "a.qcow2"), extra...)
			qd, od := t.TempDir(), t.TempDir()
			for _, d := range []string{qd, od} {
				testutil.QemuImg(t, "create", "-q", "-f", "raw", filepath.Join(d, "s.raw"), "1M")
				testutil.QemuIO(t, filepath.Join(d, "s.raw"), "raw", "write -q -P 0x33 128k 64k")
				testutil.CopySparse(t, filepath.Join(src, "a.qcow2"), filepath.Join(d, "a.qcow2"))
				if c.base {
					testutil.CopySparse(t, filepath.Join(src, "base.qcow2"), filepath.Join(d, "base.qcow2"))
				}
			}
			q := qemuImg(t, qd, c.args...)
			o := ovisImg(t, od, c.args...)
			sameResult(t, c.name, q, o)
			for _, d := range []string{qd, od} {
				_, code := testutil.QemuImgExit(t, "check", filepath.Join(d, "a.qcow2"))
				if clean := code == 0; clean != c.clean {
					t.Errorf("%s: qemu-img check exits %d, want clean=%v", d, code, c.clean)
				}
			}
			if r, code := testutil.QemuImgExit(t, "compare", "-U", filepath.Join(qd, "a.qcow2"), filepath.Join(od, "a.qcow2")); code != 0 {
				t.Errorf("the twins read differently after %s: %s", c.name, r)
			}
			for _, d := range []string{qd, od} {
				info := testutil.ImageInfo(t, filepath.Join(d, "a.qcow2"))
				if dirty := info["dirty-flag"] == true; dirty == c.clean {
					t.Errorf("%s: dirty-flag %v after %s", d, dirty, c.name)
				}
			}
		})
	}
}
