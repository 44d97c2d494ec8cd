package main

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ovis-storage/ovis/internal/testutil"
)

// mustQemuIO runs qemu-io in dir and fails the test, naming what, when
// it exits non-zero or a command failed (a write, a read, a pattern).
func mustQemuIO(t *testing.T, dir, what string, args ...string) {
	t.Helper()
	if r := runQemuIO(t, dir, args...); r.code != 0 || strings.Contains(r.stdout, "fail") {
		t.Fatalf("%s: %s%s", what, r.stdout, r.stderr)
	}
}

// fioVerify returns fio's arguments for a crc32c-verified random write
// of size bytes at offset through url, paced so that it runs for a few
// seconds (a node can be killed while it runs). verifyOnly re-reads and
// checks what an earlier run with the same offset and size wrote.
func fioVerify(url string, offset, size string, verifyOnly bool) []string {
	args := []string{"--name=verify", "--ioengine=nbd", "--uri=" + url, "--rw=randwrite", "--bs=4k",
		"--iodepth=8", "--offset=" + offset, "--size=" + size, "--verify=crc32c", "--do_verify=1",
		"--rate_iops=1500", "--randrepeat=1", "--group_reporting"}
	if verifyOnly {
		args = append(args, "--verify_only")
	}
	return args
}

// startFio starts fio in the background; wait returns its output and
// fails the test on an error or a bad block.
func startFio(t *testing.T, dir string, args ...string) (wait func()) {
	t.Helper()
	waitCmd := startCmd(t, dir, 3*time.Minute, "fio", args...)
	return func() {
		t.Helper()
		o, _, err := waitCmd()
		if err != nil || strings.Contains(o, "verify: bad") || strings.Contains(o, "err=") && !strings.Contains(o, "err= 0") {
			t.Fatalf("fio %s: %v\n%s", strings.Join(args, " "), err, o)
		}
	}
}

// startCmd starts name with args in dir in the background; wait returns
// what it printed (stdout and stderr), how long it ran and how it ended,
// and fails the test, killing it, when it has not ended within limit.
func startCmd(t *testing.T, dir string, limit time.Duration, name string, args ...string) (wait func() (string, time.Duration, error)) {
	t.Helper()
	cmd := exec.Command(name, args...)
	cmd.Dir = dir
	var out syncBuffer
	cmd.Stdout, cmd.Stderr = &out, &out
	start := time.Now()
	if err := cmd.Start(); err != nil {
		t.Fatalf("%s: %v", name, err)
	}
	var took time.Duration
	done := make(chan error, 1)
	go func() {
		err := cmd.Wait()
		took = time.Since(start)
		done <- err
	}()
	t.Cleanup(func() { cmd.Process.Kill() })
	return func() (string, time.Duration, error) {
		t.Helper()
		select {
		case err := <-done:
			return out.String(), took, err
		case <-time.After(limit):
			cmd.Process.Kill()
			<-done
			t.Fatalf("%s did not end in %v:\n%s", name, limit, out.String())
			return "", 0, nil
		}
	}
}

// waitRecovered waits until every node n lists is up, has recovered its
// epoch and dropped the copies it no longer holds, and there are want of
// them.
func waitRecovered(t *testing.T, n *clusterNode, want int) {
	t.Helper()
	waitUntil(t, 60*time.Second, func() (bool, string) {
		r := n.admin(t, "node", "list", "--output", "json")
		var ns []struct {
			State    string `json:"state"`
			Epoch    uint64 `json:"epoch"`
			Recovery struct {
				Done  uint64 `json:"done"`
				Clean uint64 `json:"clean"`
			} `json:"recovery"`
		}
		if json.Unmarshal([]byte(r.stdout), &ns) != nil || len(ns) != want {
			return false, r.stdout + r.stderr
		}
		for _, x := range ns {
			if x.State != "up" || x.Recovery.Done < x.Epoch || x.Recovery.Clean < x.Epoch {
				return false, r.stdout
			}
		}
		return true, ""
	})
}

