package main

import (
	"bufio"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ovis-storage/ovis/internal/testutil"
)

// Regression tests of what a new user meets with `ovis up` and `ovis nbd`
// next to a VM: the printed attach command, stopping under an attached
// client, a busy port or disk, the block_status metric, and export names
// as qemu-nbd answers them.

// upRun is a running `ovis up` started by a test.
type upRun struct {
	*serverProc
	uri string
}

// startUpProcess runs `ovis args...` in dir and gives each line it prints
// on stdout to ready until ready returns true. It fails the test when the
// process ends first or ready is not satisfied within timeout; the
// process is killed when the test ends.
func startUpProcess(t *testing.T, dir string, timeout time.Duration, ready func(line string) bool, args ...string) *upRun {
	t.Helper()
	cmd := exec.Command(serverBin, args...)
	cmd.Dir = dir
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout := &syncBuffer{}
	lines := make(chan string, 64)
	u := &upRun{serverProc: startServerProc(t, cmd, func() {
		sc := bufio.NewScanner(io.TeeReader(out, stdout))
		for sc.Scan() {
			lines <- sc.Text()
		}
		close(lines)
	})}
	u.stdout = stdout
	deadline := time.After(timeout)
	for {
		select {
		case l, ok := <-lines:
			if !ok {
				<-u.exited
				t.Fatalf("ovis %s ended (%v) before it was ready\nstdout: %s\nstderr: %s", args[0], u.err, u.stdout, u.stderr)
			}
			if ready(l) {
				go func() {
					for range lines {
					}
				}()
				return u
			}
		case <-deadline:
			t.Fatalf("ovis %s not ready in %v\nstdout: %s\nstderr: %s", args[0], timeout, u.stdout, u.stderr)
		}
	}
}

// startUp runs `ovis up --image args...` in dir and waits until it has
// printed the last of its attach commands.
func startUp(t *testing.T, dir string, args ...string) *upRun {
	t.Helper()
	uri := ""
	u := startUpProcess(t, dir, 30*time.Second, func(l string) bool {
		if m := upURIRE.FindString(l); m != "" && uri == "" {
			uri = m
		}
		return uri != "" && l == "qemu-img info "+uri
	}, append([]string{"up", "--image"}, args...)...)
	u.uri = uri
	return u
}

// running reports whether the process is still there after d.
func running(exited <-chan struct{}, d time.Duration) bool {
	select {
	case <-exited:
		return false
	case <-time.After(d):
		return true
	}
}

