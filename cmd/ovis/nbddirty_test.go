package main

import (
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ovis-storage/ovis/internal/testutil"
)

// TestNBDRepairsDirtyImageLikeQemu: qemu-nbd repairs a dirty
// lazy-refcounts image it opens for writing and prints the repair; ovis
// nbd does the same, with the same lines, and leaves an image qemu-img
// check finds clean. Opened read-only, neither repairs.
func TestNBDRepairsDirtyImageLikeQemu(t *testing.T) {
	for _, readOnly := range []bool{false, true} {
		name := "rw"
		if readOnly {
			name = "ro"
		}
		t.Run(name, func(t *testing.T) {
			dir := t.TempDir()
			dirty := filepath.Join(dir, "dirty.qcow2")
			testutil.QemuImg(t, "create", "-q", "-f", "qcow2", "-o", "lazy_refcounts=on", dirty, "1M")
			// A write then a crash leaves the dirty bit and refcounts
			// that lag behind.
			testutil.QemuIOExit(t, dirty, "qcow2", "write -P 1 0 64k", "sigraise 9")
			if _, code := testutil.QemuImgExit(t, "check", dirty); code == 0 {
				t.Fatal("the crashed image is clean; the test needs a dirty one")
			}
			q, o := filepath.Join(dir, "q.qcow2"), filepath.Join(dir, "o.qcow2")
			copyFile(t, dirty, q)
			copyFile(t, dirty, o)
			var extra []string
			if readOnly {
				extra = []string{"-r"}
			}

			// Both servers are started alike and found ready by their
			// socket file: a probing connection would be reported.
			serve := func(prog string, image string) string {
				sock := filepath.Join(shortTempDir(t), "s.sock")
				var stderr syncBuffer
				cmd := exec.Command(prog, append(append([]string{"nbd", "-t", "-k", sock, "-f", "qcow2"}, extra...), image)...)
				if prog == "qemu-nbd" {
					cmd.Args = append(cmd.Args[:1], cmd.Args[2:]...)
				}
				cmd.Stderr = &stderr
				if err := cmd.Start(); err != nil {
					t.Fatal(err)
				}
				done := make(chan struct{})
				go func() { cmd.Wait(); close(done) }()
				deadline := time.Now().Add(20 * time.Second)
				for !fileExists(sock) {
					select {
					case <-done:
						t.Fatalf("%s exited: %s", prog, stderr.String())
					default:
					}
					if time.Now().After(deadline) {
						cmd.Process.Kill()
						t.Fatalf("%s not serving after 20s", prog)
					}
					time.Sleep(5 * time.Millisecond)
				}
				readNBD(t, "nbd+unix:///?socket="+sock)
				cmd.Process.Signal(syscall.SIGTERM)
				<-done
				return stderr.String()
			}
			qe, oe := serve("qemu-nbd", q), serve(ovisBin, o)
			if qe != oe {
				t.Errorf("stderr differs\nqemu-nbd: %q\n    ovis: %q", qe, oe)
			}
			_, qc := testutil.QemuImgExit(t, "check", q)
			_, oc := testutil.QemuImgExit(t, "check", o)
			if qc != oc {
				t.Errorf("qemu-img check after serving: ovis's image exits %d, qemu-nbd's %d", oc, qc)
			}
			if !readOnly && oc != 0 {
				t.Errorf("ovis nbd left the image dirty: qemu-img check exits %d", oc)
			}
			testutil.QemuIO(t, o, "qcow2", "read -P 1 0 64k")
		})
	}
}

// readNBD checks with a read-only qemu-io that the export reads the
// pattern the dirty image was written with.
func readNBD(t *testing.T, uri string) {
	t.Helper()
	if out := runTool(t, "qemu-io", "-r", "-f", "raw", "-c", "read -P 1 0 64k", uri); strings.Contains(out, "failed") {
		t.Fatalf("qemu-io %s: %s", uri, out)
	}
}