// checkAll runs cluster check and wants every object with all its
// copies, identical.
func checkAll(t *testing.T, n *clusterNode, when string) {
	t.Helper()
	r := n.admin(t, "cluster", "check")
	if r.code != 0 || !strings.Contains(r.stdout, " 0 problems") {
		t.Fatalf("%s: cluster check exit %d\n%s%s", when, r.code, r.stdout, r.stderr)
	}
	t.Logf("%s: %s", when, strings.TrimSpace(r.stdout))
}

// TestClusterKillRestart is issue 18's first fault test. Four nodes,
// copies 3. fio writes with crc32c verification through node 2 while
// node 4 is killed with SIGKILL: no write fails, and everything
// verifies. Recovery then puts every object on three of the three nodes
// left. Node 4 is restarted (its port again): it catches up, and the
// copies are again spread over four nodes, all identical. Then node 3 is
// killed during another verified write. After every step all data
// verifies and cluster check finds every object on 3 nodes with equal
// bytes.
func TestClusterKillRestart(t *testing.T) {
	nodes := startCluster(t, 4, "")
	n1, n2, n3, n4 := nodes[0], nodes[1], nodes[2], nodes[3]
	dir := t.TempDir()
	n1.mustAdmin(t, "cluster", "format", "--copies", "3")
	n1.mustAdmin(t, "vdi", "create", "disk0", "64M")
	url := "nbd://" + n2.nbd + "/disk0"

	wait := startFio(t, dir, fioVerify(url, "0", "16M", false)...)
	time.Sleep(1500 * time.Millisecond)
	n4.kill(syscall.SIGKILL)
	killed := time.Now()
	wait()
	t.Logf("fio ended %v after node 4 was killed", time.Since(killed).Round(time.Millisecond))
	waitRecovered(t, n1, 3)
	checkAll(t, n1, "after node 4 was killed")
	startFio(t, dir, fioVerify(url, "0", "16M", true)...)()

	// Node 4 comes back at its address, with the copies it had.
	n4 = restartClusterNode(t, n4.dir, n1.etcd, n4.addr)
	waitRecovered(t, n1, 4)
	checkAll(t, n1, "after node 4 came back")
	startFio(t, dir, fioVerify(url, "0", "16M", true)...)()

	wait = startFio(t, dir, fioVerify(url, "16M", "16M", false)...)
	time.Sleep(1500 * time.Millisecond)
	n3.kill(syscall.SIGKILL)
	wait()
	waitRecovered(t, n1, 3)
	checkAll(t, n1, "after node 3 was killed")
	startFio(t, dir, fioVerify(url, "0", "16M", true)...)()
	startFio(t, dir, fioVerify(url, "16M", "16M", true)...)()

	// The objects are where the placement says, three copies each, and
	// the nodes left hold nothing more.
	held := nodeObjects(t, n1)
	total := 0
	for _, c := range held {
		total += c
	}
	if total != 3*8 {
		t.Errorf("the nodes hold %d copies, want %d (8 objects × 3): %v", total, 3*8, held)
	}
}

// nodeObjects returns how many objects each node (by ID) holds.
func nodeObjects(t *testing.T, n *clusterNode) map[string]int {
	t.Helper()
	var list []struct {
		ID      string `json:"id"`
		Objects int    `json:"objects"`
	}
	n.mustAdminJSON(t, &list, "node", "list")
	out := map[string]int{}
	for _, x := range list {
		out[x.ID] = x.Objects
	}
	return out
}

