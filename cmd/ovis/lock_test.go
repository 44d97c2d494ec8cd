package main

import (
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/ovis-storage/ovis/internal/testutil"
)

// lockLayout makes images in dir: base.qcow2 under top.qcow2, data.qcow2
// with the external data file data.raw, and plain.raw.
var snapDateRE = regexp.MustCompile(`\d{4}-\d\d-\d\d \d\d:\d\d:\d\d`)

func lockLayout(t *testing.T, dir string) []string {
	t.Helper()
	for _, args := range [][]string{
		{"-f", "qcow2", "base.qcow2", "1M"},
		{"-f", "qcow2", "-b", "base.qcow2", "-F", "qcow2", "top.qcow2"},
		{"-f", "qcow2", "-o", "data_file=data.raw", "data.qcow2", "1M"},
		{"-f", "raw", "plain.raw", "1M"},
	} {
		if r := qemuImg(t, dir, append([]string{"create"}, args...)...); r.code != 0 {
			t.Fatalf("qemu-img create %v: %s", args, r.stderr)
		}
	}
	return []string{"base.qcow2", "top.qcow2", "data.qcow2", "data.raw", "plain.raw"}
}

// serveUntil runs an NBD server (qemu-nbd or ovis nbd) on a unix socket
// with args, waits until it serves the image and returns a function that
// stops it.
func serveUntil(t *testing.T, dir, bin string, args ...string) (stop func()) {
	t.Helper()
	_, stop = serveURI(t, dir, bin, args...)
	return stop
}

// serveURI is serveUntil that also returns the export's URI.
func serveURI(t *testing.T, dir, bin string, args ...string) (uri string, stop func()) {
	t.Helper()
	sock := filepath.Join(shortTempDir(t), "s.sock")
	// -t: qemu-nbd would exit after the connection that finds it ready.
	args = append([]string{"-t", "-k", sock}, args...)
	if bin == ovisBin {
		args = append([]string{"nbd"}, args...)
	}
	cmd := exec.Command(bin, args...)
	cmd.Dir = dir
	// A finished handshake, not a listening socket: qemu-nbd listens
	// before it opens the image.
	uri = "nbd+unix:///?socket=" + sock
	stop = testutil.StartUntil(t, cmd, func() bool { return exec.Command("nbdinfo", "--size", uri).Run() == nil })
	return uri, stop
}

// TestImageLocksLikeQemuNBD: ovis nbd locks the same bytes of every file
// of an image (its own file, backing file, external data file) as
// qemu-nbd does, read-write and read-only, so that QEMU's tools and ovis
// see each other's use of an image.
func TestImageLocksLikeQemuNBD(t *testing.T) {
	dir := t.TempDir()
	files := lockLayout(t, dir)
	for _, c := range []struct{ file, format string }{
		{"top.qcow2", "qcow2"}, {"data.qcow2", "qcow2"}, {"plain.raw", "raw"},
	} {
		for _, ro := range []bool{false, true} {
			args := []string{"-f", c.format}
			if ro {
				args = append(args, "-r")
			}
			args = append(args, c.file)
			bytesUnder := func(bin string) map[string][]int64 {
				stop := serveUntil(t, dir, bin, args...)
				defer stop()
				m := map[string][]int64{}
				for _, f := range files {
					m[f] = testutil.LockedBytes(t, filepath.Join(dir, f))
				}
				return m
			}
			q, o := bytesUnder("qemu-nbd"), bytesUnder(ovisBin)
			locked := 0
			for _, f := range files {
				if !slices.Equal(q[f], o[f]) {
					t.Errorf("serving %v: %s locked bytes: ovis %v, qemu-nbd %v", args, f, o[f], q[f])
				}
				locked += len(q[f])
			}
			if locked == 0 {
				t.Errorf("serving %v: qemu-nbd locked nothing; the test sees no locks", args)
			}
		}
	}
}

