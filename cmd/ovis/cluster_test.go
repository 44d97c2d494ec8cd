package main

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"io"
	"io/fs"
	"math/big"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ovis-storage/ovis/internal/nodeproc"
	"github.com/ovis-storage/ovis/internal/testutil"
)

// clusterNode is one `ovis node` process.
type clusterNode struct {
	proc    *nodeproc.Proc
	dir     string
	addr    string // node-to-node and admin
	etcd    string // the embedded etcd's URL, for the first node
	nbd     string
	metrics string
	stderr  *syncBuffer
}

// startClusterNode starts `ovis node` with its data in dir and waits until
// it prints where it serves. etcd is the cluster's etcd; empty embeds one.
func startClusterNode(t *testing.T, dir, etcd string, extra ...string) *clusterNode {
	t.Helper()
	return startClusterNodeCmd(t, exec.Command, "127.0.0.1", dir, etcd, extra...)
}

// startClusterNodeCmd is startClusterNode with the command made by mk
// (to run the node in a network namespace, say), listening on host.
func startClusterNodeCmd(t *testing.T, mk func(name string, args ...string) *exec.Cmd, host, dir, etcd string, extra ...string) *clusterNode {
	t.Helper()
	n, err := tryStartClusterNode(t, mk, host, dir, etcd, extra...)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// restartClusterNode starts `ovis node` on dir again at its old node
// address addr, or, when another process took that port meanwhile (an
// outgoing connection's ephemeral port can be any), at a new one: the
// node's ID is kept in dir, so its address may change.
func restartClusterNode(t *testing.T, dir, etcd, addr string, extra ...string) *clusterNode {
	t.Helper()
	n, err := tryStartClusterNode(t, exec.Command, "127.0.0.1", dir, etcd, append([]string{"--listen", addr}, extra...)...)
	if err != nil && strings.Contains(err.Error(), "address already in use") {
		t.Logf("node %s: its address %s is taken: a new one", dir, addr)
		n, err = tryStartClusterNode(t, exec.Command, "127.0.0.1", dir, etcd, extra...)
	}
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// tryStartClusterNode is startClusterNodeCmd returning its failure to
// start.
func tryStartClusterNode(t *testing.T, mk func(name string, args ...string) *exec.Cmd, host, dir, etcd string, extra ...string) (*clusterNode, error) {
	t.Helper()
	args := []string{"node", "--dir", dir, "--listen", host + ":0", "--nbd", host + ":0", "--metrics", host + ":0", "--log-level", "info"}
	if etcd == "" {
		args = append(args, "--etcd-listen", "http://127.0.0.1:0", "--etcd-peer", "http://127.0.0.1:0")
	} else {
		args = append(args, "--etcd", etcd)
	}
	args = append(args, extra...)
	n := &clusterNode{dir: dir, stderr: &syncBuffer{}}
	cmd := mk(serverBin, args...)
	cmd.Stderr = n.stderr
	p, err := nodeproc.Start(cmd, nil)
	if err != nil {
		t.Fatal(err)
	}
	n.proc = p
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if err := p.Ready(ctx); err != nil {
		p.Stop(syscall.SIGKILL, 30*time.Second)
		return nil, fmt.Errorf("ovis %s: %w\nstderr:\n%s", strings.Join(args, " "), err, n.stderr)
	}
	n.addr, n.etcd, n.metrics, n.nbd = p.Addr, p.Etcd, p.Metrics, p.NBD
	t.Cleanup(func() { n.kill(syscall.SIGKILL) })
	t.Cleanup(func() {
		if t.Failed() {
			var warn []string
			for _, l := range strings.Split(n.stderr.String(), "\n") {
				// Recovery's decisions that change or withhold a copy
				// are logged at info; a failed test wants them too.
				if strings.Contains(l, "level=WARN") || strings.Contains(l, "level=ERROR") ||
					strings.Contains(l, "msg=\"recovery: ") || strings.Contains(l, "msg=\"recovery listed") || strings.Contains(l, "msg=\"gate kept") {
					warn = append(warn, l)
				}
			}
			t.Logf("node %s: its warnings, errors and recovery decisions:\n%s", dir, strings.Join(warn[max(0, len(warn)-60):], "\n"))
		}
	})
	return n, nil
}

// kill sends sig and waits for the process to end.
func (n *clusterNode) kill(sig syscall.Signal) {
	n.proc.Stop(sig, 30*time.Second)
}

// admin runs an admin verb against node n.
func (n *clusterNode) admin(t *testing.T, args ...string) result {
	t.Helper()
	return ovis(t, n.dir, append(args, "-a", n.addr)...)
}

func (n *clusterNode) mustAdmin(t *testing.T, args ...string) result {
	t.Helper()
	r := n.admin(t, args...)
	if r.code != 0 {
		t.Fatalf("ovis %s: exit %d\nstderr: %s\nstdout: %s\nnode stderr:\n%s", strings.Join(args, " "), r.code, r.stderr, r.stdout, n.stderr)
	}
	return r
}

// mustAdminJSON runs an admin command with --output json, which must
// succeed, and decodes what it printed into v.
func (n *clusterNode) mustAdminJSON(t *testing.T, v any, args ...string) result {
	t.Helper()
	r := n.mustAdmin(t, append(args, "--output", "json")...)
	if err := json.Unmarshal([]byte(r.stdout), v); err != nil {
		t.Fatalf("ovis %s: %v\n%s", strings.Join(args, " "), err, r.stdout)
	}
	return r
}

// startCluster starts count nodes: with an external etcd at etcd, or with
// the first node embedding one.
func startCluster(t *testing.T, count int, etcd string, zones ...string) []*clusterNode {
	t.Helper()
	base := t.TempDir()
	extra := func(i int) []string {
		if len(zones) == 0 {
			return nil
		}
		return []string{"--zone", zones[i-1]}
	}
	first := startClusterNode(t, filepath.Join(base, "n1"), etcd, extra(1)...)
	if etcd == "" {
		etcd = first.etcd
	}
	nodes := []*clusterNode{first}
	for i := 2; i <= count; i++ {
		nodes = append(nodes, startClusterNode(t, filepath.Join(base, fmt.Sprintf("n%d", i)), etcd, extra(i)...))
	}
	waitUp(t, first, count)
	return nodes
}

// waitUp waits until node n lists count nodes that are up: every node is
// in the epoch.
func waitUp(t *testing.T, n *clusterNode, count int) {
	t.Helper()
	waitUntil(t, 20*time.Second, func() (bool, string) {
		r := n.admin(t, "node", "list", "--output", "json")
		var ns []struct {
			State string `json:"state"`
		}
		json.Unmarshal([]byte(r.stdout), &ns)
		up := 0
		for _, x := range ns {
			if x.State == "up" {
				up++
			}
		}
		return up == count, r.stdout + r.stderr
	})
}

func waitUntil(t *testing.T, d time.Duration, cond func() (bool, string)) {
	t.Helper()
	deadline := time.Now().Add(d)
	for {
		ok, last := cond()
		if ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("condition not met in %v; last: %s", d, last)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

func runQemuIO(t *testing.T, dir string, args ...string) result {
	t.Helper()
	o, e, c := testutil.RunIn(t, dir, "qemu-io", args...)
	return result{o, e, c}
}

// TestClusterEndToEnd runs three `ovis node` processes with the embedded
// etcd, formats the cluster, creates a VDI, writes it with qemu-io through
// one node and checks it through another against the same writes made to
// a raw file.
func TestClusterEndToEnd(t *testing.T) {
	nodes := startCluster(t, 3, "")
	n1, n2, n3 := nodes[0], nodes[1], nodes[2]
	dir := t.TempDir()

	if r := n1.admin(t, "vdi", "create", "early", "1M"); r.code == 0 || !strings.Contains(r.stderr, "not formatted") {
		t.Errorf("vdi create before format: exit %d, stderr %q; want a refusal naming the missing format", r.code, r.stderr)
	}
	if r := n1.admin(t, "cluster", "format", "--copies", "4"); r.code == 0 || !strings.Contains(r.stderr, "copies 4") {
		t.Errorf("format with 4 copies on 3 nodes: exit %d, stderr %q", r.code, r.stderr)
	}
	n1.mustAdmin(t, "cluster", "format", "--copies", "3")
	if r := n2.admin(t, "cluster", "format", "--copies", "2"); r.code == 0 || !strings.Contains(r.stderr, "already formatted") {
		t.Errorf("a second format without --force: exit %d, stderr %q", r.code, r.stderr)
	}
	n1.mustAdmin(t, "vdi", "create", "disk0", "64M")
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"disk0", "1M"}, "exists"},
		{[]string{"zero", "0"}, "size"},
		{[]string{"odd", "1000"}, "512"},
		{[]string{"huge", "20E"}, "size"},
		{[]string{"a/b", "1M"}, "/"},
		{[]string{"", "1M"}, "name"},
		{[]string{"ctl\x01", "1M"}, "name"},
		{[]string{strings.Repeat("x", 256), "1M"}, "name"},
		{[]string{"many", "1M", "--copies", "4"}, "copies"},
		{[]string{"objs", "1M", "--object-size", "128M"}, "object size"},
		{[]string{"objs", "1M", "--object-size", "3M"}, "object size"},
	} {
		r := n2.admin(t, append([]string{"vdi", "create"}, c.args...)...)
		if r.code == 0 || !strings.Contains(strings.ToLower(r.stderr), strings.ToLower(c.want)) {
			t.Errorf("vdi create %q: exit %d, stderr %q; want an error about %q", c.args, r.code, r.stderr, c.want)
		}
	}
	if r := n1.mustAdmin(t, "vdi", "list", "--output", "json"); strings.Count(r.stdout, `"name"`) != 1 {
		t.Errorf("after refused creates, vdi list shows:\n%s", r.stdout)
	}
	if r := ovis(t, dir, "vdi", "list", "-a", "127.0.0.1:1"); r.code == 0 || !strings.Contains(r.stderr, "no ovis node at 127.0.0.1:1") {
		t.Errorf("admin command to an address with no node: exit %d, stderr %q", r.code, r.stderr)
	}

	// The same writes to the VDI through n1 and to a raw file.
	raw := filepath.Join(dir, "model.raw")
	if r := qemuImg(t, dir, "create", "-f", "raw", raw, "64M"); r.code != 0 {
		t.Fatal(r.stderr)
	}
	script := []string{
		"write -P 0xaa 0 1M",
		"write -P 0x55 3M 2M",     // across an object boundary (4 MiB objects)
		"write -P 0x11 5000 3000", // unaligned
		"write -z 1M 512k",
		"write -P 0x77 63M 1M", // the last object
		"write -P 0x33 8M 4M",
		"discard 8M 4M", // a whole object freed
		"write -P 0x44 20M 64k",
		"discard 20M 4k", // a partial range punched
		"flush",
	}
	var qargs []string
	for _, s := range script {
		qargs = append(qargs, "-c", s)
	}
	url1 := "nbd://" + n1.nbd + "/disk0"
	url2 := "nbd://" + n2.nbd + "/disk0"
	if r := runQemuIO(t, dir, append([]string{"-f", "raw", raw}, qargs...)...); r.code != 0 {
		t.Fatal(r.stdout, r.stderr)
	}
	if r := runQemuIO(t, dir, append([]string{"-f", "raw", url1}, qargs...)...); r.code != 0 || strings.Contains(r.stdout, "failed") {
		t.Fatalf("qemu-io through node 1: exit %d\n%s%s\nnode stderr:\n%s", r.code, r.stdout, r.stderr, n1.stderr)
	}
	if r := qemuImg(t, dir, "compare", "-f", "raw", "-F", "raw", raw, url2); r.code != 0 {
		t.Fatalf("qemu-img compare of the model and the VDI through node 2: exit %d\n%s%s", r.code, r.stdout, r.stderr)
	}
	if r := n2.mustAdmin(t, "cluster", "check"); !strings.Contains(r.stdout, "0 problems") {
		t.Errorf("cluster check:\n%s", r.stdout)
	}

	// nbdcopy both ways.
	out := filepath.Join(dir, "out.raw")
	if o, e, c := testutil.RunIn(t, dir, "nbdcopy", url2, out); c != 0 {
		t.Fatalf("nbdcopy from the VDI: %s%s", o, e)
	}
	if r := qemuImg(t, dir, "compare", "-f", "raw", "-F", "raw", raw, out); r.code != 0 {
		t.Fatalf("nbdcopy's copy differs: %s%s", r.stdout, r.stderr)
	}
	if o, e, c := testutil.RunIn(t, dir, "nbdcopy", raw, url1); c != 0 {
		t.Fatalf("nbdcopy into the VDI: %s%s", o, e)
	}
	if r := qemuImg(t, dir, "compare", "-f", "raw", "-F", "raw", raw, url2); r.code != 0 {
		t.Fatalf("after nbdcopy into the VDI: %s%s", r.stdout, r.stderr)
	}

	// n1 holds the lock: n2's export is read-only and a write is refused.
	if r := n1.mustAdmin(t, "vdi", "lock", "list"); !strings.Contains(r.stdout, "disk0") || !strings.Contains(r.stdout, n1ID(t, n1)) {
		t.Errorf("lock list does not show disk0 held by node 1:\n%s", r.stdout)
	}
	if r := runQemuIO(t, dir, "-f", "raw", url2, "-c", "write -P 0x99 0 4k"); r.code == 0 && !strings.Contains(r.stdout+r.stderr, "ermission") && !strings.Contains(r.stdout+r.stderr, "read-only") {
		t.Errorf("a write through node 2 while node 1 holds the lock: exit %d\n%s%s", r.code, r.stdout, r.stderr)
	}
	w := exec.Command(ovisBin, "vdi", "write", "disk0", "0", "4096", "-a", n2.addr)
	w.Stdin = strings.NewReader(strings.Repeat("x", 4096))
	if out, err := w.CombinedOutput(); err == nil || !strings.Contains(string(out), "locked by "+n1ID(t, n1)) {
		t.Errorf("vdi write through node 2: %v, output %q; want the holder named", err, out)
	}
	// Through the holder, vdi write and read work.
	w = exec.Command(ovisBin, "vdi", "write", "disk0", "1M", "-a", n1.addr)
	w.Stdin = strings.NewReader(strings.Repeat("ovis", 1024))
	if out, err := w.CombinedOutput(); err != nil {
		t.Fatalf("vdi write through node 1: %v, %s", err, out)
	}
	if r := n2.mustAdmin(t, "vdi", "read", "disk0", "1M", "4096"); r.stdout != strings.Repeat("ovis", 1024) {
		t.Fatalf("vdi read through node 2 after vdi write: %d bytes, not what was written", len(r.stdout))
	}
	// The model gets the same bytes.
	if f, err := os.OpenFile(raw, os.O_WRONLY, 0); err != nil {
		t.Fatal(err)
	} else {
		_, err := f.WriteAt([]byte(strings.Repeat("ovis", 1024)), 1<<20)
		f.Close()
		if err != nil {
			t.Fatal(err)
		}
	}
	if r := qemuImg(t, dir, "compare", "-f", "raw", "-F", "raw", raw, url2); r.code != 0 {
		t.Fatalf("a refused writer changed data: %s%s", r.stdout, r.stderr)
	}

	// A damaged replica is found and named.
	obj := damageOneObject(t, filepath.Join(n3.dir, "objects"))
	if r := n1.admin(t, "cluster", "check"); r.code == 0 || !strings.Contains(r.stdout, obj) {
		t.Errorf("cluster check after damaging object %s on node 3: exit %d\n%s%s", obj, r.code, r.stdout, r.stderr)
	}

	// Node 3 dies: every byte still reads back through node 2.
	n3.kill(syscall.SIGKILL)
	if r := qemuImg(t, dir, "compare", "-f", "raw", "-F", "raw", raw, url2); r.code != 0 {
		t.Fatalf("after node 3's death: %s%s", r.stdout, r.stderr)
	}
}

// n1ID reads a node's ID from its data folder.
func n1ID(t *testing.T, n *clusterNode) string {
	b, err := os.ReadFile(filepath.Join(n.dir, "node-id"))
	if err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(string(b))
}

// damageOneObject flips a byte of the data of one object file under dir
// and returns the object's ID as ovis prints it.
func damageOneObject(t *testing.T, dir string) string {
	t.Helper()
	var victim string
	filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() || victim != "" {
			return nil
		}
		if fi, err := d.Info(); err == nil && fi.Size() > 4096+100 {
			victim = path
		}
		return nil
	})
	if victim == "" {
		t.Fatalf("no object file with data under %s", dir)
	}
	f, err := os.OpenFile(victim, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	b := make([]byte, 1)
	if _, err := f.ReadAt(b, 4096+10); err != nil && err != io.EOF {
		t.Fatal(err)
	}
	b[0] ^= 0xff
	if _, err := f.WriteAt(b, 4096+10); err != nil {
		t.Fatal(err)
	}
	rel, _ := filepath.Rel(dir, victim)
	// objects/<vdi hex>/<index hex>: the ID is the two, each 8 digits.
	parts := strings.Split(filepath.ToSlash(rel), "/")
	if len(parts) < 2 {
		t.Fatalf("object file %s is not under a VDI's folder", victim)
	}
	return parts[len(parts)-2] + parts[len(parts)-1]
}