// TestClusterJoinUnderLoad: a fourth node joins three (copies 3) while
// fio writes and verifies. It receives its share of the 512 objects;
// the old nodes only give copies away (none moves between them); every
// node ends within 10 % of the ideal, every object on 3 nodes with
// equal bytes, and everything verifies.
func TestClusterJoinUnderLoad(t *testing.T) {
	nodes := startCluster(t, 3, "")
	n1 := nodes[0]
	dir := t.TempDir()
	n1.mustAdmin(t, "cluster", "format", "--copies", "3")
	n1.mustAdmin(t, "vdi", "create", "disk0", "512M", "--object-size", "1M")
	url := "nbd://" + n1.nbd + "/disk0"
	var cmds []string
	for i := range 512 {
		cmds = append(cmds, "-c", fmt.Sprintf("write -P 0x%02x %dM 4k", i%251, i))
	}
	mustQemuIO(t, dir, "qemu-io", append([]string{"-f", "raw", url}, cmds...)...)
	before := nodeObjects(t, n1)

	wait := startFio(t, dir, fioVerify(url, "64M", "16M", false)...)
	time.Sleep(time.Second)
	n4 := startClusterNode(t, filepath.Join(filepath.Dir(n1.dir), "n4"), n1.etcd)
	wait()
	waitRecovered(t, n1, 4)
	checkAll(t, n1, "after node 4 joined")
	startFio(t, dir, fioVerify(url, "64M", "16M", true)...)()
	var reads []string
	for i := 0; i < 512; i += 37 {
		if i >= 64 && i < 80 {
			continue // fio's range
		}
		reads = append(reads, "-c", fmt.Sprintf("read -P 0x%02x %dM 4k", i%251, i))
	}
	mustQemuIO(t, dir, "read back after the join", append([]string{"-f", "raw", url}, reads...)...)

	after := nodeObjects(t, n1)
	total := 0
	for _, c := range after {
		total += c
	}
	if total != 3*512 {
		t.Errorf("%d copies after the join, want %d: %v", total, 3*512, after)
	}
	ideal := float64(total) / 4
	for id, c := range after {
		if d := float64(c)/ideal - 1; d > 0.10 || d < -0.10 {
			t.Errorf("node %s holds %d copies, %.1f %% off the ideal %.0f", id, c, 100*d, ideal)
		}
		if b, old := before[id]; old && c > b {
			t.Errorf("old node %s went from %d to %d copies: copies moved between old nodes", id, b, c)
		}
	}
	t.Logf("copies before %v, after %v (node 4 is %s)", before, after, n1ID(t, n4))
}

// TestClusterDeleteWhileAway: a VDI deleted while a node was down stays
// deleted when the node returns: its objects on that node are removed,
// never pulled back onto the others, and nothing of it leaks.
func TestClusterDeleteWhileAway(t *testing.T) {
	nodes := startCluster(t, 3, "")
	n1, n3 := nodes[0], nodes[2]
	dir := t.TempDir()
	n1.mustAdmin(t, "cluster", "format", "--copies", "3")
	n1.mustAdmin(t, "vdi", "create", "old", "16M")
	n1.mustAdmin(t, "vdi", "create", "kept", "16M")
	// "old" is written through node 3, whose lock on it goes with it.
	for _, w := range [][2]string{{n3.nbd, "old"}, {n1.nbd, "kept"}} {
		if r := runQemuIO(t, dir, "-f", "raw", "nbd://"+w[0]+"/"+w[1], "-c", "write -P 0x33 0 16M"); r.code != 0 || strings.Contains(r.stdout, "failed") {
			t.Fatalf("qemu-io: %s%s", r.stdout, r.stderr)
		}
	}
	n3.kill(syscall.SIGKILL)
	waitRecovered(t, n1, 2)
	n1.mustAdmin(t, "vdi", "delete", "old")
	n3 = restartClusterNode(t, n3.dir, n1.etcd, n3.addr)
	waitRecovered(t, n1, 3)
	// "kept" has 4 objects of 4 MiB, on all three nodes; "old" nothing.
	waitUntil(t, 20*time.Second, func() (bool, string) {
		got := nodeObjects(t, n1)
		for _, c := range got {
			if c != 4 {
				return false, fmt.Sprint(got)
			}
		}
		return len(got) == 3, fmt.Sprint(got)
	})
	checkAll(t, n1, "after the node that missed the delete came back")
	mustQemuIO(t, dir, "kept reads back wrong", "-f", "raw", "nbd://"+n1.nbd+"/kept", "-c", "read -P 0x33 0 16M")
	if r := n1.admin(t, "vdi", "read", "old", "0", "512"); r.code == 0 {
		t.Errorf("the deleted VDI reads: %q", r.stdout)
	}
}

