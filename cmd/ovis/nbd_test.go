package main

import (
	"bufio"
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/sha256"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"math/big"
	mrand "math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/ovis-storage/ovis/internal/testutil"
)

// The tests of `ovis nbd` run the built binary and talk to it with real
// NBD clients: qemu-io, qemu-img, nbdinfo, nbdcopy and fio.

// nbdRun says how to start one `ovis nbd`.
type nbdRun struct {
	// tcp listens on a free loopback port instead of a unix socket.
	tcp bool
	// export is passed as -x and put in the URI.
	export string
	// env is added to the server's environment.
	env []string
	// args are the other options and the FILE.
	args []string
}

// nbdServer is a running `ovis nbd` started by a test.
type nbdServer struct {
	*serverProc
	// uri is the export's NBD URI; addr the TCP address or socket path.
	uri, addr string
}

// serverProc is a server process a test started (`ovis nbd`, `ovis up`,
// qemu-nbd): its stderr is kept, its exit watched, and it is killed
// when the test ends if it still runs.
type serverProc struct {
	t      *testing.T
	cmd    *exec.Cmd
	stdout *syncBuffer // what it printed, when its caller keeps it
	stderr *syncBuffer
	exited chan struct{} // closed once it has exited
	code   int           // its exit status, once exited
	err    error         // what Wait returned, once exited
}

// startServerProc starts cmd, keeping its stderr. read, when not nil,
// runs first in the goroutine that then waits for the process (it reads
// a stdout pipe the caller made).
func startServerProc(t *testing.T, cmd *exec.Cmd, read func()) *serverProc {
	t.Helper()
	p := &serverProc{t: t, cmd: cmd, stderr: &syncBuffer{}, exited: make(chan struct{})}
	cmd.Stderr = p.stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() {
		if read != nil {
			read()
		}
		p.err = cmd.Wait()
		p.code = cmd.ProcessState.ExitCode()
		close(p.exited)
	}()
	t.Cleanup(func() {
		select {
		case <-p.exited:
		default:
			cmd.Process.Kill()
			<-p.exited
		}
	})
	return p
}

// wait waits at most d for the server to exit on its own and returns
// its exit code; it fails the test after d.
func (p *serverProc) wait(d time.Duration) int {
	p.t.Helper()
	select {
	case <-p.exited:
		return p.code
	case <-time.After(d):
		out := ""
		if p.stdout != nil {
			out = "\nstdout: " + p.stdout.String()
		}
		p.t.Fatalf("%s still running after %v%s\nstderr: %s", strings.Join(p.cmd.Args, " "), d, out, p.stderr)
		return -1
	}
}

// syncBuffer is a bytes.Buffer safe to write from exec's copier and read
// from the test.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// shortTempDir is a temporary folder with a short path, so that unix
// socket paths stay under the 108-byte limit.
func shortTempDir(t testing.TB) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "ovis-nbd-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

// freePort returns a loopback TCP port that was free a moment ago.
func freePort(t testing.TB) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return strconv.Itoa(l.Addr().(*net.TCPAddr).Port)
}

