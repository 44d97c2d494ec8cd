package main

import (
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/ovis-storage/ovis/internal/testutil"
)

// TestSnapshotCycle takes, applies and deletes internal snapshots, the two
// tools taking turns on one image: what one creates the other lists and
// applies, and after every step qemu-img check finds the image clean and
// both tools list the same table.
func TestSnapshotCycle(t *testing.T) {
	for _, opts := range []string{"", "compat=0.10,cluster_size=4k", "extended_l2=on,lazy_refcounts=on,refcount_bits=8"} {
		t.Run("opts="+opts, func(t *testing.T) {
			t.Parallel()
			dir := t.TempDir()
			img := filepath.Join(dir, "a.qcow2")
			args := []string{"create", "-q", "-f", "qcow2"}
			if opts != "" {
				args = append(args, "-o", opts)
			}
			testutil.QemuImg(t, append(args, img, "32M")...)
			write := func(cmds ...string) { testutil.QemuIO(t, img, "qcow2", cmds...) }
			state := func(name string) string {
				t.Helper()
				p := filepath.Join(dir, name)
				testutil.QemuImg(t, "convert", "-O", "raw", img, p)
				return p
			}
			same := func(what, want string) {
				t.Helper()
				if out, code := testutil.QemuImgExit(t, "compare", img, want); code != 0 {
					t.Errorf("%s: image differs from %s: %s", what, filepath.Base(want), out)
				}
				testutil.CheckImage(t, img)
				l := []string{"snapshot", "-l", "a.qcow2"}
				sameResult(t, what+": snapshot -l", qemuImg(t, dir, l...), ovisImg(t, dir, l...))
				i := []string{"info", "--output=json", "a.qcow2"}
				q, o := qemuImg(t, dir, i...), ovisImg(t, dir, i...)
				q.stdout = actualSizeRE.ReplaceAllString(q.stdout, "")
				o.stdout = actualSizeRE.ReplaceAllString(o.stdout, "")
				sameResult(t, what+": info", q, o)
			}

			write("write -P 1 0 1M", "write -z 4M 1M", "write -P 2 20M 64k")
			s1 := state("s1.raw")
			mustOvisImg(t, dir, "snapshot", "-c", "one", "a.qcow2")
			same("ovis -c one", s1)
			write("write -P 3 512k 1M", "write -P 4 10M 1M", "discard 20M 64k")
			s2 := state("s2.raw")
			if r := qemuImg(t, dir, "snapshot", "-c", "two", "a.qcow2"); r.code != 0 {
				t.Fatalf("qemu-img snapshot -c: %s", r.stderr)
			}
			same("qemu-img -c two", s2)
			mustOvisImg(t, dir, "snapshot", "-c", "three", "a.qcow2")
			write("write -P 5 0 4M")

			mustOvisImg(t, dir, "snapshot", "-a", "two", "a.qcow2")
			same("ovis -a two", s2)
			if r := qemuImg(t, dir, "snapshot", "-a", "one", "a.qcow2"); r.code != 0 {
				t.Fatalf("qemu-img snapshot -a: %s", r.stderr)
			}
			same("qemu-img -a one", s1)
			mustOvisImg(t, dir, "snapshot", "-a", "1", "a.qcow2") // by ID
			same("ovis -a 1", s1)

			mustOvisImg(t, dir, "snapshot", "-d", "two", "a.qcow2")
			same("ovis -d two", s1)
			if r := qemuImg(t, dir, "snapshot", "-d", "three", "a.qcow2"); r.code != 0 {
				t.Fatalf("qemu-img snapshot -d: %s", r.stderr)
			}
			same("qemu-img -d three", s1)
			mustOvisImg(t, dir, "snapshot", "-d", "one", "a.qcow2")
			same("ovis -d one", s1)
		})
	}
}

// snapshotRowRE matches the date column of a snapshot table row, which
// depends on when the snapshot was taken.
var snapshotRowRE = regexp.MustCompile(`\d{4}-\d\d-\d\d \d\d:\d\d:\d\d`)

// TestSnapshotCreateMatchesQemu creates the same snapshots with each tool
// on twin images and requires the same tables (but for the time of
// creation) and the same images.
func TestSnapshotCreateMatchesQemu(t *testing.T) {
	t.Parallel()
	qdir, odir := twinDirs(t, qemuCreateStep("-f qcow2 a.qcow2 32M",
		run("qemu-io", "-f", "qcow2", "-c", "write -P 1 0 1M", "a.qcow2")))
	long := strings.Repeat("n", 300) // QEMU keeps 255 bytes of a name
	for _, name := range []string{"s1", "s1", "with space", "späte", long, ""} {
		bothRun(t, qdir, odir, []string{"snapshot", "-c", name, "a.qcow2"})
	}
	bothRun(t, qdir, odir, []string{"snapshot", "-d", "s1", "a.qcow2"})
	q, o := bothRun(t, qdir, odir, []string{"snapshot", "-l", "a.qcow2"}, snapshotRowRE)
	if !strings.Contains(q.stdout, "with space") || q.stdout != o.stdout {
		t.Errorf("tables differ\nqemu-img: %s\n    ovis: %s", q.stdout, o.stdout)
	}
	sameImages(t, qdir, odir, "a.qcow2")
}

// qemuCreateStep is qemuCreate as a setup for twinDirs.
func qemuCreateStep(args string, then ...step) func(t *testing.T, dir string) {
	return func(t *testing.T, dir string) {
		t.Helper()
		qemuCreate(args, then...)(t, dir)
	}
}

// TestSnapshotErrorsMatchQemu compares refusals and no-ops: raw images,
// unknown snapshots (delete looks names up, apply IDs then names), mixed
// actions, no action, missing files, images with an external data file.
func TestSnapshotErrorsMatchQemu(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	qemuCreate("-f raw r.raw 1M")(t, dir)
	qemuCreate("-f qcow2 -o data_file=d.data d.qcow2 1M")(t, dir)
	qemuCreate("-f qcow2 a.qcow2 1M",
		run("qemu-img", "snapshot", "-c", "2", "a.qcow2"),
		run("qemu-img", "snapshot", "-c", "x", "a.qcow2"))(t, dir)
	for _, a := range []string{
		"-l r.raw", "-c x r.raw", "-a x r.raw", "-d x r.raw", "r.raw", "a.qcow2",
		"-l -c x a.qcow2", "-a nope a.qcow2", "-d nope a.qcow2", "-d 1 a.qcow2",
		"-l", "-l nonexist", "-c x d.qcow2", "-l a.qcow2 r.raw",
	} {
		args := append([]string{"snapshot"}, strings.Fields(a)...)
		q, o := qemuImg(t, dir, args...), ovisImg(t, dir, args...)
		q.stdout = snapshotRowRE.ReplaceAllString(q.stdout, "$1")
		o.stdout = snapshotRowRE.ReplaceAllString(o.stdout, "$1")
		sameResult(t, a, q, o)
	}
}