// nodeMetric sums a metric's samples (every label set) over nodes.
func nodeMetric(t *testing.T, nodes []*clusterNode, name string) float64 {
	t.Helper()
	return nodeMetrics(t, nodes, name)[0]
}

// nodeMetrics sums each metric's samples (every label set) over nodes,
// from one scrape of each node, so that counters a request moves
// together are read at one moment.
func nodeMetrics(t *testing.T, nodes []*clusterNode, names ...string) []float64 {
	t.Helper()
	sums := make([]float64, len(names))
	for _, n := range nodes {
		resp, err := http.Get("http://" + n.metrics + "/metrics")
		if err != nil {
			t.Fatal(err)
		}
		b, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if err != nil {
			t.Fatal(err)
		}
		for _, l := range strings.Split(string(b), "\n") {
			f := strings.Fields(l)
			if len(f) != 2 {
				continue
			}
			for i, name := range names {
				if f[0] != name && !strings.HasPrefix(f[0], name+"{") {
					continue
				}
				v, err := strconv.ParseFloat(f[1], 64)
				if err != nil {
					t.Fatalf("metric line %q: %v", l, err)
				}
				sums[i] += v
			}
		}
	}
	return sums
}

// TestClusterExternalEtcd runs three nodes against a three-member etcd
// cluster of Debian's etcd-server. fio writes and verifies through four
// connections; FUA writes reach each replica as one sync request and no
// flush, and plain writes plus a flush as plain requests and one flush per
// replica.
func TestClusterExternalEtcd(t *testing.T) {
	etcd := testutil.EtcdEndpoints(testutil.StartEtcd(t, 3))
	nodes := startCluster(t, 3, etcd)
	n1, n2 := nodes[0], nodes[1]
	dir := t.TempDir()
	n1.mustAdmin(t, "cluster", "format", "--copies", "3")
	n1.mustAdmin(t, "vdi", "create", "disk0", "32M")
	if r := n2.mustAdmin(t, "cluster", "info"); !strings.Contains(r.stdout, etcd) {
		t.Errorf("cluster info does not name the external etcd %s:\n%s", etcd, r.stdout)
	}

	// fio: 4 connections, iodepth 8, each job its own 8 MiB, crc32c
	// verified after writing.
	url := "nbd://" + n1.nbd + "/disk0"
	o, e, c := testutil.RunIn(t, dir, "fio", "--name=verify", "--ioengine=nbd", "--uri="+url, "--rw=randwrite", "--bs=4k",
		"--iodepth=8", "--numjobs=4", "--size=8M", "--offset_increment=8M", "--verify=crc32c", "--do_verify=1", "--group_reporting")
	if c != 0 || strings.Contains(o, "verify: bad") {
		t.Fatalf("fio: exit %d\n%s%s\nnode stderr:\n%s", c, o, e, n1.stderr)
	}
	// The same bytes through another node.
	out1, out2 := filepath.Join(dir, "via1.raw"), filepath.Join(dir, "via2.raw")
	for _, cp := range [][2]string{{url, out1}, {"nbd://" + n2.nbd + "/disk0", out2}} {
		if o, e, c := testutil.RunIn(t, dir, "nbdcopy", cp[0], cp[1]); c != 0 {
			t.Fatalf("nbdcopy %s: %s%s", cp[0], o, e)
		}
	}
	if r := qemuImg(t, dir, "compare", "-f", "raw", "-F", "raw", out1, out2); r.code != 0 {
		t.Fatalf("the VDI through node 1 and node 2 differ: %s%s", r.stdout, r.stderr)
	}
	n1.mustAdmin(t, "cluster", "check")

	// Each node reports its epoch (3 joins: at least 3) and what it holds:
	// 32 MiB written over 8 MiB regions, copies 3.
	if got := nodeMetric(t, nodes, "ovis_node_epoch"); got < 9 {
		t.Errorf("ovis_node_epoch sums to %v over 3 nodes, want each at 3 or more", got)
	}
	if got := nodeMetric(t, nodes, "ovis_node_objects"); got != 24 {
		t.Errorf("ovis_node_objects sums to %v, want 8 objects × 3 copies", got)
	}
	// qemu-io's default cache mode is writethrough: every write is FUA.
	sync0, flush0, writes0 := nodeMetric(t, nodes, "ovis_node_sync_writes_total"), nodeMetric(t, nodes, "ovis_node_flushes_total"), nodeMetric(t, nodes, `ovis_node_requests_total{op="write",status="ok"}`)
	if r := runQemuIO(t, dir, "-f", "raw", url, "-c", "write -P 1 0 4k", "-c", "write -P 2 1M 4k", "-c", "write -P 3 9M 4k"); r.code != 0 {
		t.Fatal(r.stdout, r.stderr)
	}
	if got := nodeMetric(t, nodes, "ovis_node_sync_writes_total") - sync0; got != 9 {
		t.Errorf("3 FUA writes, copies 3: %v sync writes at the nodes, want 9", got)
	}
	if got := nodeMetric(t, nodes, `ovis_node_requests_total{op="write",status="ok"}`) - writes0; got != 9 {
		t.Errorf("3 FUA writes, copies 3: %v writes at the nodes, want 9", got)
	}
	if got := nodeMetric(t, nodes, "ovis_node_flushes_total") - flush0; got != 0 {
		t.Errorf("3 FUA writes: %v flushes at the nodes, want 0", got)
	}
	// With a write cache: plain writes, then one flush per replica node.
	sync0, flush0 = nodeMetric(t, nodes, "ovis_node_sync_writes_total"), nodeMetric(t, nodes, "ovis_node_flushes_total")
	if r := runQemuIO(t, dir, "-t", "writeback", "-f", "raw", url, "-c", "write -P 4 0 4k", "-c", "flush"); r.code != 0 {
		t.Fatal(r.stdout, r.stderr)
	}
	if got := nodeMetric(t, nodes, "ovis_node_sync_writes_total") - sync0; got != 0 {
		t.Errorf("a write with the cache on: %v sync writes, want 0", got)
	}
	if got := nodeMetric(t, nodes, "ovis_node_flushes_total") - flush0; got != 3 {
		t.Errorf("one write and a flush, copies 3: %v flushes at the nodes, want 3", got)
	}
}

