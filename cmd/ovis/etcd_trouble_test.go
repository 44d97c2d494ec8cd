package main

import (
	"strings"
	"testing"
	"time"

	"github.com/ovis-storage/ovis/internal/testutil"
)

// TestClusterEtcdTrouble is issue 18's etcd fault test. Three nodes run
// on an external three-member etcd (Debian's etcd-server). fio writes
// with crc32c verification through node 1 while
//
//  1. the etcd leader is killed (the others elect a new one; the leases
//     are kept), and restarted;
//  2. two of the three members are stopped for longer than the nodes'
//     lease, so that etcd has no quorum and every node loses its lease,
//     and then brought back.
//
// I/O stalls while etcd is gone and resumes by itself: fio sees no error
// and everything verifies; no node process exits; every node rejoins
// the membership, node 1 takes disk0's lock again, and cluster check
// finds every object's three copies equal.
func TestClusterEtcdTrouble(t *testing.T) {
	members := testutil.StartEtcd(t, 3)
	etcd := testutil.EtcdEndpoints(members)
	nodes := startCluster(t, 3, etcd)
	n1, n2 := nodes[0], nodes[1]
	dir := t.TempDir()
	n1.mustAdmin(t, "cluster", "format", "--copies", "3")
	n1.mustAdmin(t, "vdi", "create", "disk0", "96M")
	url := "nbd://" + n1.nbd + "/disk0"

	// 1. The leader goes, and comes back.
	wait := startFio(t, dir, fioVerify(url, "0", "16M", false)...)
	time.Sleep(1500 * time.Millisecond)
	leader := testutil.Leader(t, members)
	t.Logf("killing etcd leader %s", leader.Name)
	leader.Stop()
	time.Sleep(3 * time.Second)
	leader.Restart(t)
	wait()
	if got := nodeMetric(t, nodes, "ovis_node_lease_losses_total"); got != 0 {
		t.Errorf("%v lease losses after the leader was killed; a new leader keeps the leases", got)
	}

	// 2. The quorum goes for longer than the lease (5 s), and comes back.
	// 56 MiB at fio's pace takes about 9 s: it spans the trouble.
	wait = startFio(t, dir, fioVerify(url, "16M", "56M", false)...)
	time.Sleep(1500 * time.Millisecond)
	leader = testutil.Leader(t, members)
	var stopped []*testutil.EtcdMember
	for _, m := range members {
		if m != leader && len(stopped) < 2 {
			stopped = append(stopped, m)
		}
	}
	stopped = append(stopped[:1], leader) // the leader and one more
	t.Logf("stopping etcd members %s and %s", stopped[0].Name, stopped[1].Name)
	start := time.Now()
	for _, m := range stopped {
		m.Stop()
	}
	// Every node loses its lease: it says so, and does not exit.
	waitUntil(t, 30*time.Second, func() (bool, string) {
		for _, n := range nodes {
			if !strings.Contains(n.stderr.String(), "lost the membership lease") {
				return false, n.stderr.String()
			}
		}
		return true, ""
	})
	time.Sleep(max(0, 8*time.Second-time.Since(start)))
	for _, m := range stopped {
		m.Restart(t)
	}
	back := time.Now()
	t.Logf("etcd's quorum was gone for %v", back.Sub(start).Round(100*time.Millisecond))
	for i, n := range nodes {
		waitUntil(t, 30*time.Second, func() (bool, string) {
			select {
			case <-n.proc.Exited():
				t.Fatalf("node %d exited:\n%s", i+1, n.stderr.String())
			default:
			}
			return strings.Contains(n.stderr.String(), "rejoined the membership"), n.stderr.String()
		})
	}
	t.Logf("every node rejoined within %v of etcd's restart", time.Since(back).Round(100*time.Millisecond))
	wait()
	if !strings.Contains(n1.stderr.String(), "vdi lock taken again") {
		t.Errorf("node 1 did not take disk0's lock again:\n%s", n1.stderr.String())
	}
	waitRecovered(t, n2, 3)
	// Everything written before and during the trouble reads back
	// through another node, and the copies agree.
	url2 := "nbd://" + n2.nbd + "/disk0"
	for _, part := range [][2]string{{"0", "16M"}, {"16M", "56M"}} {
		startFio(t, dir, fioVerify(url2, part[0], part[1], true)...)()
	}
	checkAll(t, n2, "after etcd came back")
	mustQemuIO(t, dir, "writes after etcd came back", "-f", "raw", url, "-c", "write -P 0x5a 80M 1M", "-c", "read -P 0x5a 80M 1M")
}
