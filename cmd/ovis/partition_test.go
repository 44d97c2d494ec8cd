package main

import (
	"fmt"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/ovis-storage/ovis/internal/netns"
	"github.com/ovis-storage/ovis/internal/testutil"
)

// TestClusterPartition is issue 18's partition test. Four nodes, each
// in its own network namespace, copies 3, on a three-member etcd in the
// root namespace. Node 1 serves two VDIs to two qemu-io clients in its
// namespace; both wrote 0x11 before. Node 1's namespace is then cut off
// from everything (its veth down), and both clients write 0x22 at once:
// over data they wrote (offset 0) and into a part never written (8M, a
// new object). Node 1 applies the writes to its own copies, but cannot
// acknowledge them.
//
// While node 1 is away, the other nodes go on without it (its lease runs
// out). A new owner opens disk0 through node 2: it reads 0x11 and
// zeros, the last acknowledged data, and writes 0x33 at 16M; disk1 is
// left alone.
//
// After the heal, node 1 rejoins by itself. disk0's client's writes fail
// (another owner took the VDI: they were never acknowledged); disk1's
// complete (nobody took it: node 1 takes its lock again and its client
// goes on). Then, through every node: disk0 holds 0x11, zeros and 0x33
// (node 1's unacknowledged copies lost to the nodes that went on: no
// split brain), disk1 holds 0x22; cluster check finds every copy equal.
func TestClusterPartition(t *testing.T) {
	nt, nodes := startNetnsCluster(t, 4)
	n1, n2 := nodes[0], nodes[1]
	dir := t.TempDir()

	n2.mustAdmin(t, "cluster", "format", "--copies", "3")
	n2.mustAdmin(t, "vdi", "create", "disk0", "32M")
	n2.mustAdmin(t, "vdi", "create", "disk1", "32M")

	in1 := func(name string, args ...string) *exec.Cmd { return nt.Cmd(0, name, args...) }
	// Two clients of each VDI, one per write, so that neither write
	// waits for the other.
	var clients [2][2]*qemuIO
	for v := range clients {
		for w := range clients[v] {
			c := startQemuIOCmd(t, in1, fmt.Sprintf("nbd://%s/disk%d", n1.nbd, v))
			if w == 0 {
				c.do("write -P 0x11 0 64k", "wrote")
				c.do("", "ops;") // the write's second line
			}
			clients[v][w] = c
		}
	}

	if err := nt.Cut(0); err != nil {
		t.Fatal(err)
	}
	cut := time.Now()
	for v := range clients {
		fmt.Fprintln(clients[v][0].in, "write -P 0x22 0 64k")
		fmt.Fprintln(clients[v][1].in, "write -P 0x22 8M 64k")
	}
	// The others drop node 1 when its lease runs out.
	waitUntil(t, 30*time.Second, func() (bool, string) {
		r := n2.admin(t, "node", "list")
		return r.code == 0 && !strings.Contains(r.stdout, n1.addr), r.stdout + r.stderr
	})
	t.Logf("node 1 left the membership %v after the cut", time.Since(cut).Round(100*time.Millisecond))
	for v := range clients {
		for _, c := range clients[v] {
			select {
			case l := <-c.lines:
				t.Fatalf("a client of the cut-off node got an answer: %s", l)
			default:
			}
		}
	}
	url0 := "nbd://" + n2.nbd + "/disk0"
	mustQemuIO(t, dir, "the new owner of disk0 does not read the last acknowledged data", "-f", "raw", url0,
		"-c", "read -P 0x11 0 64k", "-c", "read -P 0 8M 64k", "-c", "write -P 0x33 16M 64k")

	if err := nt.Heal(0); err != nil {
		t.Fatal(err)
	}
	healed := time.Now()
	waitUntil(t, 60*time.Second, func() (bool, string) {
		e := n1.stderr.String()
		return strings.Contains(e, "rejoined the membership"), e
	})
	t.Logf("node 1 rejoined %v after the heal", time.Since(healed).Round(100*time.Millisecond))
	// disk0's clients: both writes fail. disk1's: both complete.
	for v, want := range []string{"failed", "wrote"} {
		for _, c := range clients[v] {
			select {
			case l, ok := <-c.lines:
				if !ok {
					t.Fatal("qemu-io ended")
				}
				if !strings.Contains(l, want) {
					t.Fatalf("after the heal a client of disk%d on node 1 printed %q, want %q", v, l, want)
				}
			case <-time.After(60 * time.Second):
				t.Fatalf("after the heal, a write of disk%d neither failed nor succeeded in 60 s", v)
			}
		}
	}
	waitRecovered(t, n2, 4)
	for i, n := range nodes {
		mustQemuIO(t, dir, fmt.Sprintf("disk0 through node %d after the heal", i+1), "-f", "raw", "-r", "nbd://"+n.nbd+"/disk0",
			"-c", "read -P 0x11 0 64k", "-c", "read -P 0 8M 64k", "-c", "read -P 0x33 16M 64k")
		mustQemuIO(t, dir, fmt.Sprintf("disk1 through node %d after the heal", i+1), "-f", "raw", "-r", "nbd://"+n.nbd+"/disk1",
			"-c", "read -P 0x22 0 64k", "-c", "read -P 0x22 8M 64k")
	}
	checkAll(t, n2, "after the heal")
}