// TestImageLocksConflictLikeQemu: while qemu-io or ovis nbd holds an
// image, ovis img refuses or allows what qemu-img refuses or allows, with
// qemu-img's message and exit code; -U lets a reader in beside a writer.
func TestImageLocksConflictLikeQemu(t *testing.T) {
	t.Parallel()
	probes := [][]string{
		{"info", "top.qcow2"},
		{"info", "-U", "top.qcow2"},
		{"check", "top.qcow2"},
		{"map", "--output=json", "top.qcow2"},
		{"map", "--output=json", "-U", "top.qcow2"},
		{"compare", "top.qcow2", "base.qcow2"},
		{"snapshot", "-l", "top.qcow2"},
		{"snapshot", "-c", "s", "top.qcow2"},
		{"snapshot", "-U", "-c", "s2", "top.qcow2"},
		{"info", "--image-opts", "driver=qcow2,file.filename=top.qcow2,file.locking=off"},
		{"resize", "-f", "raw", "plain.raw", "2M"},
		{"info", "-f", "raw", "plain.raw"},
		{"create", "-f", "qcow2", "-b", "base.qcow2", "-F", "qcow2", "new.qcow2"},
		{"rebase", "-F", "qcow2", "-b", "base.qcow2", "top.qcow2"},
		{"rebase", "-U", "-F", "qcow2", "-b", "base.qcow2", "top.qcow2"},
		{"commit", "-d", "top.qcow2"},
	}
	holders := []struct {
		name string
		hold func(t *testing.T, dir string)
	}{
		{"qemu-io writes base", func(t *testing.T, dir string) {
			testutil.HoldWithQemuIO(t, filepath.Join(dir, "base.qcow2"), "-f", "qcow2")
		}},
		{"qemu-io writes top", func(t *testing.T, dir string) {
			testutil.HoldWithQemuIO(t, filepath.Join(dir, "top.qcow2"), "-f", "qcow2")
		}},
		{"qemu-io reads top", func(t *testing.T, dir string) {
			testutil.HoldWithQemuIO(t, filepath.Join(dir, "top.qcow2"), "-r", "-f", "qcow2")
		}},
		{"qemu-io -U reads top", func(t *testing.T, dir string) {
			testutil.HoldWithQemuIO(t, filepath.Join(dir, "top.qcow2"), "-r", "-U", "-f", "qcow2")
		}},
		{"ovis nbd writes top", func(t *testing.T, dir string) {
			serveUntil(t, dir, ovisBin, "-f", "qcow2", "top.qcow2")
		}},
		{"ovis nbd reads top", func(t *testing.T, dir string) {
			serveUntil(t, dir, ovisBin, "-r", "-f", "qcow2", "top.qcow2")
		}},
		{"ovis nbd writes raw", func(t *testing.T, dir string) {
			serveUntil(t, dir, ovisBin, "-f", "raw", "plain.raw")
		}},
		{"qemu-nbd writes raw", func(t *testing.T, dir string) {
			serveUntil(t, dir, "qemu-nbd", "-f", "raw", "plain.raw")
		}},
	}
	for _, h := range holders {
		t.Run(h.name, func(t *testing.T) {
			// One layout per tool, so that what one tool's probe
			// changes (a snapshot, a resize) is not seen by the other's.
			qdir, odir := t.TempDir(), t.TempDir()
			fromFixture(t, "lock-layout", func(t *testing.T, dir string) { lockLayout(t, dir) }, qdir, odir)
			h.hold(t, qdir)
			h.hold(t, odir)
			refused := 0
			for _, p := range probes {
				q, o := qemuImg(t, qdir, p...), ovisImg(t, odir, p...)
				// Each layout's snapshot has its own creation time.
				q.stdout = snapDateRE.ReplaceAllString(q.stdout, "DATE")
				o.stdout = snapDateRE.ReplaceAllString(o.stdout, "DATE")
				sameResult(t, strings.Join(p, " "), q, o)
				if strings.Contains(q.stderr, "Is another process using the image") {
					refused++
				}
			}
			if strings.Contains(h.name, "writes") && refused == 0 {
				t.Errorf("qemu-img refused nothing while %s: the test sees no locks", h.name)
			}
		})
	}
}

// TestNBDRefusesImageInUse: ovis nbd refuses an image another process
// holds against it, with qemu-nbd's message and exit code.
func TestNBDRefusesImageInUse(t *testing.T) {
	dir := t.TempDir()
	lockLayout(t, dir)
	testutil.HoldWithQemuIO(t, filepath.Join(dir, "base.qcow2"), "-f", "qcow2")
	testutil.HoldWithQemuIO(t, filepath.Join(dir, "plain.raw"), "-r", "-f", "raw")
	sock := filepath.Join(shortTempDir(t), "s.sock")
	for _, args := range [][]string{
		{"-f", "qcow2", filepath.Join(dir, "base.qcow2")},
		{"-r", "-f", "qcow2", filepath.Join(dir, "base.qcow2")},
		{"-f", "qcow2", filepath.Join(dir, "top.qcow2")},
	} {
		args = append([]string{"-k", sock}, args...)
		q := runBounded(t, "qemu-nbd", args...)
		o := runBounded(t, ovisBin, append([]string{"nbd"}, args...)...)
		if q.code != 1 || o.code != q.code || nbdStderr(q.stderr) != nbdStderr(o.stderr) {
			t.Errorf("nbd %q:\nqemu-nbd: exit %d, %q\n    ovis: exit %d, %q", strings.Join(args, " "), q.code, q.stderr, o.code, o.stderr)
		}
	}
	// A reader that shares all lets a writer serve (a raw image: no
	// metadata for the reader to cache).
	stop := serveUntil(t, dir, ovisBin, "-f", "raw", "plain.raw")
	stop()
}

// nbdStderr drops the program's name from a qemu-nbd or ovis nbd error.
func nbdStderr(s string) string {
	return strings.TrimPrefix(strings.TrimPrefix(s, "qemu-nbd: "), "ovis: ")
}
