package main

import (
	"net"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ovis-storage/ovis/internal/testutil"
)

// metric scrapes url and returns the sample called name.
func metric(t *testing.T, url, name string) float64 {
	t.Helper()
	v, ok := scrape(t, url)[name]
	if !ok {
		t.Fatalf("no metric %s at %s", name, url)
	}
	return v
}

// TestReproNBDMetricsBlockStatus: ovis_block_requests_total{op="block_status"}
// counts the BLOCK_STATUS requests of clients (nbdinfo --map sends one,
// qemu-img map one per extent), not the server's own lookups; a sparse
// read adds to ovis_block_extent_lookups_total only.
func TestReproNBDMetricsBlockStatus(t *testing.T) {
	t.Parallel()
	dir := shortTempDir(t)
	img := filepath.Join(dir, "m.qcow2")
	testutil.QemuImg(t, "create", "-q", "-f", "qcow2", img, "64M")
	testutil.QemuIO(t, img, "qcow2", "write 1M 64k", "write 8M 64k")
	maddr := net.JoinHostPort("127.0.0.1", freePort(t))
	s := startNBD(t, nbdRun{tcp: true, args: []string{"-t", "--metrics", maddr, "-f", "qcow2", img}})
	url := "http://" + maddr + "/metrics"
	const bs = `ovis_block_requests_total{op="block_status"}`
	const lookups = `ovis_block_extent_lookups_total`

	if got := metric(t, url, bs); got != 0 {
		t.Fatalf("block_status %v before any client", got)
	}
	runTool(t, "nbdinfo", "--map", s.uri)
	if got := metric(t, url, bs); got != 1 {
		t.Errorf("block_status after nbdinfo --map: %v, want 1", got)
	}
	m := testutil.Map(t, s.uri)
	after := metric(t, url, bs)
	// QEMU asks once per extent it reports (here 5), never less.
	if n := float64(len(m)); after-1 < n || after-1 > 2*n {
		t.Errorf("block_status after qemu-img map of %d extents: %v more, want %v to %v", len(m), after-1, n, 2*n)
	}
	before := metric(t, url, lookups)
	runTool(t, "qemu-io", "-r", "-f", "raw", "-c", "read 0 4M", s.uri)
	if got := metric(t, url, bs); got != after {
		t.Errorf("a sparse read counted as %v block_status requests", got-after)
	}
	if got := metric(t, url, lookups); got <= before {
		t.Errorf("a sparse read made no extent lookup (%v, before %v)", got, before)
	}
	s.stop(syscall.SIGTERM)
}

// portRE hides the port of a URI in what the tools print.
var portRE = regexp.MustCompile(`127\.0\.0\.1:\d+`)

// TestReproNBDExportNamesLikeQemu: a client asking ovis nbd -x NAME for
// the empty name, or for a missing one, is refused as qemu-nbd refuses it
// ("export ” not present", long names cut at 80 bytes), as nbdinfo and
// qemu-img print it with their exit codes; without -x the empty name is
// the export and any other is refused. ovis up serves disk0 under the
// empty name too.
func TestReproNBDExportNamesLikeQemu(t *testing.T) {
	t.Parallel()
	long := strings.Repeat("x", 100)
	type out struct {
		stdout, stderr string
		code           int
	}
	for _, x := range []string{"foo", ""} {
		got := map[string][]out{}
		for _, srv := range servers {
			dir := t.TempDir()
			testutil.QemuImg(t, "create", "-q", "-f", "qcow2", filepath.Join(dir, "d.qcow2"), "4M")
			listen, uri := peerAddr(t, true)
			args := []string{"-t", "-f", "qcow2", "d.qcow2"}
			if x != "" {
				args = append([]string{"-x", x}, args...)
			}
			p := startPeer(t, binOf(srv), dir, listen, uri, args...)
			for _, name := range []string{"", "nope", long, "foo"} {
				for _, tool := range [][]string{{"nbdinfo", "--size"}, {"qemu-img", "info"}} {
					o, e, c := testutil.RunIn(t, "", tool[0], tool[1], uri+name)
					got[srv] = append(got[srv], out{portRE.ReplaceAllString(o, "PORT"), portRE.ReplaceAllString(e, "PORT"), c})
				}
			}
			if code := p.stop(); code != 0 {
				t.Errorf("-x %q: %s exited %d\n%s", x, srv, code, p.stderr)
			}
		}
		q, o := got["qemu-nbd"], got["ovis"]
		for i := range q {
			if q[i] != o[i] {
				t.Errorf("-x %q, client %d:\nqemu-nbd %+v\novis     %+v", x, i, q[i], o[i])
			}
		}
	}

	u := startUp(t, t.TempDir(), "--listen", "127.0.0.1:0")
	if e := nbdinfo(t, strings.TrimSuffix(u.uri, "disk0")).Exports[0]; e.Name != "disk0" {
		t.Errorf("ovis up serves %q under the empty name, want disk0", e.Name)
	}
	u.cmd.Process.Signal(syscall.SIGINT)
	u.wait(30 * time.Second)
}