// TestClusterNodeLeaveRecovers: four nodes, copies 2. After a node
// leaves, objects whose placement moved have one copy left and a new
// replica that does not hold them yet. Reads return the data throughout;
// writes to such objects succeed (the new replica recovers the object
// before it takes the write); recovery makes the missing copies, and
// afterwards every object is on exactly two nodes, identical.
func TestClusterNodeLeaveRecovers(t *testing.T) {
	nodes := startCluster(t, 4, "")
	n1 := nodes[0]
	dir := t.TempDir()
	n1.mustAdmin(t, "cluster", "format", "--copies", "2")
	n1.mustAdmin(t, "vdi", "create", "disk0", "64M")
	raw := filepath.Join(dir, "model.raw")
	if r := qemuImg(t, dir, "create", "-f", "raw", raw, "64M"); r.code != 0 {
		t.Fatal(r.stderr)
	}
	url := "nbd://" + n1.nbd + "/disk0"
	for _, target := range []string{raw, url} {
		if r := runQemuIO(t, dir, "-f", "raw", target, "-c", "write -P 0x5a 0 64M"); r.code != 0 || strings.Contains(r.stdout, "failed") {
			t.Fatalf("fill %s: %s%s", target, r.stdout, r.stderr)
		}
	}
	// Node 4 leaves cleanly: the others move to a new epoch.
	nodes[3].kill(syscall.SIGTERM)
	waitUntil(t, 20*time.Second, func() (bool, string) {
		r := n1.admin(t, "node", "list", "--output", "json")
		return strings.Count(r.stdout, `"id"`) == 3, r.stdout
	})
	if r := qemuImg(t, dir, "compare", "-f", "raw", "-F", "raw", raw, url); r.code != 0 {
		t.Fatalf("after a node left, the VDI reads back different: %s%s", r.stdout, r.stderr)
	}
	// Every write goes through: objects whose copy was on node 4 are
	// recovered onto their new replica first (on demand, or by the
	// recovery run), and no write is refused.
	for i := range 16 {
		cmd := fmt.Sprintf("write -P 0x%02x %dM 4k", 0x60+i, 4*i+1)
		if r := runQemuIO(t, dir, "-f", "raw", url, "-c", cmd); strings.Contains(r.stdout+r.stderr, "failed") || r.code != 0 {
			t.Fatalf("write %q after a node left: %s%s", cmd, r.stdout, r.stderr)
		}
		if r := runQemuIO(t, dir, "-f", "raw", raw, "-c", cmd); r.code != 0 {
			t.Fatal(r.stderr)
		}
	}
	if r := qemuImg(t, dir, "compare", "-f", "raw", "-F", "raw", raw, url); r.code != 0 {
		t.Fatalf("after the writes, the VDI differs from what was acknowledged: %s%s", r.stdout, r.stderr)
	}
	// Recovery ends on every node, and then each object has its two
	// copies on the three nodes left, identical: the copies that were on
	// node 4 were made again, none is missing and none is extra.
	waitRecovered(t, n1, 3)
	r := n1.admin(t, "cluster", "check")
	if r.code != 0 || !strings.Contains(r.stdout, "16 objects, 32 copies compared, 0 problems") {
		t.Errorf("cluster check after a node left and recovery ran: exit %d\n%s%s", r.code, r.stdout, r.stderr)
	}
	// The surviving nodes hold 32 copies between them: what node 4 held
	// was re-replicated, and nothing more.
	held := nodeObjects(t, n1)
	total := 0
	for _, c := range held {
		total += c
	}
	if total != 32 {
		t.Errorf("the three nodes hold %d copies, want 32 (16 objects × 2): %v", total, held)
	}
}