// startNBD starts `ovis nbd` and waits until it accepts connections. The
// server is killed when the test ends if it is still running.
func startNBD(t *testing.T, r nbdRun) *nbdServer {
	t.Helper()
	s := &nbdServer{}
	var listen []string
	if r.tcp {
		port := freePort(t)
		s.addr = net.JoinHostPort("127.0.0.1", port)
		s.uri = "nbd://" + s.addr + "/" + r.export
		listen = []string{"-b", "127.0.0.1", "-p", port}
	} else {
		s.addr = filepath.Join(shortTempDir(t), "s.sock")
		s.uri = "nbd+unix:///" + r.export + "?socket=" + s.addr
		listen = []string{"-k", s.addr}
	}
	args := append([]string{"nbd"}, listen...)
	if r.export != "" {
		args = append(args, "-x", r.export)
	}
	cmd := exec.Command(serverBin, append(args, r.args...)...)
	cmd.Env = append(os.Environ(), r.env...)
	s.serverProc = startServerProc(t, cmd, nil)
	network := "unix"
	if r.tcp {
		network = "tcp"
	}
	deadline := time.Now().Add(20 * time.Second)
	for {
		select {
		case <-s.exited:
			t.Fatalf("ovis %s exited with %d before serving\n%s", strings.Join(s.cmd.Args[1:], " "), s.code, s.stderr)
		default:
		}
		if c, err := net.Dial(network, s.addr); err == nil {
			c.Close()
			return s
		}
		if time.Now().After(deadline) {
			t.Fatalf("ovis nbd not listening on %s after 20s\n%s", s.addr, s.stderr)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// stop sends sig and waits for the server to exit. It fails the test
// unless a SIGINT or SIGTERM ends it with status 0.
func (s *nbdServer) stop(sig syscall.Signal) {
	s.t.Helper()
	s.cmd.Process.Signal(sig)
	code := s.wait(60 * time.Second)
	if sig != syscall.SIGKILL && code != 0 {
		s.t.Fatalf("ovis nbd exited with %d after %v\n%s", code, sig, s.stderr)
	}
}

// runTool runs a tool and returns its standard output, failing the test
// (quoting both outputs) when it exits non-zero.
func runTool(t testing.TB, name string, args ...string) string {
	t.Helper()
	out, errOut, code := testutil.RunIn(t, "", name, args...)
	if code != 0 {
		t.Fatalf("%s %s: exit %d\nstderr: %s\nstdout: %s", name, strings.Join(args, " "), code, errOut, out)
	}
	return out
}

// qemuIOCmds returns n qemu-io commands of random writes into a device of
// size bytes: pattern writes (some FUA) and zero writes (some that may
// unmap), at unaligned offsets and lengths.
func qemuIOCmds(seed uint64, size int64, n int) []string {
	r := mrand.New(mrand.NewPCG(seed, 1))
	var cmds []string
	for range n {
		off := r.Int64N(size - 1)
		ln := 1 + r.Int64N(min(300<<10, size-off))
		pat := 1 + r.IntN(255)
		switch r.IntN(7) {
		case 0, 1, 2:
			cmds = append(cmds, fmt.Sprintf("write -P 0x%02x %d %d", pat, off, ln))
		case 3:
			cmds = append(cmds, fmt.Sprintf("write -f -P 0x%02x %d %d", pat, off, ln))
		case 4:
			cmds = append(cmds, fmt.Sprintf("write -z %d %d", off, ln))
		case 5:
			off &^= 64<<10 - 1
			ln = min(int64(1+r.IntN(3))<<16, size-off)
			cmds = append(cmds, fmt.Sprintf("write -z -u %d %d", off, ln))
		case 6:
			cmds = append(cmds, fmt.Sprintf("write -P 0x%02x %d %d", pat, off, min(ln, 511)))
		}
	}
	return append(cmds, "flush")
}

// qemuIONBD runs qemu-io commands on an NBD URI with -t writeback, so
// that writes go out as plain writes (FUA only for write -f) followed by
// the flush the commands end with; qemu-io's default, writethrough, would
// make every write FUA. It fails the test when a command fails.
func qemuIONBD(t *testing.T, uri string, cmds ...string) {
	t.Helper()
	args := []string{"-t", "writeback", "-f", "raw"}
	for _, c := range cmds {
		args = append(args, "-c", c)
	}
	if out := runTool(t, "qemu-io", append(args, uri)...); strings.Contains(out, "failed") {
		t.Fatalf("qemu-io %s: %s", uri, out)
	}
}

// newNBDImage makes an image of the format and size in dir and a raw mirror
// of it full of zeros; it returns both paths.
func newNBDImage(t *testing.T, dir, format string, size int64) (image, mirror string) {
	t.Helper()
	image = filepath.Join(dir, "disk."+format)
	mirror = filepath.Join(dir, "mirror.raw")
	testutil.QemuImg(t, "create", "-q", "-f", format, image, strconv.FormatInt(size, 10))
	testutil.QemuImg(t, "create", "-q", "-f", "raw", mirror, strconv.FormatInt(size, 10))
	return image, mirror
}

// compareRaw runs qemu-img compare of src (format fmt) against the
// raw mirror and fails the test on a difference.
func compareRaw(t *testing.T, src, format, mirror string) {
	t.Helper()
	out, code := testutil.QemuImgExit(t, "compare", "-f", format, "-F", "raw", src, mirror)
	if code != 0 {
		t.Fatalf("qemu-img compare %s %s: exit %d\n%s", src, mirror, code, out)
	}
}

// TestNBDQemuIO writes randomly through qemu-io over a unix socket and
// over TCP into qcow2 and raw images, applies the same writes to a raw
// mirror, and compares: over NBD while serving, and the image file after
// a SIGTERM.
func TestNBDQemuIO(t *testing.T) {
	t.Parallel()
	const size = 8 << 20
	for i, tc := range []struct {
		format string
		tcp    bool
	}{{"qcow2", false}, {"raw", true}, {"qcow2", true}, {"raw", false}} {
		name := tc.format + map[bool]string{false: "/unix", true: "/tcp"}[tc.tcp]
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			dir := t.TempDir()
			image, mirror := newNBDImage(t, dir, tc.format, size)
			s := startNBD(t, nbdRun{tcp: tc.tcp, export: "e", args: []string{"-t", "-f", tc.format, image}})
			cmds := qemuIOCmds(uint64(i), size, 40)
			qemuIONBD(t, s.uri, cmds...)
			testutil.QemuIO(t, mirror, "raw", cmds...)
			compareRaw(t, s.uri, "raw", mirror)
			s.stop(syscall.SIGTERM)
			if tc.format == "qcow2" {
				testutil.CheckImage(t, image)
			}
			compareRaw(t, image, tc.format, mirror)
			if _, err := os.Stat(s.addr); !tc.tcp && !os.IsNotExist(err) {
				t.Errorf("socket %s left behind: %v", s.addr, err)
			}
		})
	}
}

// nbdInfo is the part of `nbdinfo --json` the tests read.
type nbdInfo struct {
	TLS     bool `json:"TLS"`
	Exports []struct {
		Name         string   `json:"export-name"`
		Description  string   `json:"description"`
		Contexts     []string `json:"contexts"`
		ReadOnly     bool     `json:"is_read_only"`
		CanFlush     bool     `json:"can_flush"`
		CanFUA       bool     `json:"can_fua"`
		CanTrim      bool     `json:"can_trim"`
		CanZero      bool     `json:"can_zero"`
		CanMultiConn bool     `json:"can_multi_conn"`
		Size         int64    `json:"export-size"`
	} `json:"exports"`
}

// nbdinfo runs `nbdinfo --json args... uri` and decodes it.
func nbdinfo(t *testing.T, uri string, args ...string) nbdInfo {
	t.Helper()
	out := runTool(t, "nbdinfo", append(append([]string{"--json"}, args...), uri)...)
	var info nbdInfo
	if err := json.Unmarshal([]byte(out), &info); err != nil || len(info.Exports) != 1 {
		t.Fatalf("nbdinfo --json %s: %v\n%s", uri, err, out)
	}
	return info
}

// TestNBDInfo checks the flags and metadata contexts nbdinfo sees for
// -r, -e, --discard, -x and -D, against qemu-nbd 7.2's rules:
// CAN_MULTI_CONN when more than one connection is allowed.
func TestNBDInfo(t *testing.T) {
	t.Parallel()
	type flags struct{ ro, trim, zero, multi bool }
	for _, tc := range []struct {
		name string
		args []string
		want flags
	}{
		{"default", nil, flags{trim: true, zero: true}},
		{"e4", []string{"-e", "4"}, flags{trim: true, zero: true, multi: true}},
		{"e0", []string{"-e", "0"}, flags{trim: true, zero: true, multi: true}},
		{"discard-unmap", []string{"--discard", "unmap"}, flags{trim: true, zero: true}},
		{"ro", []string{"-r"}, flags{ro: true}},
		{"ro-e2", []string{"-r", "-e", "2"}, flags{ro: true, multi: true}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			// An image each: a writer keeps other servers out.
			image := filepath.Join(t.TempDir(), "disk.qcow2")
			testutil.QemuImg(t, "create", "-q", "-f", "qcow2", image, "1M")
			args := append([]string{"-t", "-D", "disk " + tc.name}, tc.args...)
			s := startNBD(t, nbdRun{export: tc.name, args: append(args, image)})
			e := nbdinfo(t, s.uri).Exports[0]
			got := flags{e.ReadOnly, e.CanTrim, e.CanZero, e.CanMultiConn}
			if got != tc.want {
				t.Errorf("read-only, trim, zero, multi-conn = %+v, want %+v", got, tc.want)
			}
			if !e.CanFlush || !e.CanFUA {
				t.Errorf("can_flush %v, can_fua %v, want both", e.CanFlush, e.CanFUA)
			}
			if e.Name != tc.name || e.Description != "disk "+tc.name || e.Size != 1<<20 {
				t.Errorf("export %q (%q), %d bytes", e.Name, e.Description, e.Size)
			}
			if strings.Join(e.Contexts, ",") != "base:allocation" { // qemu:allocation-depth needs -A
				t.Errorf("contexts %q", e.Contexts)
			}
			s.stop(syscall.SIGTERM)
		})
	}
}

