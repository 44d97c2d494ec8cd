package main

import (
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"
)

// upClusterRun is one `ovis up` (the cluster) in a folder.
type upClusterRun struct {
	*upRun        // uri is nbd://…/disk0
	admin  string // a node's admin address
}

var (
	upServingRE = regexp.MustCompile(`serving disk0 at (nbd://\S+)`)
	upAdminRE   = regexp.MustCompile(`ovis node list -a (\S+),`)
)

// ports0 are the flags that put every listener of ovis up on a free port.
var ports0 = []string{"--listen", "127.0.0.1:0", "--node-listen", "127.0.0.1:0", "--etcd-listen", "http://127.0.0.1:0", "--etcd-peer", "http://127.0.0.1:0"}

func startUpCluster(t *testing.T, dir string, args ...string) *upClusterRun {
	t.Helper()
	var uri, admin string
	u := startUpProcess(t, dir, 60*time.Second, func(l string) bool {
		if m := upServingRE.FindStringSubmatch(l); m != nil {
			uri = m[1]
		}
		if m := upAdminRE.FindStringSubmatch(l); m != nil {
			admin = m[1]
		}
		return admin != ""
	}, append(append([]string{"up"}, ports0...), args...)...)
	u.uri = uri
	return &upClusterRun{upRun: u, admin: admin}
}

// stop sends SIGINT and waits for a clean exit.
func (u *upClusterRun) stop(t *testing.T) {
	t.Helper()
	u.cmd.Process.Signal(syscall.SIGINT)
	select {
	case <-u.exited:
		if u.err != nil {
			t.Fatalf("ovis up after SIGINT: %v\nstderr: %s", u.err, u.stderr)
		}
	case <-time.After(60 * time.Second):
		t.Fatal("ovis up still running 60 s after SIGINT")
	}
	if !strings.Contains(u.stdout.String(), "stopped: every node left the cluster cleanly") {
		t.Errorf("ovis up did not say it stopped cleanly:\n%s", u.stdout)
	}
}

// TestUpCluster: ovis up with no arguments (but free ports) starts a
// one-node cluster serving disk0; qemu-io writes it, Ctrl-C stops it, a
// second start serves the same bytes, and a second ovis up in the same
// folder is refused.
func TestUpCluster(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	u := startUpCluster(t, dir)
	for _, want := range []string{"formatted a new cluster: 1 node(s), 1 copies", "disk0 (created, 20 GiB VDI, 1 copies)", "another machine joins this cluster with:\novis node --dir ovis-node --etcd http://127.0.0.1:"} {
		if !strings.Contains(u.stdout.String(), want) {
			t.Errorf("ovis up printed\n%s\nwant %q", u.stdout, want)
		}
	}
	e := nbdinfo(t, u.uri).Exports[0]
	if e.Name != "disk0" || e.Size != 20<<30 || e.ReadOnly || !e.CanMultiConn {
		t.Errorf("nbdinfo: export %q of %d bytes, read-only %v, multi-conn %v; want disk0, 20 GiB, writable, multi-conn", e.Name, e.Size, e.ReadOnly, e.CanMultiConn)
	}
	// The default (empty) export name is disk0 too.
	if e := nbdinfo(t, strings.TrimSuffix(u.uri, "disk0")).Exports[0]; e.Size != 20<<30 {
		t.Errorf("the default export: %d bytes, want disk0's 20 GiB", e.Size)
	}
	qemuIONBD(t, u.uri, "write -P 0x6b 1M 192k", "write -P 0x6c 19G 4k")
	if r := ovis(t, dir, "up", "--listen", "127.0.0.1:0", "--node-listen", "127.0.0.1:0", "--etcd-listen", "http://127.0.0.1:0", "--etcd-peer", "http://127.0.0.1:0"); r.code != 1 || !strings.Contains(r.stderr, "in use by another process") {
		t.Errorf("a second ovis up in the same folder: exit %d, %q", r.code, r.stderr)
	}
	u.stop(t)

	u = startUpCluster(t, dir)
	if !strings.Contains(u.stdout.String(), "disk0 (exists, 20 GiB VDI, 1 copies)") {
		t.Errorf("second ovis up printed\n%s\nwant the existing disk0", u.stdout)
	}
	qemuIONBD(t, u.uri, "read -P 0x6b 1M 192k", "read -P 0x6c 19G 4k", "read -P 0 0 1M")
	u.stop(t)
}

// TestUpClusterThreeNodes: ovis up --nodes 3 keeps three copies of every
// object, on three nodes in one process.
func TestUpClusterThreeNodes(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	u := startUpCluster(t, dir, "--nodes", "3", "--size", "64M")
	if !strings.Contains(u.stdout.String(), "disk0 (created, 64 MiB VDI, 3 copies)") {
		t.Errorf("ovis up --nodes 3 printed\n%s", u.stdout)
	}
	qemuIONBD(t, u.uri, "write -P 0x21 0 6M", "write -P 0x22 60M 4M")
	r := ovis(t, dir, "cluster", "check", "-a", u.admin)
	if r.code != 0 || !strings.Contains(r.stdout, "problems") || !strings.Contains(r.stdout, " 0 problems") {
		t.Errorf("cluster check: exit %d\n%s%s", r.code, r.stdout, r.stderr)
	}
	// 6 MiB + 4 MiB in 4 MiB objects: 3 objects, 9 copies.
	if !strings.Contains(r.stdout, "3 objects, 9 copies") {
		t.Errorf("cluster check: %s; want 3 objects in 9 copies", r.stdout)
	}
	u.stop(t)
	for i := 1; i <= 3; i++ {
		if _, err := os.Stat(filepath.Join(dir, "ovis-data", fmt.Sprintf("node%d", i), "node-id")); err != nil {
			t.Errorf("node %d keeps no data in ovis-data: %v", i, err)
		}
	}
}
