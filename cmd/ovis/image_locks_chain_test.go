package main

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/ovis-storage/ovis/internal/testutil"
)

// lockChain builds in dir the chain b3.qcow2 -> b2.qcow2 -> b1.qcow2 ->
// b0.raw, each layer but the top with its own 64 KiB of data (pattern
// 1+i at 64 KiB * i).
func lockChain(t *testing.T, dir string) {
	t.Helper()
	testutil.QemuImg(t, "create", "-q", "-f", "raw", filepath.Join(dir, "b0.raw"), "1M")
	testutil.QemuIO(t, filepath.Join(dir, "b0.raw"), "raw", "write -q -P 1 0 64k")
	for i, back := range []string{"b0.raw", "b1.qcow2", "b2.qcow2"} {
		p := filepath.Join(dir, fmt.Sprintf("b%d.qcow2", i+1))
		testutil.QemuImg(t, "create", "-q", "-f", "qcow2", "-b", back, "-F", strings.TrimPrefix(filepath.Ext(back), "."), p)
		if i < 2 {
			testutil.QemuIO(t, p, "qcow2", fmt.Sprintf("write -q -P %d %dk 64k", i+2, (i+1)*64))
		}
	}
}

var lockChainFiles = []string{"b0.raw", "b1.qcow2", "b2.qcow2", "b3.qcow2"}

func readFiles(t *testing.T, dir string) map[string][]byte {
	t.Helper()
	m := map[string][]byte{}
	for _, f := range lockChainFiles {
		b, err := os.ReadFile(filepath.Join(dir, f))
		if err != nil {
			t.Fatal(err)
		}
		m[f] = b
	}
	return m
}

// TestReproLocksInProcess (issue 14): an image that one open of a verb
// holds without sharing writes (a layer of a source chain, the source
// itself) is refused to the verb's own write open, as QEMU's nodes refuse
// each other within qemu-img: same message, same exit code, and every
// file byte for byte as it was, its guest data still read back by
// qemu-io. Opens QEMU lets share (read-only layers, -U, commit and rebase
// within their chain) still go ahead, with the same guest data as
// qemu-img leaves.
func TestReproLocksInProcess(t *testing.T) {
	t.Parallel()
	cases := [][]string{
		// The target is a layer of the source chain.
		{"convert", "-q", "-f", "qcow2", "-O", "raw", "-n", "b1.qcow2", "b0.raw"},
		{"convert", "-q", "-f", "qcow2", "-O", "raw", "b2.qcow2", "b0.raw"},
		{"convert", "-q", "-f", "qcow2", "-O", "qcow2", "-o", "cluster_size=65536", "b3.qcow2", "b1.qcow2"},
		{"convert", "-q", "-n", "-f", "qcow2", "-O", "qcow2", "b3.qcow2", "b2.qcow2"},
		{"dd", "-f", "qcow2", "-O", "qcow2", "bs=512", "count=1", "if=b2.qcow2", "of=b1.qcow2"},
		{"dd", "-f", "qcow2", "-O", "raw", "if=b2.qcow2", "of=b1.qcow2"},
		// The target is the source.
		{"convert", "-q", "-f", "qcow2", "-O", "qcow2", "b1.qcow2", "b1.qcow2"},
		{"convert", "-q", "-n", "-f", "qcow2", "-O", "qcow2", "b1.qcow2", "b1.qcow2"},
		{"convert", "-q", "-f", "raw", "-O", "raw", "b0.raw", "b0.raw"},
		{"convert", "-q", "-n", "-f", "raw", "-O", "raw", "b0.raw", "b0.raw"},
		// The target is in the -B chain as well as the source's.
		{"convert", "-q", "-f", "qcow2", "-O", "qcow2", "-B", "b1.qcow2", "-F", "qcow2", "b3.qcow2", "b1.qcow2"},
		// The new image's backing chain comes back to it.
		{"convert", "-q", "-f", "raw", "-O", "qcow2", "-B", "b2.qcow2", "-F", "qcow2", "b0.raw", "b1.qcow2"},
		// Shared: -U sources, a raw dd source, read-only layers.
		{"convert", "-q", "-U", "-f", "qcow2", "-O", "raw", "-n", "b1.qcow2", "b0.raw"},
		{"convert", "-q", "-U", "-f", "raw", "-O", "raw", "b0.raw", "b0.raw"},
		{"dd", "-U", "-f", "qcow2", "-O", "qcow2", "if=b2.qcow2", "of=b1.qcow2"},
		{"dd", "-f", "qcow2", "-O", "raw", "if=b1.qcow2", "of=b0.raw"},
		{"convert", "-q", "-n", "-f", "raw", "-O", "qcow2", "-B", "b1.qcow2", "-F", "qcow2", "b0.raw", "b2.qcow2"},
		{"compare", "b1.qcow2", "b1.qcow2"},
		{"compare", "b3.qcow2", "b1.qcow2"},
		{"check", "b3.qcow2"},
		{"create", "-q", "-f", "qcow2", "-b", "b2.qcow2", "-F", "qcow2", "b1.qcow2"},
		{"create", "-q", "-f", "qcow2", "-b", "b1.qcow2", "-F", "qcow2", "b1.qcow2"},
		// Within a chain: commit reopens its base, rebase reads the new
		// backing file, which the old chain holds read-only too.
		{"commit", "-q", "-f", "qcow2", "b2.qcow2"},
		{"commit", "-q", "-f", "qcow2", "-b", "b0.raw", "b3.qcow2"},
		{"rebase", "-f", "qcow2", "-b", "b0.raw", "-F", "raw", "b2.qcow2"},
		{"rebase", "-f", "qcow2", "-b", "b1.qcow2", "-F", "qcow2", "b3.qcow2"},
	}
	for _, args := range cases {
		name := strings.Join(args, " ")
		t.Run(name, func(t *testing.T) {
			qdir, odir := t.TempDir(), t.TempDir()
			fromFixture(t, "lock-chain", lockChain, qdir, odir)
			before := readFiles(t, odir)
			q := qemuImg(t, qdir, args...)
			o := ovisImg(t, odir, args...)
			sameResult(t, name, q, o)
			if q.code != 0 && !strings.Contains(q.stderr, "lock") {
				return // not a lock refusal: the files are not judged
			}
			if createdBeforeOpen(args) {
				return // a looping chain: qemu-img reading it never ends
			}
			if q.code != 0 {
				after := readFiles(t, odir)
				for _, f := range lockChainFiles {
					if !bytes.Equal(before[f], after[f]) {
						t.Errorf("refused, yet ovis changed %s", f)
					}
				}
			}
			// Guest data, as qemu-io reads it, alike in the twins.
			for _, f := range lockChainFiles {
				format := strings.TrimPrefix(filepath.Ext(f), ".")
				qd := guestBytes(t, filepath.Join(qdir, f), format)
				od := guestBytes(t, filepath.Join(odir, f), format)
				if !bytes.Equal(qd, od) {
					t.Errorf("%s: guest data differs from qemu-img's twin", f)
				}
			}
		})
	}
}