// TestClusterSuspendedWriterIsFenced: the gateway holding a VDI's lock is
// suspended (SIGSTOP) past its 5 s lease; another node takes the VDI over.
// After SIGCONT the old gateway cannot change a byte, on any copy, and
// it stops serving.
func TestClusterSuspendedWriterIsFenced(t *testing.T) {
	nodes := startCluster(t, 3, "")
	n1, n2, n3 := nodes[0], nodes[1], nodes[2]
	dir := t.TempDir()
	n1.mustAdmin(t, "cluster", "format", "--copies", "3")
	n1.mustAdmin(t, "vdi", "create", "disk0", "16M")
	old := startQemuIO(t, "nbd://"+n3.nbd+"/disk0")
	old.do("write -P 0x11 0 64k", "wrote")
	if r := n1.mustAdmin(t, "vdi", "lock", "list"); !strings.Contains(r.stdout, n1ID(t, n3)) {
		t.Fatalf("node 3 does not hold disk0's lock:\n%s", r.stdout)
	}
	n3.proc.Signal(syscall.SIGSTOP)
	defer n3.proc.Signal(syscall.SIGCONT)
	// The lease (5 s) runs out at etcd: the lock goes with it.
	waitUntil(t, 30*time.Second, func() (bool, string) {
		r := n1.admin(t, "vdi", "lock", "list")
		return r.code == 0 && !strings.Contains(r.stdout, n1ID(t, n3)), r.stdout
	})
	url2 := "nbd://" + n2.nbd + "/disk0"
	if r := runQemuIO(t, dir, "-f", "raw", url2, "-c", "write -P 0x22 0 64k"); r.code != 0 || strings.Contains(r.stdout, "failed") {
		t.Fatalf("the new owner's write: %s%s", r.stdout, r.stderr)
	}
	if r := n1.mustAdmin(t, "vdi", "lock", "list"); !strings.Contains(r.stdout, n1ID(t, n2)) {
		t.Fatalf("node 2 did not take disk0's lock:\n%s", r.stdout)
	}
	// The write is on node 3's socket before it runs again, so that it
	// races the node's own discovery that its lease is gone.
	fmt.Fprintln(old.in, "write -P 0x33 0 64k")
	time.Sleep(200 * time.Millisecond)
	n3.proc.Signal(syscall.SIGCONT)
	deadline := time.After(20 * time.Second)
wait:
	for {
		select {
		case l, ok := <-old.lines:
			if !ok || strings.Contains(l, "failed") || strings.Contains(l, "rror") {
				break wait
			}
			if strings.Contains(l, "wrote") {
				t.Fatalf("the fenced gateway acknowledged a write: %s", l)
			}
		case <-deadline:
			t.Fatal("the fenced gateway's write neither failed nor succeeded in 20 s")
		}
	}
	if r := runQemuIO(t, dir, "-f", "raw", url2, "-c", "read -P 0x22 0 64k"); r.code != 0 || strings.Contains(r.stdout, "failed") {
		t.Fatalf("after SIGCONT the data is not the new owner's: %s%s", r.stdout, r.stderr)
	}
	// Node 3's own copy never took the fenced write: it holds what it
	// had, or the new owner's bytes once it has recovered.
	copy3 := findObjectFile(t, filepath.Join(n3.dir, "objects"), "00000001", "00000000")
	b := make([]byte, 64<<10)
	if f, err := os.Open(copy3); err != nil {
		t.Fatal(err)
	} else {
		f.ReadAt(b, 4096)
		f.Close()
	}
	if b[0] == 0x33 || b[len(b)-1] == 0x33 || b[0] != b[len(b)-1] {
		t.Errorf("node 3's copy starts %#x and ends %#x; want the 0x11 it held before it was fenced, or the new owner's 0x22", b[0], b[len(b)-1])
	}
	// Node 3 rejoins by itself, gives up disk0 (node 2 owns it now) and
	// serves again.
	waitUntil(t, 30*time.Second, func() (bool, string) {
		e := n3.stderr.String()
		return strings.Contains(e, "rejoined the membership") && strings.Contains(e, "vdi lost while this node was away"), e
	})
	waitUp(t, n1, 3)
	if r := runQemuIO(t, dir, "-f", "raw", "nbd://"+n3.nbd+"/disk0", "-r", "-c", "read -P 0x22 0 64k"); r.code != 0 || strings.Contains(r.stdout, "failed") {
		t.Fatalf("reading through node 3 after it rejoined: %s%s", r.stdout, r.stderr)
	}
}

