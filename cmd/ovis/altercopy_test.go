package main

import (
	"context"
	"fmt"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// copiesExactly runs cluster check and wants every one of objects with
// exactly copies identical copies: none missing, none extra, none
// differing; and the nodes hold objects × copies between them.
func copiesExactly(t *testing.T, n *clusterNode, objects, copies int, when string) {
	t.Helper()
	want := fmt.Sprintf("%d objects, %d copies compared, 0 problems", objects, objects*copies)
	r := n.admin(t, "cluster", "check")
	if r.code != 0 || !strings.Contains(r.stdout, want) {
		t.Fatalf("%s: cluster check exit %d, want %q:\n%s%s", when, r.code, want, r.stdout, r.stderr)
	}
	total := 0
	held := nodeObjects(t, n)
	for _, c := range held {
		total += c
	}
	if total != objects*copies {
		t.Fatalf("%s: the nodes hold %d copies, want %d (%d objects × %d): %v", when, total, objects*copies, objects, copies, held)
	}
	t.Logf("%s: %s; per node %v", when, want, held)
}

// dumpOnFailure logs every node's stderr at the end of a failed test.
func dumpOnFailure(t *testing.T, nodes []*clusterNode) {
	t.Cleanup(func() {
		if t.Failed() {
			for i, n := range nodes {
				t.Logf("node %d (%s) stderr:\n%s", i+1, n.addr, n.stderr)
			}
		}
	})
}

// vdiCopies is what vdi list says of a VDI's copies.
func vdiCopies(t *testing.T, n *clusterNode, name string) int {
	t.Helper()
	var vs []struct {
		Name   string `json:"name"`
		Copies int    `json:"copies"`
	}
	r := n.mustAdminJSON(t, &vs, "vdi", "list")
	for _, v := range vs {
		if v.Name == name {
			return v.Copies
		}
	}
	t.Fatalf("vdi list has no %s: %s", name, r.stdout)
	return 0
}

// TestClusterAlterCopy: four nodes, a VDI of 16 objects with 2 copies.
// While fio writes and verifies through node 2, alter-copy raises the
// copies to 3: no write fails, recovery makes the third copies, and
// check then finds exactly 3 identical copies of every object, the data
// verifies, and vdi list says 3. alter-copy to 1, again under fio
// writes, leaves exactly 1 copy of each object once the extra copies
// are dropped. Values the cluster cannot hold are refused.
func TestClusterAlterCopy(t *testing.T) {
	nodes := startCluster(t, 4, "")
	n1, n2 := nodes[0], nodes[1]
	dumpOnFailure(t, nodes)
	dir := t.TempDir()
	n1.mustAdmin(t, "cluster", "format", "--copies", "2")
	n1.mustAdmin(t, "vdi", "create", "disk0", "64M")
	url := "nbd://" + n2.nbd + "/disk0"
	// Objects fio does not write hold a pattern, so that every object
	// exists before the change.
	mustQemuIO(t, dir, "fill", "-f", "raw", url, "-c", "write -P 0x5a 16M 48M", "-c", "flush")

	for _, bad := range []string{"5", "0", "x"} {
		if r := n1.admin(t, "vdi", "alter-copy", "disk0", bad); r.code == 0 {
			t.Fatalf("alter-copy disk0 %s succeeded on 4 nodes: %s", bad, r.stdout)
		}
	}
	if r := n1.admin(t, "vdi", "alter-copy", "nothere", "2"); r.code == 0 || !strings.Contains(r.stderr, "no such vdi") {
		t.Fatalf("alter-copy of no VDI: exit %d: %s%s", r.code, r.stdout, r.stderr)
	}

	wait := startFio(t, dir, fioVerify(url, "0", "16M", false)...)
	time.Sleep(1500 * time.Millisecond)
	start := time.Now()
	r := n1.mustAdmin(t, "vdi", "alter-copy", "disk0", "3")
	if !strings.Contains(r.stdout, "3 copies") {
		t.Fatalf("alter-copy said: %s", r.stdout)
	}
	wait()
	waitRecovered(t, n1, 4)
	t.Logf("3 copies made %v after alter-copy", time.Since(start).Round(time.Millisecond))
	if got := vdiCopies(t, n1, "disk0"); got != 3 {
		t.Fatalf("vdi list: %d copies after alter-copy to 3", got)
	}
	copiesExactly(t, n1, 16, 3, "after alter-copy to 3")
	startFio(t, dir, fioVerify(url, "0", "16M", true)...)()
	mustQemuIO(t, dir, "pattern after alter-copy to 3", "-f", "raw", url, "-c", "read -P 0x5a 16M 48M")

	wait = startFio(t, dir, fioVerify(url, "16M", "16M", false)...)
	time.Sleep(1500 * time.Millisecond)
	start = time.Now()
	n1.mustAdmin(t, "vdi", "alter-copy", "disk0", "1")
	wait()
	waitRecovered(t, n1, 4)
	t.Logf("down to 1 copy %v after alter-copy", time.Since(start).Round(time.Millisecond))
	if got := vdiCopies(t, n1, "disk0"); got != 1 {
		t.Fatalf("vdi list: %d copies after alter-copy to 1", got)
	}
	// The extra copies go once the remaining holder has recorded the
	// epoch; waitRecovered saw every node clean, so none is left.
	copiesExactly(t, n1, 16, 1, "after alter-copy to 1")
	startFio(t, dir, fioVerify(url, "0", "16M", true)...)()
	startFio(t, dir, fioVerify(url, "16M", "16M", true)...)()
	mustQemuIO(t, dir, "pattern after alter-copy to 1", "-f", "raw", url, "-c", "read -P 0x5a 32M 32M")
}

// TestClusterNodeRemove: node 3 dies for good; objects are trimmed while
// it is away, and their tombstones stay on the others, because node 3
// once recovered and has not seen them, also after a new epoch. node
// remove refuses a live node and an unknown one, then removes node 3:
// the tombstones are forgotten. Node 3
// started again on its old directory is refused, with a message that
// says to start it on an empty one; started so, it joins under a new ID
// and recovery gives it its copies.
func TestClusterNodeRemove(t *testing.T) {
	nodes := startCluster(t, 3, "")
	n1, n2, n3 := nodes[0], nodes[1], nodes[2]
	dir := t.TempDir()
	n1.mustAdmin(t, "cluster", "format", "--copies", "2")
	n1.mustAdmin(t, "vdi", "create", "disk0", "16M")
	n1.mustAdmin(t, "vdi", "create", "other", "16M")
	url := "nbd://" + n1.nbd + "/disk0"
	mustQemuIO(t, dir, "fill", "-f", "raw", url, "-c", "write -P 0x3d 0 16M", "-c", "flush")
	waitRecovered(t, n1, 3)
	id3 := n1ID(t, n3)
	n3.kill(syscall.SIGKILL)
	waitRecovered(t, n1, 2)
	mustQemuIO(t, dir, "discard", "-f", "raw", url, "-c", "discard 0 8M", "-c", "flush")

	// 4 objects, 2 copies each on the 2 nodes left: each holds 2 live
	// objects and the 2 tombstones of the trimmed ones, which must wait
	// for node 3.
	files := func() []int {
		return []int{objectFiles(t, n1), objectFiles(t, n2)}
	}
	// A new epoch (alter-copy of another VDI) makes the nodes left
	// clean past the tombstones; they still wait for node 3.
	n1.mustAdmin(t, "vdi", "alter-copy", "other", "1")
	waitRecovered(t, n1, 2)
	time.Sleep(2 * time.Second)
	if got := files(); got[0] != 4 || got[1] != 4 {
		t.Fatalf("object files on nodes 1 and 2 while node 3 is away: %v, want 4 each (2 objects, 2 tombstones)", got)
	}

	if r := n1.admin(t, "node", "remove", n1ID(t, n2)); r.code == 0 || !strings.Contains(r.stderr, "live") || !strings.Contains(r.stderr, n2.addr) {
		t.Fatalf("node remove of a live node: exit %d: %s%s", r.code, r.stdout, r.stderr)
	}
	if r := n1.admin(t, "node", "remove", "no-such-node"); r.code == 0 || !strings.Contains(r.stderr, "no such node") {
		t.Fatalf("node remove of an unknown node: exit %d: %s%s", r.code, r.stdout, r.stderr)
	}
	removed := time.Now()
	n1.mustAdmin(t, "node", "remove", id3)
	waitUntil(t, 30*time.Second, func() (bool, string) {
		got := files()
		return got[0] == 2 && got[1] == 2, fmt.Sprint("object files on nodes 1 and 2: ", got)
	})
	t.Logf("tombstones forgotten %v after node remove", time.Since(removed).Round(time.Millisecond))
	mustQemuIO(t, dir, "after node remove", "-f", "raw", url, "-c", "read -P 0 0 8M", "-c", "read -P 0x3d 8M 8M")

	// Back on its old directory, with its old copies: refused.
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, serverBin, "node", "--dir", n3.dir, "--etcd", n1.etcd, "--listen", "127.0.0.1:0", "--log-level", "none")
	out, err := cmd.CombinedOutput()
	if err == nil || !strings.Contains(string(out), "removed") || !strings.Contains(string(out), "empty data directory") || !strings.Contains(string(out), id3) {
		t.Fatalf("removed node restarted on its directory: %v, want a refusal naming it and what to do:\n%s", err, out)
	}
	t.Logf("restart refused: %s", strings.TrimSpace(string(out)))
	if objs := nodeObjects(t, n1); len(objs) != 2 {
		t.Fatalf("the refused node is listed: %v", objs)
	}

	// On an empty directory it is a new node.
	n3 = startClusterNode(t, filepath.Join(t.TempDir(), "n3-new"), n1.etcd)
	if id := n1ID(t, n3); id == id3 {
		t.Fatalf("the node on an empty directory took the removed ID %s", id)
	}
	waitRecovered(t, n1, 3)
	copiesExactly(t, n1, 2, 2, "after a new node joined")
}