// TestNBDCopy copies a raw file into an exported qcow2 image and back out
// with nbdcopy (four connections each way, CAN_MULTI_CONN with -e 4).
func TestNBDCopy(t *testing.T) {
	t.Parallel()
	const size = 8 << 20
	dir := t.TempDir()
	image, src := newNBDImage(t, dir, "qcow2", size)
	testutil.QemuIO(t, src, "raw", qemuIOCmds(7, size, 30)...)
	s := startNBD(t, nbdRun{args: []string{"-t", "-e", "4", image}})
	runTool(t, "nbdcopy", src, s.uri)
	out := filepath.Join(dir, "out.raw")
	runTool(t, "nbdcopy", s.uri, out)
	compareRaw(t, s.uri, "raw", src)
	s.stop(syscall.SIGTERM)
	a, _ := os.ReadFile(src)
	b, _ := os.ReadFile(out)
	if !bytes.Equal(a, b) {
		t.Error("nbdcopy out of the export differs from what was copied in")
	}
	testutil.CheckImage(t, image)
	compareRaw(t, image, "qcow2", src)
}

// TestNBDFio runs fio's nbd engine over four connections (-e 4), eight
// requests deep each, of random writes verified with crc32c, then checks
// the image.
func TestNBDFio(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	image := filepath.Join(dir, "disk.qcow2")
	testutil.QemuImg(t, "create", "-q", "-f", "qcow2", image, "16M")
	s := startNBD(t, nbdRun{args: []string{"-t", "-e", "4", image}})
	runTool(t, "fio", "--name=nbd", "--ioengine=nbd", "--uri="+s.uri,
		"--rw=randwrite", "--bs=4k", "--iodepth=8", "--numjobs=4",
		"--size=2M", "--offset_increment=4M", "--verify=crc32c", "--verify_fatal=1",
		"--group_reporting")
	s.stop(syscall.SIGTERM)
	testutil.CheckImage(t, image)
}