// findObjectFile returns the file of object (vdi, index), both as 8 hex
// digits, under dir.
func findObjectFile(t *testing.T, dir, vdi, index string) string {
	t.Helper()
	var found string
	filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err == nil && !d.IsDir() && filepath.Base(path) == index && filepath.Base(filepath.Dir(path)) == vdi {
			found = path
		}
		return nil
	})
	if found == "" {
		t.Fatalf("no file of object %s%s under %s", vdi, index, dir)
	}
	return found
}

// TestClusterZones: four nodes in two zones, copies 2: every object has
// one copy in each zone; copies 3 cannot be asked for.
func TestClusterZones(t *testing.T) {
	nodes := startCluster(t, 4, "", "1", "1", "2", "2")
	n1 := nodes[0]
	dir := t.TempDir()
	if r := n1.admin(t, "cluster", "format", "--copies", "3"); r.code == 0 {
		t.Errorf("copies 3 over 2 zones was accepted: %s", r.stdout)
	}
	n1.mustAdmin(t, "cluster", "format", "--copies", "2")
	if r := n1.admin(t, "vdi", "create", "three", "1M", "--copies", "3"); r.code == 0 || !strings.Contains(r.stderr, "copies") {
		t.Errorf("a VDI of 3 copies over 2 zones: exit %d, %q", r.code, r.stderr)
	}
	n1.mustAdmin(t, "vdi", "create", "disk0", "128M")
	if r := runQemuIO(t, dir, "-f", "raw", "nbd://"+n1.nbd+"/disk0", "-c", "write -P 7 0 128M"); r.code != 0 || strings.Contains(r.stdout, "failed") {
		t.Fatal(r.stdout, r.stderr)
	}
	zoneOf := map[int]string{0: "1", 1: "1", 2: "2", 3: "2"}
	holders := map[string][]string{}
	for i, n := range nodes {
		filepath.WalkDir(filepath.Join(n.dir, "objects"), func(path string, d fs.DirEntry, err error) error {
			if err == nil && !d.IsDir() && len(d.Name()) == 8 && len(filepath.Base(filepath.Dir(path))) == 8 {
				id := filepath.Base(filepath.Dir(path)) + d.Name()
				holders[id] = append(holders[id], zoneOf[i])
			}
			return nil
		})
	}
	if len(holders) != 32 {
		t.Fatalf("%d objects found, want 32 (128 MiB of 4 MiB objects)", len(holders))
	}
	for id, zs := range holders {
		if len(zs) != 2 || zs[0] == zs[1] {
			t.Errorf("object %s: copies in zones %v, want one in each of the two", id, zs)
		}
	}
	n1.mustAdmin(t, "cluster", "check")
}

