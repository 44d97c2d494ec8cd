package main

import (
	"bufio"
	"io"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ovis-storage/ovis/internal/testutil"
)

// upURIRE finds the export's URL in what ovis up prints.
var upURIRE = regexp.MustCompile(`nbd://127\.0\.0\.1:\d+/disk0`)

// TestUp runs ovis up in an empty folder: it creates a sparse 20 GiB
// qcow2 disk, serves it as export disk0 (nbdinfo sees it, qemu-io writes
// to it), prints the commands that attach it, and on SIGINT exits 0 with
// the image closed cleanly and the data in it. A second run keeps the
// disk.
func TestUp(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	disk := filepath.Join(dir, "ovis-data", "disk0.qcow2")

	cmd := exec.Command(serverBin, "up", "--image", "--listen", "127.0.0.1:0")
	cmd.Dir = dir
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	stderr := &syncBuffer{}
	cmd.Stderr = stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	out := &syncBuffer{}
	lines := make(chan string, 64)
	go func() {
		sc := bufio.NewScanner(io.TeeReader(stdout, out))
		for sc.Scan() {
			lines <- sc.Text()
		}
		close(lines)
		exited <- cmd.Wait()
	}()
	t.Cleanup(func() {
		if cmd.ProcessState == nil {
			cmd.Process.Kill()
		}
	})

	// Read until the last of the attach commands.
	var uri string
	timeout := time.After(30 * time.Second)
	for uri == "" || !strings.Contains(out.String(), "qemu-img info "+uri) {
		select {
		case l, ok := <-lines:
			if !ok {
				t.Fatalf("ovis up ended before serving: %v\nstdout: %s\nstderr: %s", <-exited, out, stderr)
			}
			if m := upURIRE.FindString(l); m != "" && uri == "" {
				uri = m
			}
		case <-timeout:
			t.Fatalf("ovis up printed no URL in 30s\nstdout: %s\nstderr: %s", out, stderr)
		}
	}
	for _, want := range []string{
		disk + " (created, 20 GiB virtual, sparse qcow2)",
		"qemu-system-x86_64 -m 2G -drive file=BOOT.qcow2,format=qcow2,if=virtio -drive file=" + uri + ",format=raw,if=virtio,cache=writeback\n",
		"nbdinfo " + uri + "\n",
	} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("ovis up printed\n%s\nwant a line with %q", out, want)
		}
	}

	e := nbdinfo(t, uri).Exports[0]
	if e.Name != "disk0" || e.Size != 20<<30 || e.ReadOnly || !e.CanMultiConn {
		t.Errorf("nbdinfo: export %q of %d bytes, read-only %v, multi-conn %v; want disk0, 20 GiB, writable, multi-conn",
			e.Name, e.Size, e.ReadOnly, e.CanMultiConn)
	}
	qemuIONBD(t, uri, "write -P 0x6b 1M 192k", "write -P 0x6c 19G 4k")

	cmd.Process.Signal(syscall.SIGINT)
	for range lines {
	}
	select {
	case err := <-exited:
		if err != nil {
			t.Fatalf("ovis up after SIGINT: %v\nstderr: %s", err, stderr)
		}
	case <-time.After(60 * time.Second):
		t.Fatal("ovis up still running 60s after SIGINT")
	}
	if !strings.Contains(out.String(), "stopped: "+disk+" is flushed and closed") {
		t.Errorf("ovis up did not say it stopped cleanly:\n%s", out)
	}
	testutil.CheckImage(t, disk)
	testutil.QemuIO(t, disk, "qcow2", "read -P 0x6b 1M 192k", "read -P 0x6c 19G 4k", "read -P 0 0 1M")
	if got := testutil.VirtualSize(t, disk); got != 20<<30 {
		t.Errorf("virtual size %d, want 20 GiB", got)
	}
	if got := testutil.AllocatedBytes(t, disk); got > 4<<20 {
		t.Errorf("the disk takes %d bytes after two small writes, want a sparse image", got)
	}

	// A second run keeps the disk; a bad --listen fails before serving.
	r := ovis(t, dir, "up", "--image", "--listen", "127.0.0.1")
	if r.code != 1 || !strings.Contains(r.stderr, "--listen") {
		t.Errorf("ovis up --listen 127.0.0.1: exit %d, %q", r.code, r.stderr)
	}
	cmd = exec.Command(serverBin, "up", "--image", "--listen", "127.0.0.1:0")
	cmd.Dir = dir
	out = &syncBuffer{}
	cmd.Stdout = out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(30 * time.Second); !strings.Contains(out.String(), "qemu-img info"); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("second ovis up not serving after 30s:\n%s", out)
		}
	}
	if !strings.Contains(out.String(), disk+" (exists)") {
		t.Errorf("second ovis up printed\n%s\nwant the existing disk", out)
	}
	cmd.Process.Signal(syscall.SIGTERM)
	if err := cmd.Wait(); err != nil {
		t.Errorf("second ovis up after SIGTERM: %v", err)
	}
	testutil.CheckImage(t, disk)
}