// TestNBDCacheDurable writes through qemu-io over NBD, as plain writes
// (qemu-io -t writeback: no FUA, no flush), and kills the server with
// SIGKILL while the client is still connected. Under writethrough and
// directsync the server makes every write FUA, so the data must be in the
// image file. That is the closest a test gets to pulling the plug: the
// page cache survives SIGKILL, but qcow2's L2 tables are written only by
// a flush or a FUA write, so without FUA a write into a new cluster is
// lost — the writeback case checks that the test can tell.
func TestNBDCacheDurable(t *testing.T) {
	t.Parallel()
	for _, mode := range []string{"writethrough", "directsync", "writeback"} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			dir := t.TempDir()
			image := filepath.Join(dir, "disk.qcow2")
			testutil.QemuImg(t, "create", "-q", "-f", "qcow2", image, "4M")
			s := startNBD(t, nbdRun{args: []string{"-t", "--cache", mode, image}})
			qio := startQemuIO(t, s.uri)
			qio.do("write -P 0x5a 70000 200000", "wrote 200000/200000 bytes")
			s.stop(syscall.SIGKILL)
			qio.kill()
			out, code := testutil.QemuIOExit(t, image, "qcow2", "read -P 0x5a 70000 200000")
			found := code == 0 && !strings.Contains(out, "failed")
			switch {
			case mode != "writeback" && !found:
				t.Errorf("a write acknowledged under --cache=%s is not in the image after SIGKILL:\n%s", mode, out)
			case mode == "writeback" && found:
				t.Errorf("under --cache=writeback a write without FUA or flush survived SIGKILL: the client sent FUA, so this test proves nothing")
			}
			testutil.CheckImage(t, image)
		})
	}
}

// qemuIO is an interactive qemu-io, its output line-buffered with stdbuf.
// It opens the device with -t writeback: qemu-io's default, writethrough,
// would make every write FUA.
type qemuIO struct {
	t     *testing.T
	cmd   *exec.Cmd
	in    io.WriteCloser
	lines chan string
}

func startQemuIO(t *testing.T, uri string) *qemuIO {
	t.Helper()
	return startQemuIOCmd(t, exec.Command, uri)
}

// startQemuIOCmd is startQemuIO with the command made by mk (to run it
// in a network namespace, say).
func startQemuIOCmd(t *testing.T, mk func(name string, args ...string) *exec.Cmd, uri string) *qemuIO {
	t.Helper()
	testutil.RunIn(t, "", "qemu-io", "--version") // fails the test when missing
	q := &qemuIO{t: t, cmd: mk("stdbuf", "-oL", "qemu-io", "-t", "writeback", "-f", "raw", uri), lines: make(chan string, 100)}
	var err error
	if q.in, err = q.cmd.StdinPipe(); err != nil {
		t.Fatal(err)
	}
	out, err := q.cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	q.cmd.Stderr = q.cmd.Stdout
	if err := q.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			q.lines <- sc.Text()
		}
		close(q.lines)
	}()
	t.Cleanup(q.kill)
	return q
}