// TestClusterBadNames: an unknown VDI is refused by name, over NBD and by
// every admin verb, and nothing changes.
func TestClusterBadNames(t *testing.T) {
	nodes := startCluster(t, 1, "")
	n1 := nodes[0]
	dir := t.TempDir()
	n1.mustAdmin(t, "cluster", "format")
	if o, e, c := testutil.RunIn(t, dir, "nbdinfo", "nbd://"+n1.nbd+"/nosuch"); c == 0 || !strings.Contains(o+e, "nosuch") {
		t.Errorf("nbdinfo of an unknown VDI: exit %d\n%s%s", c, o, e)
	}
	for _, args := range [][]string{
		{"vdi", "delete", "nosuch"},
		{"vdi", "resize", "nosuch", "1G"},
		{"vdi", "read", "nosuch"},
		{"vdi", "lock", "break", "nosuch"},
	} {
		if r := n1.admin(t, args...); r.code == 0 || !strings.Contains(r.stderr, "nosuch") {
			t.Errorf("ovis %s: exit %d, stderr %q; want an error naming the VDI", strings.Join(args, " "), r.code, r.stderr)
		}
	}
	if r := n1.admin(t, "cluster", "format"); r.code == 0 || !strings.Contains(r.stderr, "already formatted") {
		t.Errorf("a second format: exit %d, %q", r.code, r.stderr)
	}
	if r := n1.mustAdmin(t, "cluster", "format", "--force", "--copies", "1"); !strings.Contains(r.stdout, "copies 1") {
		t.Errorf("format --force: %s", r.stdout)
	}
}