// TestClusterStrict: a cluster formatted --strict refuses writes while
// fewer nodes are live than the copies, and takes them again once the
// node is back; reads go on throughout.
func TestClusterStrict(t *testing.T) {
	nodes := startCluster(t, 3, "")
	n1, n3 := nodes[0], nodes[2]
	dir := t.TempDir()
	if r := n1.mustAdmin(t, "cluster", "format", "--copies", "3", "--strict"); !strings.Contains(r.stdout, "strict") {
		t.Errorf("format --strict does not say so: %s", r.stdout)
	}
	n1.mustAdmin(t, "vdi", "create", "disk0", "8M")
	url := "nbd://" + n1.nbd + "/disk0"
	mustQemuIO(t, dir, "qemu-io", "-f", "raw", url, "-c", "write -P 0x44 0 8M")
	n3.kill(syscall.SIGKILL)
	waitRecovered(t, n1, 2)
	r := runQemuIO(t, dir, "-f", "raw", url, "-c", "write -P 0x55 0 4k")
	if r.code == 0 && !strings.Contains(r.stdout+r.stderr, "failed") {
		t.Errorf("a strict cluster with 2 of 3 nodes took a write: %s", r.stdout)
	}
	if r := runQemuIO(t, dir, "-f", "raw", url, "-c", "read -P 0x44 0 8M"); r.code != 0 || strings.Contains(r.stdout, "fail") {
		t.Errorf("reads with 2 of 3 nodes: %s%s", r.stdout, r.stderr)
	}
	restartClusterNode(t, n3.dir, n1.etcd, n3.addr)
	waitRecovered(t, n1, 3)
	if r := runQemuIO(t, dir, "-f", "raw", url, "-c", "write -P 0x55 0 4k", "-c", "read -P 0x55 0 4k", "-c", "read -P 0x44 4k 4k"); r.code != 0 || strings.Contains(r.stdout, "fail") {
		t.Errorf("a write once the node is back: %s%s", r.stdout, r.stderr)
	}
	checkAll(t, n1, "after the strict cluster got its node back")
}

// TestClusterRecoveryPauseAndRate: recovery paused on every node leaves
// the lost node's copies pending while the VDI stays readable and
// writable (what a request touches is recovered on demand); resumed,
// and throttled, it completes; the settings show in `node recovery`.
func TestClusterRecoveryPauseAndRate(t *testing.T) {
	nodes := startCluster(t, 4, "")
	n1, n4 := nodes[0], nodes[3]
	dir := t.TempDir()
	n1.mustAdmin(t, "cluster", "format", "--copies", "3")
	n1.mustAdmin(t, "vdi", "create", "disk0", "64M")
	url := "nbd://" + n1.nbd + "/disk0"
	mustQemuIO(t, dir, "qemu-io", "-f", "raw", url, "-c", "write -P 0x66 0 64M")
	for _, n := range nodes[:3] {
		if r := n.mustAdmin(t, "node", "recovery", "--pause", "--max-rate", "8M"); !strings.Contains(r.stdout, "8 MiB/s") {
			t.Errorf("node recovery does not show the rate: %s", r.stdout)
		}
	}
	n4.kill(syscall.SIGKILL)
	// Nothing talks to node 4, so its lease ends it; then every node
	// lists what it lacks, and pulls nothing.
	pending := 0
	waitUntil(t, 30*time.Second, func() (bool, string) {
		pending = 0
		var out string
		for _, n := range nodes[:3] {
			var st struct {
				Epoch   uint64 `json:"epoch"`
				Pending int    `json:"pending"`
				Paused  bool   `json:"paused"`
				Listed  bool   `json:"listed"`
			}
			r := n.mustAdminJSON(t, &st, "node", "recovery")
			if !st.Paused {
				t.Fatalf("node recovery says not paused: %s", r.stdout)
			}
			out += r.stdout
			if !st.Listed || st.Epoch < 5 {
				return false, out
			}
			pending += st.Pending
		}
		return true, out
	})
	time.Sleep(500 * time.Millisecond)
	if pending == 0 {
		t.Errorf("with recovery paused on every node, nothing is pending after a node was lost")
	}
	// The VDI works meanwhile: what these touch is recovered on demand.
	if r := runQemuIO(t, dir, "-f", "raw", url, "-c", "write -P 0x77 8M 4k", "-c", "read -P 0x66 0 8M", "-c", "read -P 0x77 8M 4k"); r.code != 0 || strings.Contains(r.stdout, "fail") {
		t.Fatalf("I/O while recovery is paused: %s%s\nnode 1:\n%s\nnode 2:\n%s", r.stdout, r.stderr, n1.stderr, nodes[1].stderr)
	}
	start := time.Now()
	for _, n := range nodes[:3] {
		n.mustAdmin(t, "node", "recovery", "--resume")
	}
	waitRecovered(t, n1, 3)
	took := time.Since(start)
	t.Logf("%d objects pending while paused; after resuming at 8 MiB/s, recovery took %v", pending, took.Round(time.Millisecond))
	// Each node pulls at most 8 MiB/s, and there was more than that to
	// pull on at least one node.
	if took < 500*time.Millisecond {
		t.Errorf("recovery throttled to 8 MiB/s took only %v", took)
	}
	checkAll(t, n1, "after the paused recovery was resumed")
}