// do sends one command and waits for a line containing want. It returns
// the lines printed before that one.
func (q *qemuIO) do(command, want string) []string {
	q.t.Helper()
	fmt.Fprintln(q.in, command)
	timeout := time.After(30 * time.Second)
	var seen []string
	for {
		select {
		case l, ok := <-q.lines:
			if !ok {
				q.t.Fatalf("qemu-io ended before %q\n%s", want, strings.Join(seen, "\n"))
			}
			if strings.Contains(l, want) {
				return seen
			}
			seen = append(seen, l)
		case <-timeout:
			q.t.Fatalf("qemu-io: no %q after 30s\n%s", want, strings.Join(seen, "\n"))
		}
	}
}

func (q *qemuIO) kill() {
	if q.cmd.ProcessState == nil {
		q.cmd.Process.Kill()
		q.cmd.Wait()
	}
}

// TestNBDNoCache serves with -n (O_DIRECT, which ext4 supports): the
// image's descriptor has O_DIRECT, unaligned writes land, and the image
// compares equal with the mirror.
func TestNBDNoCache(t *testing.T) {
	t.Parallel()
	const size = 4 << 20
	dir := t.TempDir()
	for _, format := range []string{"qcow2", "raw"} {
		sub := filepath.Join(dir, format)
		os.Mkdir(sub, 0o755)
		image, mirror := newNBDImage(t, sub, format, size)
		s := startNBD(t, nbdRun{args: []string{"-t", "-n", "-f", format, image}})
		if !openedDirect(t, s.cmd.Process.Pid, image) {
			t.Errorf("%s: the image is not open with O_DIRECT under -n", format)
		}
		cmds := qemuIOCmds(11, size, 25)
		qemuIONBD(t, s.uri, cmds...)
		testutil.QemuIO(t, mirror, "raw", cmds...)
		s.stop(syscall.SIGTERM)
		if format == "qcow2" {
			testutil.CheckImage(t, image)
		}
		compareRaw(t, image, format, mirror)
	}
}

// openedDirect reports whether process pid holds path open with O_DIRECT.
func openedDirect(t *testing.T, pid int, path string) bool {
	t.Helper()
	fds, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	if err != nil {
		t.Fatal(err)
	}
	found := false
	for _, fd := range fds {
		target, err := os.Readlink(fmt.Sprintf("/proc/%d/fd/%s", pid, fd.Name()))
		if err != nil || target != path {
			continue
		}
		found = true
		info, err := os.ReadFile(fmt.Sprintf("/proc/%d/fdinfo/%s", pid, fd.Name()))
		if err != nil {
			t.Fatal(err)
		}
		for _, l := range strings.Split(string(info), "\n") {
			if f, ok := strings.CutPrefix(l, "flags:"); ok {
				v, err := strconv.ParseUint(strings.TrimSpace(f), 8, 64)
				if err != nil || v&syscall.O_DIRECT == 0 {
					return false
				}
			}
		}
	}
	if !found {
		t.Fatalf("process %d does not hold %s open", pid, path)
	}
	return true
}

// fileSHA256 returns the SHA-256 of a file's bytes.
func fileSHA256(t *testing.T, path string) [32]byte {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return sha256.Sum256(b)
}

// TestNBDSnapshotAndReadOnly checks that -s takes writes (they read back
// over NBD) but leaves the image and the temporary folder as they were,
// and that -r refuses writes.
func TestNBDSnapshotAndReadOnly(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	image := filepath.Join(dir, "disk.qcow2")
	testutil.QemuImg(t, "create", "-q", "-f", "qcow2", image, "4M")
	testutil.QemuIO(t, image, "qcow2", "write -P 0x11 0 1M")
	before := fileSHA256(t, image)

	tmp := t.TempDir()
	s := startNBD(t, nbdRun{env: []string{"TMPDIR=" + tmp}, args: []string{"-t", "-s", image}})
	testutil.QemuIO(t, s.uri, "raw", "write -P 0x22 512k 1M", "write -z 0 4k")
	testutil.QemuIO(t, s.uri, "raw", "read -P 0 0 4k", "read -P 0x11 4k 508k", "read -P 0x22 512k 1M")
	s.stop(syscall.SIGTERM)
	if fileSHA256(t, image) != before {
		t.Error("-s changed the image")
	}
	if left, _ := os.ReadDir(tmp); len(left) != 0 {
		t.Errorf("-s left %d files in TMPDIR, first %s", len(left), left[0].Name())
	}
	testutil.CheckImage(t, image)

	s = startNBD(t, nbdRun{args: []string{"-t", "-r", image}})
	// QEMU's client sees NBD_FLAG_READ_ONLY and will not open the
	// export for writing; nbd's own tests send the WRITE anyway and get
	// EPERM.
	if out, code := testutil.QemuIOExit(t, s.uri, "raw", "write -P 0x33 0 4k"); code == 0 {
		t.Errorf("a write to a -r export succeeded:\n%s", out)
	}
	runTool(t, "qemu-io", "-r", "-f", "raw", "-c", "read -P 0x11 0 1M", s.uri)
	s.stop(syscall.SIGTERM)
	if fileSHA256(t, image) != before {
		t.Error("-r changed the image")
	}
}