// TestClusterCutOffNode (issue 27, a node that reaches etcd but not its
// peers): four nodes, each in its own network namespace, copies 3, on
// a three-member etcd in the root namespace. Node 4's links to the
// other nodes fail (blackhole routes: its packets to them are dropped),
// while it still reaches etcd and so keeps its lease. Writes through
// node 1 to every object of a VDI, some placed on node 4, go on without
// an error: node 4 leaves the epoch by itself within seconds, and the
// others write without it. Once its links work again it rejoins, and
// every copy agrees.
func TestClusterCutOffNode(t *testing.T) {
	nt, nodes := startNetnsCluster(t, 4)
	n1, n4 := nodes[0], nodes[3]
	n1.mustAdmin(t, "cluster", "format", "--copies", "3")
	n1.mustAdmin(t, "vdi", "create", "disk0", "64M")
	in1 := func(name string, args ...string) *exec.Cmd { return nt.Cmd(0, name, args...) }
	writeAll := func(pattern int) string {
		args := []string{"-f", "raw", "nbd://" + n1.nbd + "/disk0"}
		for i := range 16 {
			args = append(args, "-c", fmt.Sprintf("write -P 0x%02x %dM 64k", pattern, 4*i))
		}
		out, err := in1("qemu-io", args...).CombinedOutput()
		if err != nil || strings.Contains(string(out), "failed") {
			t.Fatalf("writes through node 1: %v\n%s", err, out)
		}
		return string(out)
	}
	writeAll(0x11)

	if err := nt.CutPeers(3); err != nil {
		t.Fatal(err)
	}
	cut := time.Now()
	writeAll(0x22)
	t.Logf("writes of every object through node 1 took %v with node 4 cut off", time.Since(cut).Round(100*time.Millisecond))
	if !strings.Contains(n4.stderr.String(), "cut off from peers") {
		t.Errorf("node 4 did not say it was cut off:\n%s", n4.stderr.String())
	}
	if r := n1.mustAdmin(t, "node", "list"); strings.Contains(r.stdout, n4.addr) {
		t.Errorf("node list still lists the cut-off node 4:\n%s", r.stdout)
	}

	if err := nt.HealPeers(3); err != nil {
		t.Fatal(err)
	}
	healed := time.Now()
	waitUp(t, n1, 4)
	t.Logf("node 4 back %v after the heal", time.Since(healed).Round(100*time.Millisecond))
	waitRecovered(t, n1, 4)
	for i, n := range nodes {
		args := []string{"-f", "raw", "-r", "nbd://" + n.nbd + "/disk0"}
		for j := range 16 {
			args = append(args, "-c", fmt.Sprintf("read -P 0x22 %dM 64k", 4*j))
		}
		out, err := nt.Cmd(i, "qemu-io", args...).CombinedOutput()
		if err != nil || strings.Contains(string(out), "failed") || strings.Contains(string(out), "verification") {
			t.Fatalf("reads through node %d after the heal: %v\n%s", i+1, err, out)
		}
	}
	checkAll(t, n1, "after the heal")
}

// startNetnsCluster starts n nodes, each in its own network namespace,
// on a three-member etcd in the root namespace.
func startNetnsCluster(t *testing.T, n int) (*netns.Net, []*clusterNode) {
	t.Helper()
	nt := netns.NewT(t, n)
	etcd := testutil.EtcdEndpoints(testutil.StartEtcdOn(t, 3, nt.HostAddr()))
	var nodes []*clusterNode
	for i := range n {
		mk := func(name string, args ...string) *exec.Cmd { return nt.Cmd(i, name, args...) }
		nodes = append(nodes, startClusterNodeCmd(t, mk, nt.Addr(i), t.TempDir()+fmt.Sprintf("/n%d", i+1), etcd))
		waitUp(t, nodes[0], i+1)
	}
	return nt, nodes
}