// TestClusterPowerLoss: every node of a cluster (on Debian's etcd, three
// members) is killed at once, in the middle of writes, and the nodes are
// started again in another order. Every VDI comes back: what a FLUSH or
// a FUA write covered reads back, the copies are identical (cluster
// check), and the VDI takes writes again.
func TestClusterPowerLoss(t *testing.T) {
	etcd := testutil.EtcdEndpoints(testutil.StartEtcd(t, 3))
	nodes := startCluster(t, 3, etcd)
	n1 := nodes[0]
	dir := t.TempDir()
	n1.mustAdmin(t, "cluster", "format", "--copies", "3")
	n1.mustAdmin(t, "vdi", "create", "disk0", "32M")
	url := "nbd://" + n1.nbd + "/disk0"
	// Durable: 16 MiB written and flushed, and 4 KiB FUA writes.
	mustQemuIO(t, dir, "qemu-io", "-f", "raw", url, "-c", "write -P 0x21 0 16M", "-c", "flush", "-c", "write -f -P 0x22 16M 4k", "-c", "write -f -P 0x23 20M 4k")
	// Not durable: plain writes still going on when the power goes.
	wait := startFio(t, dir, "--name=tail", "--ioengine=nbd", "--uri="+url, "--rw=randwrite", "--bs=4k", "--iodepth=4",
		"--offset=24M", "--size=8M", "--time_based", "--runtime=30", "--rate_iops=2000")
	time.Sleep(1500 * time.Millisecond)
	for _, n := range nodes {
		n.proc.Signal(syscall.SIGKILL)
	}
	for _, n := range nodes {
		n.kill(syscall.SIGKILL)
	}
	_ = wait // fio fails with the cluster gone; its writes were never flushed
	// Back in reverse order, each at its own port.
	var back []*clusterNode
	for i := len(nodes) - 1; i >= 0; i-- {
		back = append(back, restartClusterNode(t, nodes[i].dir, etcd, nodes[i].addr))
	}
	n3 := back[0]
	waitRecovered(t, n3, 3)
	url = "nbd://" + n3.nbd + "/disk0"
	mustQemuIO(t, dir, "after the power loss, durable writes read back wrong", "-f", "raw", url, "-c", "read -P 0x21 0 16M", "-c", "read -P 0x22 16M 4k", "-c", "read -P 0x23 20M 4k")
	checkAll(t, n3, "after the power loss")
	for _, n := range back {
		for _, l := range strings.Split(n.stderr.String(), "\n") {
			if strings.Contains(l, "suspect") || strings.Contains(l, "recovery done") {
				t.Log(l)
			}
		}
	}
	mustQemuIO(t, dir, "writes after the power loss", "-f", "raw", url, "-c", "write -P 0x24 24M 1M", "-c", "read -P 0x24 24M 1M")
}