// TestNBDForkPidFile checks that --fork returns once the server listens,
// that the pid file names the server, and that SIGTERM removes the
// socket and the pid file.
func TestNBDForkPidFile(t *testing.T) {
	t.Parallel()
	dir := shortTempDir(t)
	image := filepath.Join(dir, "disk.qcow2")
	testutil.QemuImg(t, "create", "-q", "-f", "qcow2", image, "1M")
	sock, pidFile := filepath.Join(dir, "s.sock"), filepath.Join(dir, "pid")
	r := ovis(t, dir, "nbd", "--fork", "--pid-file", pidFile, "-k", sock, "-t", image)
	if r.code != 0 {
		t.Fatalf("ovis nbd --fork: exit %d\n%s", r.code, r.stderr)
	}
	b, err := os.ReadFile(pidFile)
	if err != nil {
		t.Fatalf("no pid file after --fork returned: %v", err)
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil {
		t.Fatalf("pid file holds %q", b)
	}
	t.Cleanup(func() {
		if procAlive(pid) {
			syscall.Kill(pid, syscall.SIGKILL)
		}
	})
	if cmdline, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid)); !bytes.Contains(cmdline, []byte("nbd\x00")) {
		t.Fatalf("pid %d is %q, not the ovis nbd server", pid, cmdline)
	}
	// The socket accepts at once: no retry loop here.
	info := nbdinfo(t, "nbd+unix:///?socket="+sock)
	if info.Exports[0].Size != 1<<20 {
		t.Errorf("export size %d", info.Exports[0].Size)
	}
	syscall.Kill(pid, syscall.SIGTERM)
	deadline := time.Now().Add(30 * time.Second)
	for procAlive(pid) {
		if time.Now().After(deadline) {
			t.Fatalf("server %d still running 30s after SIGTERM", pid)
		}
		time.Sleep(20 * time.Millisecond)
	}
	for _, p := range []string{sock, pidFile} {
		if _, err := os.Stat(p); !os.IsNotExist(err) {
			t.Errorf("%s left behind: %v", p, err)
		}
	}
	testutil.CheckImage(t, image)
}

// procAlive reports whether process pid exists and is not a zombie.
func procAlive(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	i := bytes.LastIndexByte(b, ')')
	return i < 0 || i+2 >= len(b) || b[i+2] != 'Z'
}

// TestNBDNotPersistent checks that without -t the server outlives a client
// that only listed the exports (no handshake completed) and exits with
// status 0 after a real client disconnects, as qemu-nbd does.
func TestNBDNotPersistent(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	image := filepath.Join(dir, "disk.qcow2")
	testutil.QemuImg(t, "create", "-q", "-f", "qcow2", image, "1M")
	s := startNBD(t, nbdRun{args: []string{image}})
	runTool(t, "nbdinfo", "--list", s.uri)
	select {
	case <-s.exited:
		t.Fatalf("the server exited after nbdinfo --list\n%s", s.stderr)
	case <-time.After(300 * time.Millisecond):
	}
	testutil.QemuIO(t, s.uri, "raw", "write -P 0x44 0 64k")
	if code := s.wait(30 * time.Second); code != 0 {
		t.Fatalf("exit %d after the last client left\n%s", code, s.stderr)
	}
	testutil.CheckImage(t, image)
	testutil.QemuIO(t, image, "qcow2", "read -P 0x44 0 64k")
}

// testPKI writes a CA, a server certificate for 127.0.0.1 and a client
// certificate, as PEM files: cert and key for the server, ca for --tls-ca,
// and two libnbd tls-certificates folders, clientDir (ca-cert.pem,
// client-cert.pem, client-key.pem) and caDir (ca-cert.pem only).
type testPKI struct{ cert, key, ca, clientDir, caDir string }

