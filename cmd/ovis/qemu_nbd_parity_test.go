package main

import (
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ovis-storage/ovis/internal/testutil"
	"github.com/ovis-storage/ovis/internal/twin"
)

// Regression tests of ovis nbd against qemu-nbd 7.2 as a drop-in: what it
// prints on stderr in normal operation (nothing, -v or not), qemu-nbd -L,
// and block status of a raw image's partial last sector.

// peer is a running server, qemu-nbd or ovis nbd, started by a test with
// the same arguments as its twin.
type peer struct {
	*serverProc
	// listen is -k SOCK or -b 127.0.0.1 -p PORT; uri the export's URI.
	listen []string
	uri    string
}

// peerAddr returns the listen options and the URI of a new address: a
// unix socket, or a free loopback port.
func peerAddr(t *testing.T, tcp bool) (listen []string, uri string) {
	if tcp {
		port := freePort(t)
		return []string{"-b", "127.0.0.1", "-p", port}, "nbd://127.0.0.1:" + port + "/"
	}
	sock := filepath.Join(shortTempDir(t), "s.sock")
	return []string{"-k", sock}, "nbd+unix:///?socket=" + sock
}

// startPeer starts bin (qemu-nbd or ovisBin) with args in dir, listening
// where listen says, and waits until it has written its pid file, which
// both do once they serve. Connecting to find out would make qemu-nbd
// print an error when the probe hangs up.
func startPeer(t *testing.T, bin, dir string, listen []string, uri string, args ...string) *peer {
	t.Helper()
	pidFile := filepath.Join(t.TempDir(), "pid")
	all := append(append([]string{"--pid-file", pidFile}, listen...), args...)
	if bin == ovisBin {
		all = append([]string{"nbd"}, all...)
	}
	cmd := exec.Command(bin, all...)
	cmd.Dir = dir
	p := &peer{serverProc: startServerProc(t, cmd, nil), listen: listen, uri: uri}
	deadline := time.Now().Add(20 * time.Second)
	for {
		if _, err := os.Stat(pidFile); err == nil {
			return p
		}
		select {
		case <-p.exited:
			t.Fatalf("%s %q exited with %d before serving\n%s", bin, all, p.code, p.stderr)
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s %q not serving after 20s\n%s", bin, all, p.stderr)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// stop sends SIGTERM and returns the exit status.
func (p *peer) stop() int {
	p.cmd.Process.Signal(syscall.SIGTERM)
	return p.wait(60 * time.Second)
}

// servers are the two programs every test here compares.
var servers = []string{"qemu-nbd", "ovis"}

// binOf maps a server's name to what startPeer runs.
func binOf(name string) string {
	if name == "ovis" {
		return ovisBin
	}
	return name
}

// copySparse copies src to dst, keeping holes.
func copySparse(t *testing.T, src, dst string) {
	t.Helper()
	if err := twin.SparseCopy(src, dst); err != nil {
		t.Fatal(err)
	}
}

// TestReproNBDQuietLikeQemu: on a normal run — serve, clients connect, read
// and write, list, disconnect, SIGTERM — qemu-nbd prints nothing on stderr,
// with -v or without; ovis nbd must print the same (nothing), and exit as
// it does. A probed raw image gets QEMU's warning from both, and under
// --fork that warning makes both parents exit 1 while the server serves on.
func TestReproNBDQuietLikeQemu(t *testing.T) {
	t.Parallel()
	src := t.TempDir()
	image := filepath.Join(src, "disk.qcow2")
	testutil.QemuImg(t, "create", "-q", "-f", "qcow2", image, "4M")
	raw := filepath.Join(src, "disk.raw")
	testutil.QemuImg(t, "create", "-q", "-f", "raw", raw, "4M")
	type outcome struct {
		stderr string
		code   int
	}
	for _, c := range []struct {
		name string
		// args are the server's; file is copied into its folder.
		args []string
		file string
		// persistent servers are stopped with SIGTERM after the
		// clients; the others end with the last client.
		persistent bool
		readOnly   bool
		warn       bool
	}{
		{name: "one client", args: []string{"-f", "qcow2", "disk.qcow2"}, file: image},
		{name: "one client -v", args: []string{"-v", "-f", "qcow2", "disk.qcow2"}, file: image},
		{name: "persistent SIGTERM", args: []string{"-t", "-e", "2", "-f", "qcow2", "disk.qcow2"}, file: image, persistent: true},
		{name: "persistent SIGTERM -v", args: []string{"-v", "-t", "-e", "2", "-f", "qcow2", "disk.qcow2"}, file: image, persistent: true},
		{name: "raw -r -v", args: []string{"-v", "-r", "-f", "raw", "disk.raw"}, file: raw, readOnly: true},
		{name: "probed raw", args: []string{"-v", "disk.raw"}, file: raw, warn: true},
	} {
		for _, tcp := range []bool{false, true} {
			got := map[string]outcome{}
			for _, srv := range servers {
				dir := t.TempDir()
				copySparse(t, c.file, filepath.Join(dir, filepath.Base(c.file)))
				listen, uri := peerAddr(t, tcp)
				p := startPeer(t, binOf(srv), dir, listen, uri, c.args...)
				if c.persistent {
					runTool(t, "nbdinfo", "--list", uri)
					runTool(t, "qemu-img", "info", uri)
				}
				cmds := []string{"-f", "raw", "-c", "read 0 64k"}
				if c.readOnly {
					cmds = append(cmds, "-r")
				} else {
					cmds = append(cmds, "-c", "write -P 7 0 64k", "-c", "flush")
				}
				runTool(t, "qemu-io", append(cmds, uri)...)
				code := 0
				if c.persistent {
					code = p.stop()
				} else {
					code = p.wait(60 * time.Second)
				}
				got[srv] = outcome{p.stderr.String(), code}
			}
			q, o := got["qemu-nbd"], got["ovis"]
			if q != o {
				t.Errorf("%s (tcp %v):\nqemu-nbd: exit %d, stderr %q\n    ovis: exit %d, stderr %q", c.name, tcp, q.code, q.stderr, o.code, o.stderr)
			}
			if c.warn != strings.Contains(o.stderr, "WARNING: Image format was not specified for 'disk.raw'") || (!c.warn && o.stderr != "") {
				t.Errorf("%s (tcp %v): ovis nbd's stderr: %q", c.name, tcp, o.stderr)
			}
		}
	}

	// --fork: the parent copies what the server prints before it is
	// ready, and exits 1 if it printed anything.
	got := map[string]outcome{}
	for _, srv := range servers {
		for _, file := range []string{raw, image} {
			dir := shortTempDir(t)
			copySparse(t, file, filepath.Join(dir, filepath.Base(file)))
			pidFile := filepath.Join(dir, "pid")
			args := []string{"--fork", "--pid-file", pidFile, "-t", "-k", filepath.Join(dir, "s.sock"), filepath.Base(file)}
			if srv == "ovis" {
				args = append([]string{"nbd"}, args...)
			}
			out, errOut, code := testutil.RunIn(t, dir, binOf(srv), args...)
			b, err := os.ReadFile(pidFile)
			if err != nil {
				t.Fatalf("%s --fork %s: no pid file: %v\n%s%s", srv, file, err, out, errOut)
			}
			pid, _ := strconv.Atoi(strings.TrimSpace(string(b)))
			if pid <= 0 || !stopDaemon(pid) {
				t.Errorf("%s --fork %s: pid file %q names no running server", srv, file, b)
			}
			got[srv+" "+filepath.Base(file)] = outcome{errOut, code}
		}
	}
	for _, f := range []string{"disk.raw", "disk.qcow2"} {
		if q, o := got["qemu-nbd "+f], got["ovis "+f]; q != o {
			t.Errorf("--fork %s:\nqemu-nbd: exit %d, stderr %q\n    ovis: exit %d, stderr %q", f, q.code, q.stderr, o.code, o.stderr)
		}
	}
	if o := got["ovis disk.raw"]; o.code != 1 {
		t.Errorf("ovis nbd --fork of a probed raw image: exit %d, want 1 as qemu-nbd", o.code)
	}
}

// stopDaemon stops a server started with --fork, and reports whether it
// was running. SIGTERM is sent again until it exits: qemu-nbd loses one
// that arrives before its main loop runs. SIGKILL after 10 seconds.
func stopDaemon(pid int) bool {
	if syscall.Kill(pid, syscall.SIGTERM) != nil {
		return false
	}
	for deadline := time.Now().Add(10 * time.Second); procAlive(pid); time.Sleep(50 * time.Millisecond) {
		if time.Now().After(deadline) {
			syscall.Kill(pid, syscall.SIGKILL)
			break
		}
		syscall.Kill(pid, syscall.SIGTERM)
	}
	return true
}

// listRun is one run of `qemu-nbd -L` or `ovis nbd -L`.
type listRun struct {
	stdout, stderr string
	code           int
}

// listBoth runs qemu-nbd -L and ovis nbd -L with args; ovis's "ovis: "
// prefixes of its error lines read as qemu-nbd's.
func listBoth(t *testing.T, args ...string) (q, o listRun) {
	t.Helper()
	qr := runBounded(t, "qemu-nbd", append([]string{"-L"}, args...)...)
	or := runBounded(t, ovisBin, append([]string{"nbd", "-L"}, args...)...)
	ostderr := strings.ReplaceAll("\n"+or.stderr, "\novis: ", "\nqemu-nbd: ")[1:]
	return listRun{qr.stdout, qr.stderr, qr.code}, listRun{or.stdout, ostderr, or.code}
}

// TestReproNBDListLikeQemu: `ovis nbd -L` prints what `qemu-nbd -L` prints,
// byte for byte, with the same exit status, against qemu-nbd and ovis nbd
// serving the same image under the same options (names, descriptions,
// read-only, -e, -A, -B bitmaps, raw and qcow2, unix socket and TCP, TLS
// refused), and for the command lines and addresses it refuses. Both
// servers list the same text (qemu:allocation-depth only with -A), so
// the output is also compared across servers; the servers print nothing
// meanwhile.
func TestReproNBDListLikeQemu(t *testing.T) {
	t.Parallel()
	src := t.TempDir()
	image := filepath.Join(src, "disk.qcow2")
	testutil.QemuImg(t, "create", "-q", "-f", "qcow2", image, "1M")
	testutil.QemuImg(t, "bitmap", "--add", image, "bm1")
	testutil.QemuImg(t, "bitmap", "--add", image, "bm2")
	raw := filepath.Join(src, "disk.raw")
	if err := os.WriteFile(raw, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	os.Truncate(raw, 4097)
	pki := newTestPKI(t)
	qemuPKI := t.TempDir()
	for from, to := range map[string]string{pki.ca: "ca-cert.pem", pki.cert: "server-cert.pem", pki.key: "server-key.pem"} {
		copySparse(t, from, filepath.Join(qemuPKI, to))
	}
	for _, c := range []struct {
		name string
		args []string
		// ovisArgs replace args for ovis nbd (its own TLS flags).
		ovisArgs []string
		// tls servers are listed without credentials (refused), then
		// with them.
		tls bool
	}{
		{name: "default", args: []string{"-f", "qcow2", "disk.qcow2"}},
		{name: "name and description", args: []string{"-x", "an export", "-D", "what it holds", "-f", "qcow2", "disk.qcow2"}},
		{name: "read-only", args: []string{"-r", "-x", "ro", "-f", "qcow2", "disk.qcow2"}},
		{name: "shared, depth and bitmaps", args: []string{"-e", "3", "-A", "-B", "bm1", "-B", "bm2", "-D", "", "-f", "qcow2", "disk.qcow2"}},
		{name: "bitmap without depth", args: []string{"-e", "0", "-B", "bm2", "-f", "qcow2", "disk.qcow2"}},
		{name: "read-only bitmap", args: []string{"-r", "-A", "-B", "bm2", "-f", "qcow2", "disk.qcow2"}},
		{name: "raw partial sector", args: []string{"-f", "raw", "disk.raw"}},
		{name: "snapshot", args: []string{"-s", "-A", "-x", "snap", "disk.qcow2"}},
		{name: "TLS", args: []string{"--object", "tls-creds-x509,id=tls0,endpoint=server,dir=" + qemuPKI, "--tls-creds", "tls0", "-f", "qcow2", "disk.qcow2"}, tls: true},
		{name: "TLS, PEM flags for ovis", args: []string{"--object", "tls-creds-x509,id=tls0,endpoint=server,dir=" + qemuPKI, "--tls-creds", "tls0", "-f", "qcow2", "disk.qcow2"},
			ovisArgs: []string{"--tls-cert", pki.cert, "--tls-key", pki.key, "--tls-ca", pki.ca, "-f", "qcow2", "disk.qcow2"}, tls: true},
	} {
		for _, tcp := range []bool{false, true} {
			var outputs []listRun
			for _, srv := range servers {
				dir := t.TempDir()
				copySparse(t, image, filepath.Join(dir, "disk.qcow2"))
				copySparse(t, raw, filepath.Join(dir, "disk.raw"))
				listen, uri := peerAddr(t, tcp)
				args := append([]string{"-t"}, c.args...)
				if srv == "ovis" && c.ovisArgs != nil {
					args = append([]string{"-t"}, c.ovisArgs...)
				}
				p := startPeer(t, binOf(srv), dir, listen, uri, args...)
				q, o := listBoth(t, listen...)
				if q != o {
					t.Errorf("%s (tcp %v) served by %s:\nqemu-nbd -L: exit %d\n%s%s\novis nbd -L: exit %d\n%s%s",
						c.name, tcp, srv, q.code, q.stdout, q.stderr, o.code, o.stdout, o.stderr)
				}
				if c.tls {
					if o.code != 1 || !strings.HasPrefix(o.stderr, "qemu-nbd: TLS negotiation required before option 3 (list)\n") {
						t.Errorf("%s served by %s: ovis nbd -L without credentials: exit %d\n%s%s", c.name, srv, o.code, o.stdout, o.stderr)
					}
					outputs = append(outputs, o)
					// QEMU checks the certificate for -b, or
					// --tls-hostname (a unix socket has no name).
					creds := []string{"--object", "tls-creds-x509,id=c0,endpoint=client,dir=" + pki.clientDir, "--tls-creds", "c0"}
					if !tcp {
						creds = append(creds, "--tls-hostname", "localhost")
					}
					q, o = listBoth(t, append(creds, listen...)...)
					if q != o {
						t.Errorf("%s (tcp %v) served by %s, with credentials:\nqemu-nbd -L: exit %d\n%s%s\novis nbd -L: exit %d\n%s%s",
							c.name, tcp, srv, q.code, q.stdout, q.stderr, o.code, o.stdout, o.stderr)
					}
				}
				if o.code != 0 || !strings.Contains(o.stdout, "exports available: 1\n") {
					t.Errorf("%s (tcp %v) served by %s: ovis nbd -L: exit %d\n%s%s", c.name, tcp, srv, o.code, o.stdout, o.stderr)
				}
				outputs = append(outputs, o)
				if code := p.stop(); code != 0 || p.stderr.String() != "" {
					t.Errorf("%s (tcp %v): %s exited %d after the lists, stderr %q", c.name, tcp, srv, code, p.stderr)
				}
			}
			if fmt.Sprint(outputs[:len(outputs)/2]) != fmt.Sprint(outputs[len(outputs)/2:]) {
				t.Errorf("%s (tcp %v): qemu-nbd and ovis nbd list differently:\n%s\n%s", c.name, tcp, outputs[0].stdout, outputs[1].stdout)
			}
		}
	}

	// Nothing listening, bad addresses, options list mode refuses.
	dir := shortTempDir(t)
	for _, args := range [][]string{
		{"-k", filepath.Join(dir, "none.sock")},
		{"-b", "127.0.0.1", "-p", freePort(t)},
		{"-p", "1"},
		{"-p", "99999"},
		{"-p", "abc"},
		{"-b", "nosuch.invalid"},
		{"-b", "127.0.0.1", "-p", "0"},
		{"-k", "rel.sock"},
		{"disk.qcow2"},
		{"-x", "name"},
		{"-D", "text"},
		{"-f", "raw"},
		{"-B", "bm1"},
		{"-A"},
		{"-n"},
		{"--cache=none"},
		{"--discard=unmap"},
		{"-l", "snap"},
		{"--fork"},
		{"-e", "two"},
		{"--tls-creds=tls0"},
		{"--tls-hostname", "localhost"},
		{"--object", "nosuchtype,id=x"},
		{"--object", "tls-creds-x509,id=c0,endpoint=client", "--tls-creds", "c0"},
		{"--object", "tls-creds-x509,id=c0,endpoint=client,dir=" + filepath.Join(dir, "nodir"), "--tls-creds", "c0"},
		{"--object", "tls-creds-x509,id=s0,endpoint=server,dir=" + qemuPKI, "--tls-creds", "s0"},
		{"--object", "tls-creds-x509,id=c0,endpoint=client,dir=" + pki.clientDir, "--tls-creds", "c1"},
		{"--object", "tls-creds-x509,id=c0,endpoint=client,dir=" + pki.clientDir, "--tls-creds", "c0", "-p", "1"},
	} {
		q, o := listBoth(t, args...)
		if q != o || q.code != 1 {
			t.Errorf("-L %q:\nqemu-nbd: exit %d %q %q\n    ovis: exit %d %q %q", args, q.code, q.stdout, q.stderr, o.code, o.stdout, o.stderr)
		}
	}
}

// TestReproNBDMapUnalignedTail: a raw image whose size is not a multiple
// of 512 is exported in whole sectors, as qemu-nbd exports it, so that
// `qemu-img map` over NBD and `nbdinfo --map` show the partial last sector
// as qemu-nbd's do (with its offset), data or hole; qcow2 images with a
// partial last cluster too. Writes and zero writes into the partial sector
// grow the file as under qemu-nbd (a discard does not), and with -n a
// writable unaligned raw image is refused in qemu-nbd's words.
func TestReproNBDMapUnalignedTail(t *testing.T) {
	t.Parallel()
	src := t.TempDir()
	type image struct {
		name, format string
		size         int64
		tail         bool // data in the last bytes
	}
	var images []image
	for _, size := range []int64{4097, 1<<20 + 512, 1<<20 + 1} {
		for _, tail := range []bool{false, true} {
			im := image{fmt.Sprintf("r%d-%v.raw", size, tail), "raw", size, tail}
			p := filepath.Join(src, im.name)
			if err := os.WriteFile(p, nil, 0o644); err != nil {
				t.Fatal(err)
			}
			if err := os.Truncate(p, size); err != nil {
				t.Fatal(err)
			}
			testutil.QemuIO(t, p, "raw", "write -P 1 0 512")
			if tail {
				f, err := os.OpenFile(p, os.O_WRONLY, 0)
				if err != nil {
					t.Fatal(err)
				}
				f.WriteAt([]byte{9}, size-1)
				f.Close()
			}
			images = append(images, im)
			q := image{fmt.Sprintf("q%d-%v.qcow2", size, tail), "qcow2", size, tail}
			qp := filepath.Join(src, q.name)
			testutil.QemuImg(t, "create", "-q", "-f", "qcow2", qp, strconv.FormatInt(size, 10))
			if tail {
				// The last sector of the image, as qemu-img rounded it.
				testutil.QemuIO(t, qp, "qcow2", fmt.Sprintf("write -P 9 %d 512", (size+511)&^511-512))
			}
			images = append(images, q)
		}
	}
	for _, im := range images {
		for _, extra := range [][]string{nil, {"-s"}} {
			var maps [2][]string
			for i, srv := range servers {
				dir := t.TempDir()
				copySparse(t, filepath.Join(src, im.name), filepath.Join(dir, im.name))
				listen, uri := peerAddr(t, im.size%2 == 1)
				p := startPeer(t, binOf(srv), dir, listen, uri, append(append([]string{"-t", "-f", im.format}, extra...), im.name)...)
				maps[i] = []string{
					runTool(t, "qemu-img", "map", "--output=json", "-f", "raw", uri),
					runTool(t, "nbdinfo", "--map", uri),
					runTool(t, "nbdinfo", "--size", uri),
				}
				p.stop()
			}
			for k, what := range []string{"qemu-img map", "nbdinfo --map", "nbdinfo --size"} {
				if maps[0][k] != maps[1][k] {
					t.Errorf("%s %v: %s differs\nqemu-nbd: %s\n    ovis: %s", im.name, extra, what, maps[0][k], maps[1][k])
				}
			}
		}
	}

	// Writes and zero writes into the partial sector, then the map and
	// the file.
	for _, size := range []int64{4097, 1<<20 + 1} {
		sector := size &^ 511
		for _, w := range []struct {
			discard string
			cmds    []string
		}{
			{"ignore", []string{fmt.Sprintf("write -P 7 %d 8", size+2), fmt.Sprintf("read -P 0 %d 2", size)}},
			{"ignore", []string{fmt.Sprintf("write -z %d 512", sector)}},
			{"unmap", []string{fmt.Sprintf("write -z %d 512", sector)}},
			{"unmap", []string{fmt.Sprintf("write -z -u %d 512", sector)}},
			{"ignore", []string{fmt.Sprintf("write -z -u %d 512", sector)}},
			{"unmap", []string{fmt.Sprintf("discard %d 512", sector)}},
		} {
			var got [2]string
			for i, srv := range servers {
				dir := t.TempDir()
				p := filepath.Join(dir, "t.raw")
				os.WriteFile(p, nil, 0o644)
				os.Truncate(p, size)
				listen, uri := peerAddr(t, false)
				s := startPeer(t, binOf(srv), dir, listen, uri, "-t", "--discard", w.discard, "-f", "raw", "t.raw")
				args := []string{"-f", "raw"}
				for _, c := range w.cmds {
					args = append(args, "-c", c)
				}
				runTool(t, "qemu-io", append(args, uri)...)
				m := runTool(t, "qemu-img", "map", "--output=json", "-f", "raw", uri)
				s.stop()
				st, err := os.Stat(p)
				if err != nil {
					t.Fatal(err)
				}
				got[i] = fmt.Sprintf("%s file size %d", m, st.Size())
			}
			if got[0] != got[1] {
				t.Errorf("%q (--discard %s) into the partial sector of %d bytes:\nqemu-nbd: %s\n    ovis: %s", w.cmds, w.discard, size, got[0], got[1])
			}
		}
	}

	// O_DIRECT cannot write a partial block: qemu-nbd refuses the open.
	for _, size := range []int64{4097, 1<<20 + 512} {
		dir := shortTempDir(t)
		p := filepath.Join(dir, "t.raw")
		os.WriteFile(p, nil, 0o644)
		os.Truncate(p, size)
		for _, cache := range []string{"-n", "--cache=directsync"} {
			args := []string{"-k", filepath.Join(dir, "s.sock"), cache, "-f", "raw", p}
			q := runBounded(t, "qemu-nbd", args...)
			o := runBounded(t, ovisBin, append([]string{"nbd"}, args...)...)
			if q.code != 1 || o.code != 1 || strings.TrimPrefix(q.stderr, "qemu-nbd: ") != strings.TrimPrefix(o.stderr, "ovis: ") {
				t.Errorf("%d bytes %s:\nqemu-nbd: exit %d %q\n    ovis: exit %d %q", size, cache, q.code, q.stderr, o.code, o.stderr)
			}
		}
	}
}

// TestReproNBDClientErrorsLikeQemu: clients that hang up or send garbage
// in the handshake make qemu-nbd print why on stderr ("option negotiation
// failed: ..."); ovis nbd prints the same lines, and nothing for clients
// that list, abort or ask for a missing export.
func TestReproNBDClientErrorsLikeQemu(t *testing.T) {
	t.Parallel()
	src := t.TempDir()
	image := filepath.Join(src, "disk.qcow2")
	testutil.QemuImg(t, "create", "-q", "-f", "qcow2", image, "1M")
	be32 := func(v uint32) []byte { return binary.BigEndian.AppendUint32(nil, v) }
	// Each client sends its bytes after reading the 18-byte greeting
	// (or nothing at all), then hangs up.
	clients := []struct {
		name string
		send []byte
		// lines is how many lines qemu-nbd prints for it.
		lines int
	}{
		{"flags then hang-up", be32(3), 1},
		{"half an option", append(be32(3), "IHAVEOPT"...), 1},
		{"option magic and type", append(append(be32(3), "IHAVEOPT"...), be32(7)...), 1},
		{"bad option magic", append(append(be32(3), "XXXXXXXX"...), make([]byte, 8)...), 1},
		{"unknown client flags", be32(0x10), 1},
		{"greeting read, hang-up", nil, 1},
	}
	got := map[string]string{}
	for _, srv := range servers {
		dir := t.TempDir()
		copySparse(t, image, filepath.Join(dir, "disk.qcow2"))
		listen, uri := peerAddr(t, false)
		p := startPeer(t, binOf(srv), dir, listen, uri, "-t", "-f", "qcow2", "disk.qcow2")
		lines := 0
		for _, c := range clients {
			conn, err := net.Dial("unix", listen[1])
			if err != nil {
				t.Fatal(err)
			}
			io.ReadFull(conn, make([]byte, 18))
			conn.Write(c.send)
			conn.Close()
			lines += c.lines
			// Wait for the report, so that the lines keep the
			// clients' order.
			for deadline := time.Now().Add(10 * time.Second); strings.Count(p.stderr.String(), "\n") < lines && time.Now().Before(deadline); {
				time.Sleep(5 * time.Millisecond)
			}
		}
		// Clients qemu-nbd says nothing about.
		runTool(t, "nbdinfo", "--list", uri)
		runBounded(t, "nbdinfo", strings.Replace(uri, ":///", ":///nosuch", 1))
		runTool(t, "qemu-img", "info", uri)
		if code := p.stop(); code != 0 {
			t.Errorf("%s exited %d", srv, code)
		}
		got[srv] = strings.ReplaceAll("\n"+p.stderr.String(), "\novis: ", "\nqemu-nbd: ")[1:]
	}
	if got["qemu-nbd"] != got["ovis"] {
		t.Errorf("stderr differs\nqemu-nbd:\n%s\n    ovis:\n%s", got["qemu-nbd"], got["ovis"])
	}
	if n := strings.Count(got["ovis"], "qemu-nbd: option negotiation failed: "); n != len(clients) {
		t.Errorf("ovis nbd reported %d handshake failures, want %d:\n%s", n, len(clients), got["ovis"])
	}
}

// TestReproNBDZeroWriteUnmapLikeQemu: --discard ignore only makes TRIM a
// no-op; a zero write the client lets unmap (no NO_HOLE) frees the
// clusters of a qcow2 image and punches a raw file under qemu-nbd, and so
// under ovis nbd. The image files are compared afterwards (qemu-img map,
// allocated blocks).
func TestReproNBDZeroWriteUnmapLikeQemu(t *testing.T) {
	t.Parallel()
	for _, format := range []string{"qcow2", "raw"} {
		for _, discard := range []string{"ignore", "unmap"} {
			if format == "qcow2" && discard == "unmap" {
				// A qcow2 TRIM differs (QEMU leaves a zero
				// cluster and punches the host file): not
				// this test's business.
				continue
			}
			var got [2]string
			for i, srv := range servers {
				dir := t.TempDir()
				p := filepath.Join(dir, "disk."+format)
				testutil.QemuImg(t, "create", "-q", "-f", format, p, "1M")
				listen, uri := peerAddr(t, false)
				s := startPeer(t, binOf(srv), dir, listen, uri, "-t", "--discard", discard, "-f", format, p)
				runTool(t, "qemu-io", "-f", "raw", "-c", "write -P 1 0 512k", "-c", "write -z -u 0 128k",
					"-c", "write -z 128k 128k", "-c", "discard 256k 128k", uri)
				s.stop()
				var st syscall.Stat_t
				if err := syscall.Stat(p, &st); err != nil {
					t.Fatal(err)
				}
				got[i] = fmt.Sprintf("%s%d blocks", testutil.QemuImg(t, "map", "--output=json", "-f", format, p), st.Blocks)
			}
			if got[0] != got[1] {
				t.Errorf("%s --discard %s:\nqemu-nbd: %s\n    ovis: %s", format, discard, got[0], got[1])
			}
		}
	}
}

// TestReproNBDFlagErrorsLikeQemu: command lines getopt refuses (unknown
// options, missing arguments, an argument to a switch) give qemu-nbd's
// two error lines, its getopt wording then the pointer to --help, and
// exit 1; so does a wrong number of files.
func TestReproNBDFlagErrorsLikeQemu(t *testing.T) {
	t.Parallel()
	for _, args := range [][]string{
		{"--foo", "x"}, {"-Z", "x"}, {"--port"}, {"-p"}, {"-e"}, {"--shared"},
		{"--read-only=yes", "x"}, {"-L", "--bogus"}, {}, {"a", "b"},
	} {
		q := runBounded(t, "qemu-nbd", args...)
		o := runBounded(t, ovisBin, append([]string{"nbd"}, args...)...)
		want := strings.ReplaceAll(q.stderr, "qemu-nbd: ", "ovis: ")
		want = strings.ReplaceAll(want, "`qemu-nbd --help'", "`ovis nbd --help'")
		if q.code != 1 || o.code != 1 || o.stderr != want {
			t.Errorf("nbd %q:\nqemu-nbd: exit %d %q\n    ovis: exit %d %q", args, q.code, q.stderr, o.code, o.stderr)
		}
	}
}