// TestClusterCheckRepair: one replica's bytes are damaged behind the
// store's back; cluster check names the object and exits 1;
// check --repair replaces the odd copy with the one the two others
// hold, says so, and exits 0; the data reads back as written.
func TestClusterCheckRepair(t *testing.T) {
	nodes := startCluster(t, 3, "")
	n1, n3 := nodes[0], nodes[2]
	dir := t.TempDir()
	n1.mustAdmin(t, "cluster", "format", "--copies", "3")
	n1.mustAdmin(t, "vdi", "create", "disk0", "8M")
	url := "nbd://" + n1.nbd + "/disk0"
	if r := runQemuIO(t, dir, "-f", "raw", url, "-c", "write -P 0x5c 0 8M", "-c", "flush"); r.code != 0 || strings.Contains(r.stdout, "failed") {
		t.Fatalf("qemu-io: %s%s\nnode 1:\n%s", r.stdout, r.stderr, n1.stderr)
	}
	obj := damageOneObject(t, filepath.Join(n3.dir, "objects"))
	if r := n1.admin(t, "cluster", "check"); r.code != 1 || !strings.Contains(r.stdout, obj) || !strings.Contains(r.stdout, "differ") {
		t.Fatalf("check after damage: exit %d\n%s%s", r.code, r.stdout, r.stderr)
	}
	r := n1.admin(t, "cluster", "check", "--repair")
	if r.code != 0 || !strings.Contains(r.stdout, "repaired: vdi disk0 object "+obj) || !strings.Contains(r.stdout, " 0 problems") {
		t.Fatalf("check --repair: exit %d\n%s%s", r.code, r.stdout, r.stderr)
	}
	t.Log(r.stdout)
	checkAll(t, n1, "after the repair")
	// Every copy holds the bytes written: read through each node.
	for _, n := range nodes {
		if r := runQemuIO(t, dir, "-f", "raw", "nbd://"+n.nbd+"/disk0", "-r", "-c", "read -P 0x5c 0 8M"); r.code != 0 || strings.Contains(r.stdout, "fail") {
			t.Errorf("read through %s after the repair: %s%s\nits log:\n%s", n.addr, r.stdout, r.stderr, n.stderr)
		}
	}
}

// objectFiles counts the object files (copies and tombstones) under a
// node's store.
func objectFiles(t *testing.T, n *clusterNode) int {
	t.Helper()
	files, _ := filepath.Glob(filepath.Join(n.dir, "objects", "objects", "*", "*"))
	return len(files)
}

// TestClusterTrimWhileAway: objects trimmed while a node was down stay
// trimmed when it returns with its old copies: the tombstones win over
// them (they carry a later epoch), the node's copies become tombstones,
// and once every node has seen the trim the tombstones are forgotten,
// so nothing of the trimmed objects is left on any disk.
func TestClusterTrimWhileAway(t *testing.T) {
	nodes := startCluster(t, 3, "")
	n1, n3 := nodes[0], nodes[2]
	dir := t.TempDir()
	n1.mustAdmin(t, "cluster", "format", "--copies", "3")
	n1.mustAdmin(t, "vdi", "create", "disk0", "16M")
	url := "nbd://" + n1.nbd + "/disk0"
	mustQemuIO(t, dir, "qemu-io", "-f", "raw", url, "-c", "write -P 0x3d 0 16M", "-c", "flush")
	n3.kill(syscall.SIGKILL)
	waitRecovered(t, n1, 2)
	mustQemuIO(t, dir, "qemu-io discard", "-f", "raw", url, "-c", "discard 0 8M", "-c", "flush")
	if got := objectFiles(t, n3); got != 4 {
		t.Fatalf("node 3 holds %d object files while away, want its 4 old copies", got)
	}
	restartClusterNode(t, n3.dir, n1.etcd, n3.addr)
	waitRecovered(t, n1, 3)
	mustQemuIO(t, dir, "after the node that missed the trim returned", "-f", "raw", url, "-c", "read -P 0 0 8M", "-c", "read -P 0x3d 8M 8M")
	checkAll(t, n1, "after the node that missed the trim returned")
	// Each node ends with the 2 objects left and no tombstone.
	waitUntil(t, 20*time.Second, func() (bool, string) {
		var got []int
		ok := true
		for _, n := range nodes {
			c := objectFiles(t, n)
			got = append(got, c)
			ok = ok && c == 2
		}
		return ok, fmt.Sprint("object files per node: ", got)
	})
}