func newTestPKI(t *testing.T) testPKI {
	t.Helper()
	dir := t.TempDir()
	p := testPKI{
		cert: filepath.Join(dir, "server-cert.pem"), key: filepath.Join(dir, "server-key.pem"),
		ca: filepath.Join(dir, "ca.pem"), clientDir: filepath.Join(dir, "client"), caDir: filepath.Join(dir, "caonly"),
	}
	newKey := func() *ecdsa.PrivateKey {
		k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		if err != nil {
			t.Fatal(err)
		}
		return k
	}
	serial := int64(0)
	sign := func(tmpl *x509.Certificate, key *ecdsa.PrivateKey, parent *x509.Certificate, parentKey *ecdsa.PrivateKey) *x509.Certificate {
		serial++
		tmpl.SerialNumber = big.NewInt(serial)
		tmpl.NotBefore, tmpl.NotAfter = time.Now().Add(-time.Hour), time.Now().Add(24*time.Hour)
		if parent == nil {
			parent, parentKey = tmpl, key
		}
		der, err := x509.CreateCertificate(rand.Reader, tmpl, parent, &key.PublicKey, parentKey)
		if err != nil {
			t.Fatal(err)
		}
		c, err := x509.ParseCertificate(der)
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	write := func(path, typ string, der []byte) {
		if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	writeKey := func(path string, k *ecdsa.PrivateKey) {
		der, err := x509.MarshalPKCS8PrivateKey(k)
		if err != nil {
			t.Fatal(err)
		}
		write(path, "PRIVATE KEY", der)
	}
	caKey := newKey()
	ca := sign(&x509.Certificate{
		Subject: pkix.Name{CommonName: "ovis test CA"}, IsCA: true, BasicConstraintsValid: true,
		KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
	}, caKey, nil, nil)
	srvKey, cliKey := newKey(), newKey()
	srv := sign(&x509.Certificate{
		Subject: pkix.Name{CommonName: "localhost"}, DNSNames: []string{"localhost"},
		IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)}, KeyUsage: x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}, srvKey, ca, caKey)
	cli := sign(&x509.Certificate{
		Subject: pkix.Name{CommonName: "ovis client"}, KeyUsage: x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}, cliKey, ca, caKey)
	write(p.ca, "CERTIFICATE", ca.Raw)
	write(p.cert, "CERTIFICATE", srv.Raw)
	writeKey(p.key, srvKey)
	for _, d := range []string{p.clientDir, p.caDir} {
		write(filepath.Join(d, "ca-cert.pem"), "CERTIFICATE", ca.Raw)
	}
	write(filepath.Join(p.clientDir, "client-cert.pem"), "CERTIFICATE", cli.Raw)
	writeKey(filepath.Join(p.clientDir, "client-key.pem"), cliKey)
	return p
}

// TestNBDTLS checks that --tls-cert/--tls-key serve nbdinfo over TLS and
// refuse a plain client, and that with --tls-ca a client without a
// certificate is refused and one with a certificate served.
func TestNBDTLS(t *testing.T) {
	t.Parallel()
	p := newTestPKI(t)
	image := filepath.Join(t.TempDir(), "disk.qcow2")
	testutil.QemuImg(t, "create", "-q", "-f", "qcow2", image, "1M")
	tlsURI := func(s *nbdServer, dir string) string {
		return "nbds://" + s.addr + "/?tls-certificates=" + dir
	}
	refused := func(uri, why string) {
		t.Helper()
		if out, errOut, code := testutil.RunIn(t, "", "nbdinfo", "--json", uri); code == 0 {
			t.Errorf("%s: nbdinfo %s succeeded\n%s%s", why, uri, out, errOut)
		}
	}

	s := startNBD(t, nbdRun{tcp: true, args: []string{"-t", "--tls-cert", p.cert, "--tls-key", p.key, image}})
	if info := nbdinfo(t, tlsURI(s, p.caDir)); !info.TLS || info.Exports[0].Size != 1<<20 {
		t.Errorf("over TLS: TLS %v, size %d", info.TLS, info.Exports[0].Size)
	}
	refused(s.uri, "plain client of a TLS server")
	s.stop(syscall.SIGTERM)

	s = startNBD(t, nbdRun{tcp: true, args: []string{"-t", "--tls-cert", p.cert, "--tls-key", p.key, "--tls-ca", p.ca, image}})
	refused(tlsURI(s, p.caDir), "client without a certificate under --tls-ca")
	refused(s.uri, "plain client under --tls-ca")
	if info := nbdinfo(t, tlsURI(s, p.clientDir)); !info.TLS {
		t.Error("a client with a certificate was not served over TLS")
	}
	s.stop(syscall.SIGTERM)
}