// createdBeforeOpen: qemu-img too creates the image, whose backing chain
// comes back to it (then convert fails to open it); the new files are
// not judged.
func createdBeforeOpen(args []string) bool {
	switch strings.Join(args, " ") {
	case "convert -q -f raw -O qcow2 -B b2.qcow2 -F qcow2 b0.raw b1.qcow2",
		"create -q -f qcow2 -b b2.qcow2 -F qcow2 b1.qcow2":
		return true
	}
	return false
}

// guestBytes reads the first 256 KiB of an image with qemu-img (nil when
// it does not open), so that guest data is judged by QEMU.
func guestBytes(t *testing.T, path, format string) []byte {
	t.Helper()
	raw := filepath.Join(t.TempDir(), "g.raw")
	cmd := exec.Command("qemu-img", "dd", "-U", "-f", format, "-O", "raw", "bs=64k", "count=4", "if="+path, "of="+raw)
	if err := cmd.Run(); err != nil {
		return nil
	}
	b, err := os.ReadFile(raw)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// TestReproLocksCommitHeld (issue 14): a commit whose base another
// process holds is refused as qemu-img refuses it, the lock message alone
// ('Failed to get "write" lock' for a qcow2 base read by qemu-io, "resize"
// for a raw base to grow under qemu-nbd), exit 1, and changes nothing:
// a raw base is not grown before its locks are taken.
func TestReproLocksCommitHeld(t *testing.T) {
	for _, c := range []struct {
		name   string
		grow   bool     // resize the top to 2 MiB first: the base grows
		base   string   // the held file
		holder []string // qemu-io arguments, or nil for qemu-nbd -r
	}{
		{"qcow2 base held rw", false, "b1.qcow2", []string{"-f", "qcow2"}},
		{"qcow2 base held ro", false, "b1.qcow2", []string{"-r", "-f", "qcow2"}},
		{"qcow2 base held shared", false, "b1.qcow2", []string{"-r", "-U", "-f", "qcow2"}},
		{"raw base held ro, grown", true, "b0.raw", []string{"-r", "-f", "raw"}},
		{"raw base exported, grown", true, "b0.raw", nil},
		{"raw base exported", false, "b0.raw", nil},
	} {
		t.Run(c.name, func(t *testing.T) {
			top := "b2.qcow2"
			if c.base == "b0.raw" {
				top = "b1.qcow2"
			}
			run := func(img func(testing.TB, string, ...string) result) (result, map[string][]byte, map[string][]byte) {
				dir := t.TempDir()
				fromFixture(t, "lock-chain", lockChain, dir)
				if c.grow {
					testutil.QemuImg(t, "resize", "-q", "-f", "qcow2", filepath.Join(dir, top), "2M")
				}
				before := readFiles(t, dir)
				path := filepath.Join(dir, c.base)
				if c.holder != nil {
					testutil.HoldWithQemuIO(t, path, c.holder...)
				} else {
					n := len(testutil.LockedBytes(t, path))
					stop := testutil.StartUntil(t, exec.Command("qemu-nbd", "-r", "-f", "raw", "-k", filepath.Join(dir, "s"), path),
						func() bool { return len(testutil.LockedBytes(t, path)) != n })
					defer stop()
				}
				r := img(t, dir, "commit", "-f", "qcow2", top)
				return r, before, readFiles(t, dir)
			}
			q, _, _ := run(func(t testing.TB, dir string, a ...string) result { return qemuImg(t, dir, a...) })
			o, before, after := run(ovisImg)
			sameResult(t, c.name, q, o)
			if o.code != 0 {
				for _, f := range lockChainFiles {
					if !bytes.Equal(before[f], after[f]) {
						t.Errorf("refused, yet ovis changed %s", f)
					}
				}
			}
		})
	}
}
