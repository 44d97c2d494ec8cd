package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
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

// twin copies the file src into dir/name.
func twin(t *testing.T, src, dir, name string) {
	t.Helper()
	b, err := os.ReadFile(src)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, name), b, 0o644); err != nil {
		t.Fatal(err)
	}
}

// TestReproDirtyRepairOnWritableOpen: every verb that opens a dirty
// lazy-refcounts image read-write repairs it as qemu-img does, printing
// the repair on stderr, and leaves it clean; the read-only verbs leave it
// alone.
func TestReproDirtyRepairOnWritableOpen(t *testing.T) {
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
		{"check", []string{"check", "a.qcow2"}, false, false},
		{"check-repair", []string{"check", "-r", "all", "a.qcow2"}, false, true},
		{"info", []string{"info", "a.qcow2"}, false, false},
		{"map", []string{"map", "a.qcow2"}, false, false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
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
				twin(t, filepath.Join(src, "a.qcow2"), d, "a.qcow2")
				if c.base {
					twin(t, filepath.Join(src, "base.qcow2"), d, "base.qcow2")
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

// TestReproMapDataFileRawLikeQemu: an image with data_file_raw=on maps
// the holes of its raw data file as data, as qemu-img map and qemu-nbd's
// block status do (only its zero clusters read as zeros), whichever tool
// created it.
func TestReproMapDataFileRawLikeQemu(t *testing.T) {
	writes := []string{"write -q -P 1 64k 64k", "write -q -z 256k 64k", "write -q -P 2 512k 4k", "discard -q 768k 64k", "write -q -P 3 1000k 1k"}
	for _, creator := range []string{"qemu-img", "ovis"} {
		for _, opts := range []string{"", ",cluster_size=4096", ",extended_l2=on", ",preallocation=metadata", ",preallocation=falloc"} {
			// No comma in the name: it goes into t.TempDir()'s, and so into -o.
			name := creator + strings.ReplaceAll(opts, ",", "-")
			t.Run(name, func(t *testing.T) {
				dir := t.TempDir()
				args := []string{"create", "-q", "-f", "qcow2", "-o", "data_file=" + filepath.Join(dir, "d.raw") + ",data_file_raw=on" + opts, "x.qcow2", "1M"}
				if creator == "ovis" {
					mustOvisImg(t, dir, args...)
				} else if r := qemuImg(t, dir, args...); r.code != 0 {
					t.Fatalf("qemu-img create: %s", r.stderr)
				}
				p := filepath.Join(dir, "x.qcow2")
				for i := 0; i <= len(writes); i++ {
					if i > 0 {
						testutil.QemuIO(t, p, "qcow2", writes[i-1])
					}
					for _, out := range []string{"human", "json"} {
						args := []string{"map", "--output=" + out, "x.qcow2"}
						sameResult(t, name+" "+out, qemuImg(t, dir, args...), ovisImg(t, dir, args...))
					}
				}
				sock := filepath.Join(shortTempDir(t), "q.sock")
				stop := testutil.StartUntil(t, exec.Command("qemu-nbd", "-r", "-f", "qcow2", "-k", sock, p),
					func() bool { _, err := os.Stat(sock); return err == nil })
				want := runTool(t, "qemu-img", "map", "--output=json", "-f", "raw", "nbd+unix:///?socket="+sock)
				stop()
				srv := startNBD(t, nbdRun{args: []string{"-r", "-f", "qcow2", p}})
				got := runTool(t, "qemu-img", "map", "--output=json", "-f", "raw", srv.uri)
				srv.stop(15)
				if got != want {
					t.Errorf("qemu-img map over ovis nbd:\n%s\nover qemu-nbd:\n%s", got, want)
				}
			})
		}
	}
}