// TestNBDDiscardDetectZeroes writes data, then an all-zero payload over
// its first half and a TRIM over its second, and reads the image's map:
// by default TRIM is ignored and the zeros are data; --detect-zeroes on
// makes the zeros a zero write that stays allocated; with --discard unmap
// --detect-zeroes unmap both halves are deallocated.
func TestNBDDiscardDetectZeroes(t *testing.T) {
	t.Parallel()
	type half struct{ zero, data, allocated bool }
	for _, tc := range []struct {
		name       string
		args       []string
		zeros, cut half
	}{
		{"default", nil, half{false, true, true}, half{false, true, true}},
		{"detect-on", []string{"--detect-zeroes", "on"}, half{true, false, true}, half{false, true, true}},
		{"unmap", []string{"--discard", "unmap", "--detect-zeroes", "unmap"}, half{true, false, false}, half{true, false, false}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			image := filepath.Join(t.TempDir(), "disk.qcow2")
			testutil.QemuImg(t, "create", "-q", "-f", "qcow2", image, "2M")
			testutil.QemuIO(t, image, "qcow2", "write -P 0x11 0 1M")
			s := startNBD(t, nbdRun{args: append(append([]string{"-t"}, tc.args...), image)})
			qemuIONBD(t, s.uri, "write -P 0 0 512k", "discard 512k 512k", "flush")
			qemuIONBD(t, s.uri, "read -P 0 0 512k")
			if tc.cut.data {
				qemuIONBD(t, s.uri, "read -P 0x11 512k 512k")
			} else {
				qemuIONBD(t, s.uri, "read -P 0 512k 512k")
			}
			s.stop(syscall.SIGTERM)
			testutil.CheckImage(t, image)
			m := testutil.Map(t, image)
			for _, h := range []struct {
				off  int64
				want half
			}{{0, tc.zeros}, {512 << 10, tc.cut}} {
				e := mapAt(t, m, h.off)
				if got := (half{e.Zero, e.Data, e.Offset != nil}); got != h.want {
					t.Errorf("at %d: zero, data, allocated = %+v, want %+v", h.off, got, h.want)
				}
			}
		})
	}
}

// mapAt returns the qemu-img map entry that covers off.
func mapAt(t *testing.T, m []testutil.MapEntry, off int64) testutil.MapEntry {
	t.Helper()
	for _, e := range m {
		if off >= e.Start && off < e.Start+e.Length {
			return e
		}
	}
	t.Fatalf("no map entry at %d in %+v", off, m)
	return testutil.MapEntry{}
}

// TestNBDErrorsMatchQemu runs bad command lines through ovis nbd and
// qemu-nbd: both must exit 1 with the same first message (after the
// program name), and ovis must serve nothing.
func TestNBDErrorsMatchQemu(t *testing.T) {
	t.Parallel()
	dir := shortTempDir(t)
	image := filepath.Join(dir, "disk.qcow2")
	testutil.QemuImg(t, "create", "-q", "-f", "qcow2", image, "1M")
	text := filepath.Join(dir, "text")
	os.WriteFile(text, []byte("not an image\n"), 0o644)
	sock := filepath.Join(dir, "s.sock")
	for _, args := range [][]string{
		{},
		{image, image},
		{"--cache=fast", image},
		{"-n", "--cache=none", image},
		{"--discard=trim", image},
		{"--detect-zeroes=maybe", image},
		{"--detect-zeroes=unmap", image},
		{"-e", "-1", image},
		{"-e", "two", image},
		{"-k", "rel.sock", image},
		{"-x", strings.Repeat("x", 4097), image},
		{filepath.Join(dir, "missing.qcow2")},
		{"-f", "qcow2", text},
		{"-f", "nosuchformat", image},
		{"-k", filepath.Join(dir, "no", "s.sock"), image},
		{"--pid-file", filepath.Join(dir, "no", "pid"), image},
		{"--fork", filepath.Join(dir, "missing.qcow2")},
	} {
		if len(args) == 0 || args[0] != "-k" {
			args = append([]string{"-k", sock}, args...)
		}
		q := runBounded(t, "qemu-nbd", args...)
		o := runBounded(t, ovisBin, append([]string{"nbd"}, args...)...)
		first := func(s string) string {
			l, _, _ := strings.Cut(s, "\n")
			_, msg, _ := strings.Cut(l, ": ")
			return msg
		}
		if q.code != 1 || o.code != 1 || first(q.stderr) != first(o.stderr) {
			t.Errorf("nbd %.80q:\nqemu-nbd: exit %d, %q\n    ovis: exit %d, %q", strings.Join(args, " "), q.code, q.stderr, o.code, o.stderr)
		}
	}
}

// runBounded runs a program that is expected to fail at once, killing it
// after 10 seconds (a server that started by mistake).
func runBounded(t *testing.T, name string, args ...string) result {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, name, args...)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	if ctx.Err() != nil {
		t.Errorf("%s %.80q was still running after 10s", name, strings.Join(args, " "))
	}
	var exit *exec.ExitError
	if err != nil && !errors.As(err, &exit) {
		t.Fatalf("%s: %v", name, err)
	}
	return result{out.String(), errb.String(), cmd.ProcessState.ExitCode()}
}