// nodePKI writes a CA and one certificate for 127.0.0.1 good for both
// ends of a connection (every node is a server and a client), as PEM
// files, and returns the flags that use them.
func nodePKI(t *testing.T) []string {
	t.Helper()
	dir := t.TempDir()
	key := func() *ecdsa.PrivateKey {
		k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		if err != nil {
			t.Fatal(err)
		}
		return k
	}
	caKey, nodeKey := key(), key()
	caTmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "ovis cluster CA"}, IsCA: true, BasicConstraintsValid: true,
		KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature, NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour)}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	ca, _ := x509.ParseCertificate(caDER)
	nodeDER, err := x509.CreateCertificate(rand.Reader, &x509.Certificate{SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: "ovis node"},
		IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)}, KeyUsage: x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
		NotBefore:   time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour)}, ca, &nodeKey.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(nodeKey)
	if err != nil {
		t.Fatal(err)
	}
	files := map[string][]byte{
		"ca.pem":   pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: caDER}),
		"node.pem": pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: nodeDER}),
		"key.pem":  pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER}),
	}
	for name, b := range files {
		if err := os.WriteFile(filepath.Join(dir, name), b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	return []string{"--tls-cert", filepath.Join(dir, "node.pem"), "--tls-key", filepath.Join(dir, "key.pem"), "--tls-ca", filepath.Join(dir, "ca.pem")}
}

// TestClusterTLS: two nodes talk mutual TLS; data written through one
// reads back through the other; an admin command without the
// certificate is refused, and one with it works.
func TestClusterTLS(t *testing.T) {
	tlsArgs := nodePKI(t)
	base := t.TempDir()
	n1 := startClusterNode(t, filepath.Join(base, "n1"), "", tlsArgs...)
	n2 := startClusterNode(t, filepath.Join(base, "n2"), n1.etcd, tlsArgs...)
	dir := t.TempDir()
	admin := func(n *clusterNode, args ...string) result {
		return ovis(t, dir, append(append(args, "-a", n.addr), tlsArgs...)...)
	}
	if r := n1.admin(t, "cluster", "format"); r.code == 0 {
		t.Fatalf("an admin command without TLS was served: %s", r.stdout)
	}
	// The embedded etcd serves mutual TLS too: https, and no answer to a
	// client without a certificate the CA signed.
	if !strings.HasPrefix(n1.etcd, "https://") {
		t.Fatalf("with TLS, node 1's embedded etcd is at %s, want https", n1.etcd)
	}
	hc := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}}}
	if resp, err := hc.Get(n1.etcd + "/version"); err == nil {
		resp.Body.Close()
		t.Fatalf("the embedded etcd answered a client without a certificate: %s", resp.Status)
	}
	waitUntil(t, 20*time.Second, func() (bool, string) {
		r := admin(n1, "node", "list", "--output", "json")
		return strings.Count(r.stdout, `"state": "up"`) == 2, r.stdout + r.stderr
	})
	if r := admin(n1, "cluster", "format", "--copies", "2"); r.code != 0 {
		t.Fatalf("format over TLS: %s%s", r.stdout, r.stderr)
	}
	if r := admin(n1, "vdi", "create", "disk0", "16M"); r.code != 0 {
		t.Fatalf("vdi create over TLS: %s%s", r.stdout, r.stderr)
	}
	if r := runQemuIO(t, dir, "-f", "raw", "nbd://"+n1.nbd+"/disk0", "-c", "write -P 0x3c 0 8M"); r.code != 0 || strings.Contains(r.stdout, "failed") {
		t.Fatalf("write through node 1: %s%s\n%s", r.stdout, r.stderr, n1.stderr)
	}
	if r := runQemuIO(t, dir, "-r", "-f", "raw", "nbd://"+n2.nbd+"/disk0", "-c", "read -P 0x3c 0 8M"); r.code != 0 || strings.Contains(r.stdout, "failed") {
		t.Fatalf("read through node 2: %s%s\n%s", r.stdout, r.stderr, n2.stderr)
	}
	if r := admin(n2, "cluster", "check"); r.code != 0 || !strings.Contains(r.stdout, "2 objects, 4 copies") {
		t.Errorf("cluster check over TLS: exit %d\n%s%s", r.code, r.stdout, r.stderr)
	}
}