// TestClusterFullDisk: one node's store sits on a 40 MiB file system
// with 16 MiB reserved. Writes that it cannot take fail with ENOSPC at
// the client and are never acknowledged with its copy missing; node list
// says the node is full; the writes that were acknowledged read back.
func TestClusterFullDisk(t *testing.T) {
	base := t.TempDir()
	small := filepath.Join(base, "small")
	if err := os.MkdirAll(small, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Mount("tmpfs", small, "tmpfs", 0, "size=40m"); err != nil {
		t.Fatalf("mounting a small tmpfs for the full node (the suite runs as root): %v", err)
	}
	t.Cleanup(func() { syscall.Unmount(small, syscall.MNT_DETACH) })
	n1 := startClusterNode(t, filepath.Join(base, "n1"), "")
	n2 := startClusterNode(t, filepath.Join(base, "n2"), n1.etcd)
	n3 := startClusterNode(t, small, n1.etcd, "--reserve", "16M")
	waitRecovered(t, n1, 3)
	dir := t.TempDir()
	n1.mustAdmin(t, "cluster", "format", "--copies", "3")
	n1.mustAdmin(t, "vdi", "create", "disk0", "64M")
	var cmds []string
	for i := range 16 {
		cmds = append(cmds, "-c", fmt.Sprintf("write -P 0x%02x %dM 4M", 0x40+i, 4*i))
	}
	r := runQemuIO(t, dir, append([]string{"-f", "raw", "nbd://" + n1.nbd + "/disk0"}, cmds...)...)
	okWrites := strings.Count(r.stdout, "wrote 4194304/4194304")
	failed := strings.Count(r.stdout+r.stderr, "No space left on device")
	t.Logf("%d writes acknowledged, %d refused with ENOSPC", okWrites, failed)
	if okWrites == 0 || failed == 0 || okWrites+failed != 16 {
		t.Fatalf("want some writes acknowledged and the rest refused with ENOSPC:\n%s%s", r.stdout, r.stderr)
	}
	// Acknowledged writes are whole, on every copy: read each back
	// through another node.
	var reads []string
	for i := range 16 {
		reads = append(reads, "-c", fmt.Sprintf("read -P 0x%02x %dM 4M", 0x40+i, 4*i))
	}
	rr := runQemuIO(t, dir, append([]string{"-r", "-f", "raw", "nbd://" + n2.nbd + "/disk0"}, reads...)...)
	if got := strings.Count(rr.stdout, "read 4194304/4194304"); got < okWrites || strings.Count(rr.stdout, "Pattern verification failed") > failed {
		t.Errorf("of %d acknowledged writes, %d read back:\n%s", okWrites, got, rr.stdout)
	}
	var list []struct {
		ID    string `json:"id"`
		State string `json:"state"`
	}
	lr := n1.mustAdminJSON(t, &list, "node", "list")
	full := 0
	for _, n := range list {
		if n.State == "full" {
			full++
		}
	}
	if full != 1 {
		t.Errorf("node list shows %d full nodes, want 1 (node 3):\n%s", full, lr.stdout)
	}
	if !strings.Contains(lr.stdout, n1ID(t, n3)) {
		t.Errorf("node list does not list node 3: %s", lr.stdout)
	}
}
