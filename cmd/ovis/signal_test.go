package main

import (
	"bytes"
	"encoding/binary"
	"errors"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/ovis-storage/ovis/internal/testutil"
)

// TestSignalStopsImgVerbs sends SIGTERM to img verbs 300 ms into a long
// run: each must exit within 3 s with 143 (128 + SIGTERM), as a shell
// reports qemu-img dying of it, and leave the image it writes passing
// qemu-img check, leaked clusters allowed.
func TestSignalStopsImgVerbs(t *testing.T) {
	dir := t.TempDir()
	data := filepath.Join(dir, "data.qcow2")
	qemuImg(t, dir, "create", "-q", "-f", "qcow2", data, "2G")
	testutil.QemuIO(t, data, "qcow2", "write -P 0x5a 0 1G")

	cases := []struct {
		name  string
		setup func(t *testing.T, dir string) // makes the images args name
		args  []string
		check string // the image written, checked afterwards
		// prompt: the verb must stop on its own, not be ended by the
		// grace period's exit (which leaves leaks just as well).
		prompt bool
	}{
		{
			name:  "convert",
			args:  []string{"convert", "-O", "qcow2", "-t", "writethrough", data, "out.qcow2"},
			check: "out.qcow2",
		},
		{
			name: "bench",
			setup: func(t *testing.T, dir string) {
				qemuImg(t, dir, "create", "-q", "-f", "qcow2", "b.qcow2", "1G")
			},
			args:  []string{"bench", "-w", "-c", "10000000", "b.qcow2"},
			check: "b.qcow2",
		},
		{
			name: "resize",
			setup: func(t *testing.T, dir string) {
				qemuImg(t, dir, "create", "-q", "-f", "qcow2", "r.qcow2", "1M")
			},
			args:  []string{"resize", "--preallocation=metadata", "r.qcow2", "1T"},
			check: "r.qcow2",
		},
		{
			name: "rebase",
			setup: func(t *testing.T, dir string) {
				qemuImg(t, dir, "create", "-q", "-f", "qcow2", "base.qcow2", "2G")
				qemuImg(t, dir, "create", "-q", "-f", "qcow2", "-b", data, "-F", "qcow2", "top.qcow2")
			},
			args:  []string{"rebase", "-b", "base.qcow2", "-F", "qcow2", "top.qcow2"},
			check: "top.qcow2",
		},
		{
			name: "commit",
			setup: func(t *testing.T, dir string) {
				qemuImg(t, dir, "create", "-q", "-f", "qcow2", "base.qcow2", "2G")
				qemuImg(t, dir, "convert", "-O", "qcow2", "-B", "base.qcow2", "-F", "qcow2", data, "top.qcow2")
			},
			args:  []string{"commit", "top.qcow2"},
			check: "base.qcow2",
		},
		{
			// Tens of thousands of leaked clusters, each freed (and
			// zeroed) by its own refcount write: seconds of repairs.
			name:   "check -r all",
			setup:  leakEverything,
			args:   []string{"check", "-r", "all", "l.qcow2"},
			check:  "l.qcow2",
			prompt: true,
		},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			dir := t.TempDir()
			if c.setup != nil {
				c.setup(t, dir)
			}
			if c.name == "check -r all" {
				// Meant to be stopped with leaks left: the damage is
				// still there before the repair.
				if r := qemuImg(t, dir, "check", c.check); r.code != 3 {
					t.Fatalf("qemu-img check %s before the repair: exit %d, want 3\n%s", c.check, r.code, r.stdout)
				}
			}
			cmd := exec.Command(ovisBin, append([]string{"img"}, c.args...)...)
			cmd.Dir = dir
			var stderr bytes.Buffer
			cmd.Stderr = &stderr
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			exited := make(chan error, 1)
			go func() { exited <- cmd.Wait() }()
			time.Sleep(300 * time.Millisecond)
			if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
				t.Fatalf("ovis img %s ended before the signal: %v", c.name, err)
			}
			sent := time.Now()
			var err error
			select {
			case err = <-exited:
			case <-time.After(3 * time.Second):
				cmd.Process.Kill()
				<-exited
				t.Fatalf("ovis img %s still running 3s after SIGTERM\nstderr: %s", c.name, stderr.String())
			}
			var ee *exec.ExitError
			if !errors.As(err, &ee) || ee.ExitCode() != 128+int(syscall.SIGTERM) {
				t.Errorf("ovis img %s after SIGTERM: %v, want exit status 143\nstderr: %s", c.name, err, stderr.String())
			}
			if c.prompt && bytes.Contains(stderr.Bytes(), []byte("not stopped after")) {
				t.Errorf("ovis img %s did not stop on its own", c.name)
			}
			// The last line says why it stopped; a stopped check prints
			// thousands of repairs before it.
			msg := bytes.TrimSpace(stderr.Bytes())
			t.Logf("stopped %v after SIGTERM: %s", time.Since(sent).Round(time.Millisecond), msg[bytes.LastIndexByte(msg, '\n')+1:])
			if r := qemuImg(t, dir, "check", c.check); r.code != 0 && r.code != 3 {
				t.Errorf("qemu-img check %s after SIGTERM: exit %d\n%s%s", c.check, r.code, r.stdout, r.stderr)
			}
		})
	}
}

// leakEverything makes l.qcow2, a 2 GiB image with metadata
// preallocation (every cluster allocated, none written), then empties its
// L1 table: every L2 table and data cluster is leaked.
func leakEverything(t *testing.T, dir string) {
	t.Helper()
	qemuImg(t, dir, "create", "-q", "-f", "qcow2", "-o", "preallocation=metadata", "l.qcow2", "2G")
	p := patchQcow2(t, filepath.Join(dir, "l.qcow2"))
	n := binary.BigEndian.Uint32(p.read(36, 4))
	if _, err := p.f.WriteAt(make([]byte, 8*n), int64(p.l1Offset)); err != nil {
		t.Fatal(err)
	}
}