// waitFor waits until s's text contains want.
func waitFor(t *testing.T, what string, s *syncBuffer, want string) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for !strings.Contains(s.String(), want) {
		if time.Now().After(deadline) {
			t.Fatalf("%s: no %q after 20s:\n%s", what, want, s)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestReproUpAttachCommandRuns: the VM command ovis up prints gives the
// disk as a virtio data disk (if=virtio) with memory, next to a boot
// disk, and says so; run as printed (the boot disk made, the CPU held with
// -S) qemu-system-x86_64 accepts it and opens both drives, the NBD one
// from ovis up. The nbdinfo and qemu-img lines are still printed.
func TestReproUpAttachCommandRuns(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	u := startUp(t, dir, "--listen", "127.0.0.1:0")
	out := u.stdout.String()
	var line string
	for _, l := range strings.Split(out, "\n") {
		if strings.HasPrefix(l, "qemu-system-x86_64 ") {
			line = l
		}
	}
	for _, want := range []string{" -m ", "file=BOOT.qcow2,format=qcow2,if=virtio", "file=" + u.uri + ",format=raw,if=virtio,cache=writeback"} {
		if !strings.Contains(line, want) {
			t.Errorf("VM command %q lacks %q", line, want)
		}
	}
	for _, want := range []string{"boot disk", "cache=unsafe", "nbdinfo " + u.uri + "\n", "qemu-img info " + u.uri + "\n",
		"default export, nbd://" + strings.TrimSuffix(strings.TrimPrefix(u.uri, "nbd://"), "disk0") + ", gets disk0"} {
		if !strings.Contains(out, want) {
			t.Errorf("ovis up printed\n%s\nwant %q", out, want)
		}
	}
	testutil.QemuImg(t, "create", "-q", "-f", "qcow2", filepath.Join(dir, "BOOT.qcow2"), "64M")
	args := append(strings.Fields(line)[1:], "-nodefaults", "-display", "none", "-S", "-monitor", "stdio")
	vm := exec.Command("qemu-system-x86_64", args...)
	vm.Dir = dir
	vm.Stdin = strings.NewReader("info block\nquit\n")
	done := make(chan struct{})
	var vmOut []byte
	var vmErr error
	go func() {
		vmOut, vmErr = vm.CombinedOutput()
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(60 * time.Second):
		vm.Process.Kill()
		<-done
		t.Fatalf("qemu-system-x86_64 %q did not quit in 60s:\n%s", args, vmOut)
	}
	if vmErr != nil {
		t.Fatalf("qemu-system-x86_64 %q: %v\n%s", args, vmErr, vmOut)
	}
	for _, want := range []string{"BOOT.qcow2 (qcow2)", u.uri + " (raw)"} {
		if !strings.Contains(string(vmOut), want) {
			t.Errorf("qemu-system-x86_64 info block lacks %q:\n%s", want, vmOut)
		}
	}
	u.cmd.Process.Signal(syscall.SIGINT)
	if code := u.wait(30 * time.Second); code != 0 {
		t.Errorf("ovis up exited %d\n%s", code, u.stderr)
	}
}

// TestReproUpBusyPortChangesNothing: ovis up on a port (or metrics port)
// that is taken says so in its own words and creates no folder and no
// disk; a second ovis up in the same folder on another port is told the
// disk is in use. ovis nbd on a busy port keeps qemu-nbd's wording.
func TestReproUpBusyPortChangesNothing(t *testing.T) {
	t.Parallel()
	busy, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer busy.Close()
	addr := busy.Addr().String()
	_, port, _ := net.SplitHostPort(addr)
	free := "127.0.0.1:" + freePort(t)
	for _, c := range []struct {
		name, want string
		args       []string
	}{
		{"listen", "ovis: up: " + addr + " is in use (another ovis up or NBD server?); stop it or pass --listen HOST:PORT\n",
			[]string{"--listen", addr}},
		{"metrics", "ovis: up: " + addr + " is in use (another ovis up or NBD server?); stop it or pass --metrics HOST:PORT\n",
			[]string{"--listen", free, "--metrics", addr}},
	} {
		dir := t.TempDir()
		r := ovis(t, dir, append([]string{"up", "--image"}, c.args...)...)
		if r.code != 1 || r.stderr != c.want {
			t.Errorf("%s: ovis up exited %d with\n%s\nwant 1 with\n%s", c.name, r.code, r.stderr, c.want)
		}
		if ents, _ := os.ReadDir(dir); len(ents) != 0 {
			t.Errorf("%s: ovis up that could not serve left %v in its folder", c.name, ents)
		}
	}

	// The disk of a running ovis up.
	dir := t.TempDir()
	first := startUp(t, dir, "--listen", "127.0.0.1:0")
	r := ovis(t, dir, "up", "--image", "--listen", "127.0.0.1:0")
	want := "ovis: up: " + filepath.Join("ovis-data", "disk0.qcow2") +
		" is in use by another process (another ovis up in this folder?); stop it or pass --dir DIR\n"
	if r.code != 1 || r.stderr != want {
		t.Errorf("second ovis up exited %d with\n%s\nwant 1 with\n%s", r.code, r.stderr, want)
	}
	first.cmd.Process.Signal(syscall.SIGINT)
	if code := first.wait(30 * time.Second); code != 0 {
		t.Errorf("first ovis up exited %d\n%s", code, first.stderr)
	}

	// ovis nbd is qemu-nbd's drop-in: its words, its status.
	img := filepath.Join(t.TempDir(), "d.qcow2")
	testutil.QemuImg(t, "create", "-q", "-f", "qcow2", img, "1M")
	qo, qe, qc := testutil.RunIn(t, "", "qemu-nbd", "-b", "127.0.0.1", "-p", port, "-f", "qcow2", img)
	oo, oe, oc := testutil.RunIn(t, "", ovisBin, "nbd", "-b", "127.0.0.1", "-p", port, "-f", "qcow2", img)
	if qc != oc || qo != oo || strings.Replace(qe, "qemu-nbd: ", "ovis: ", 1) != oe {
		t.Errorf("busy port: qemu-nbd %d %q %q, ovis nbd %d %q %q", qc, qo, qe, oc, oo, oe)
	}
}

// TestReproUpInterruptWaitsForClients: a first Ctrl-C while a client is
// attached says so and keeps serving (the client's writes succeed); the
// server stops when the client leaves, or at once on a second Ctrl-C; the
// image is flushed and closed either way. ovis nbd does the same on SIGINT,
// but SIGTERM stops it at once with status 0, as it stops qemu-nbd.
func TestReproUpInterruptWaitsForClients(t *testing.T) {
	t.Parallel()
	const msg = "ovis: 1 client is attached: serving until it disconnects, then stopping; Ctrl-C again stops now (its next I/O fails)\n"
	t.Run("up second Ctrl-C", func(t *testing.T) {
		t.Parallel()
		dir := t.TempDir()
		u := startUp(t, dir, "--listen", "127.0.0.1:0")
		q := startQemuIO(t, u.uri)
		q.do("write -P 0x5a 0 64k", "wrote")
		u.cmd.Process.Signal(syscall.SIGINT)
		waitFor(t, "ovis up stderr", u.stderr, msg)
		if !running(u.exited, 500*time.Millisecond) {
			t.Fatalf("ovis up stopped on the first Ctrl-C with a client attached\n%s", u.stderr)
		}
		q.do("write -P 0x5b 1M 64k", "wrote")
		q.do("read -P 0x5b 1M 64k", "read 65536/65536")
		u.cmd.Process.Signal(syscall.SIGINT)
		if code := u.wait(30 * time.Second); code != 0 {
			t.Fatalf("ovis up exited %d after the second Ctrl-C\n%s", code, u.stderr)
		}
		disk := filepath.Join(dir, "ovis-data", "disk0.qcow2")
		if !strings.Contains(u.stdout.String(), "stopped: "+disk+" is flushed and closed") {
			t.Errorf("ovis up did not say it stopped cleanly:\n%s", u.stdout)
		}
		q.kill()
		testutil.CheckImage(t, disk)
		testutil.QemuIO(t, disk, "qcow2", "read -P 0x5a 0 64k", "read -P 0x5b 1M 64k")
	})
	t.Run("up client leaves", func(t *testing.T) {
		t.Parallel()
		dir := t.TempDir()
		u := startUp(t, dir, "--listen", "127.0.0.1:0")
		q := startQemuIO(t, u.uri)
		q.do("write -P 0x6a 0 64k", "wrote")
		u.cmd.Process.Signal(syscall.SIGINT)
		waitFor(t, "ovis up stderr", u.stderr, msg)
		q.do("write -P 0x6b 64k 64k", "wrote")
		q.in.Close() // qemu-io quits at the end of its input
		if code := u.wait(30 * time.Second); code != 0 {
			t.Fatalf("ovis up exited %d after its client left\n%s", code, u.stderr)
		}
		disk := filepath.Join(dir, "ovis-data", "disk0.qcow2")
		testutil.CheckImage(t, disk)
		testutil.QemuIO(t, disk, "qcow2", "read -P 0x6a 0 64k", "read -P 0x6b 64k 64k")
	})
	t.Run("up no client", func(t *testing.T) {
		t.Parallel()
		u := startUp(t, t.TempDir(), "--listen", "127.0.0.1:0")
		u.cmd.Process.Signal(syscall.SIGINT)
		if code := u.wait(30 * time.Second); code != 0 || u.stderr.String() != "" {
			t.Errorf("ovis up with no client: exit %d, stderr %q; want 0 and nothing", code, u.stderr)
		}
	})
	t.Run("nbd SIGINT", func(t *testing.T) {
		t.Parallel()
		img := filepath.Join(t.TempDir(), "d.qcow2")
		testutil.QemuImg(t, "create", "-q", "-f", "qcow2", img, "4M")
		s := startNBD(t, nbdRun{tcp: true, args: []string{"-t", "-f", "qcow2", img}})
		q := startQemuIO(t, s.uri)
		q.do("write -P 0x7a 0 64k", "wrote")
		s.cmd.Process.Signal(syscall.SIGINT)
		waitFor(t, "ovis nbd stderr", s.stderr, msg)
		q.do("write -P 0x7b 64k 64k", "wrote")
		s.stop(syscall.SIGINT)
		q.kill()
		testutil.CheckImage(t, img)
		testutil.QemuIO(t, img, "qcow2", "read -P 0x7a 0 64k", "read -P 0x7b 64k 64k")
	})
	// SIGTERM with a client attached: both stop at once, status 0,
	// nothing on stderr.
	for _, srv := range servers {
		t.Run(srv+" SIGTERM", func(t *testing.T) {
			t.Parallel()
			dir := t.TempDir()
			testutil.QemuImg(t, "create", "-q", "-f", "qcow2", filepath.Join(dir, "d.qcow2"), "4M")
			listen, uri := peerAddr(t, true)
			p := startPeer(t, binOf(srv), dir, listen, uri, "-t", "-f", "qcow2", "d.qcow2")
			q := startQemuIO(t, uri)
			q.do("write -P 0x7c 0 64k", "wrote")
			start := time.Now()
			if code := p.stop(); code != 0 || p.stderr.String() != "" {
				t.Errorf("%s after SIGTERM with a client: exit %d, stderr %q; want 0 and nothing", srv, code, p.stderr)
			}
			if d := time.Since(start); d > 10*time.Second {
				t.Errorf("%s took %v to stop on SIGTERM", srv, d)
			}
			q.kill()
			testutil.CheckImage(t, filepath.Join(dir, "d.qcow2"))
		})
	}
}

// TestReproReadmeUp: the README still opens with `go run ./cmd/ovis up`
// and `./scripts/test.sh`, shows how to build the binary (the build it
// shows works, and the binary runs ovis up from another folder, making
// ovis-data/ there), and shows the attach commands ovis up prints.
func TestReproReadmeUp(t *testing.T) {
	t.Parallel()
	b, err := os.ReadFile(filepath.Join("..", "..", "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	readme := string(b)
	if !strings.Contains(readme, "\n```sh\ngo run ./cmd/ovis up\n./scripts/test.sh\n```\n") {
		t.Errorf("README does not open with go run ./cmd/ovis up and ./scripts/test.sh")
	}
	const build = "go build -o ovis ./cmd/ovis"
	if !strings.Contains(readme, "\n"+build+" ") || !strings.Contains(readme, "\ngo install ./cmd/ovis ") {
		t.Errorf("README shows neither %q nor go install ./cmd/ovis", build)
	}
	bin := filepath.Join(t.TempDir(), "ovis")
	args := strings.Fields(strings.Replace(build, "-o ovis", "-o "+bin, 1))
	c := exec.Command(args[0], args[1:]...)
	c.Dir = filepath.Join("..", "..")
	if out, err := c.CombinedOutput(); err != nil {
		t.Fatalf("%s: %v\n%s", build, err, out)
	}
	dir := t.TempDir()
	cmd := exec.Command(bin, "up", "--listen", "127.0.0.1:0", "--node-listen", "127.0.0.1:0", "--etcd-listen", "http://127.0.0.1:0", "--etcd-peer", "http://127.0.0.1:0")
	cmd.Dir = dir
	out := &syncBuffer{}
	cmd.Stdout = out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "built ovis up", out, "qemu-img info nbd://")
	cmd.Process.Signal(syscall.SIGINT)
	if err := cmd.Wait(); err != nil {
		t.Errorf("built ovis up: %v\n%s", err, out)
	}
	if _, err := os.Stat(filepath.Join(dir, "ovis-data", "node1", "node-id")); err != nil {
		t.Errorf("built ovis up made no node in its folder: %v", err)
	}
	// What the README shows is what ovis up prints, at the default port.
	for _, l := range strings.Split(portRE.ReplaceAllString(out.String(), "127.0.0.1:10809"), "\n") {
		if strings.HasPrefix(l, "qemu-system-x86_64 ") || strings.HasPrefix(l, "nbdinfo ") || strings.HasPrefix(l, "qemu-img ") {
			if !strings.Contains(readme, "\n"+l+"\n") {
				t.Errorf("README lacks the line ovis up prints:\n%s", l)
			}
		}
	}
}
