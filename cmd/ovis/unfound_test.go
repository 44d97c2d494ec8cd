package main

import (
	"encoding/json"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ovis-storage/ovis/cluster/object"
	"github.com/ovis-storage/ovis/internal/testutil"
)

// unfoundBlocks is the reproduction's data: 64 blocks of 4 KiB, one in
// each of 64 objects of 4 MiB (every other object of a 512 MiB VDI), block
// i filled with the byte i+1.
const unfoundBlocks = 64

func unfoundBlock(i int) (off int64, pattern int) { return int64(i) * 8 << 20, i + 1 }

// qemuIOBlocks returns qemu-io's commands that write (with FUA) or read
// and verify every block of the reproduction.
func qemuIOBlocks(verb string) []string {
	var args []string
	for i := range unfoundBlocks {
		off, p := unfoundBlock(i)
		flag := ""
		if verb == "write" {
			flag = "-f "
		}
		args = append(args, "-c", fmt.Sprintf("%s %s-P %d %d 4k", verb, flag, p, off))
	}
	return args
}

// readAllBlocks reads every block through the node's gateway and fails
// the test, naming the blocks that read wrong, unless all 64 are intact.
func readAllBlocks(t *testing.T, dir string, n *clusterNode, when string) {
	t.Helper()
	args := append([]string{"-r", "-f", "raw", "nbd://" + n.nbd + "/disk0"}, qemuIOBlocks("read")...)
	r := runQemuIO(t, dir, args...)
	if bad := strings.Count(r.stdout, "Pattern verification failed") + strings.Count(r.stdout, "failed"); r.code != 0 || bad > 0 {
		t.Fatalf("%s: through %s, %d of %d blocks read wrong (exit %d):\n%s%s", when, n.addr, bad, unfoundBlocks, r.code, r.stdout, r.stderr)
	}
}

// unfoundOn returns how many objects node n's recovery reports unfound,
// and the nodes it says they may be on.
func unfoundOn(t *testing.T, n *clusterNode) (int, []string) {
	t.Helper()
	r := n.admin(t, "node", "list", "--output", "json")
	var ns []struct {
		ID       string `json:"id"`
		State    string `json:"state"`
		Recovery struct {
			Unfound   int      `json:"unfound"`
			UnfoundOn []string `json:"unfound_on"`
		} `json:"recovery"`
	}
	if err := json.Unmarshal([]byte(r.stdout), &ns); err != nil {
		return 0, nil
	}
	total, on := 0, map[string]bool{}
	for _, x := range ns {
		total += x.Recovery.Unfound
		for _, id := range x.Recovery.UnfoundOn {
			on[id] = true
		}
	}
	var ids []string
	for id := range on {
		ids = append(ids, id)
	}
	return total, ids
}

// startBlockReader reads every block through n in the background, while
// the holders are away: reads of an unfound object must wait (and then
// succeed once a holder is back), never return zeros. wait fails the
// test unless all 64 blocks read back intact within limit.
func startBlockReader(t *testing.T, dir string, n *clusterNode, limit time.Duration) (wait func()) {
	t.Helper()
	waitCmd := startCmd(t, dir, limit, "qemu-io", append([]string{"-r", "-f", "raw", "nbd://" + n.nbd + "/disk0"}, qemuIOBlocks("read")...)...)
	return func() {
		t.Helper()
		o, took, err := waitCmd()
		if err != nil || strings.Contains(o, "failed") {
			t.Fatalf("reads during the outage (through %s): %v\n%s", n.addr, err, o)
		}
		t.Logf("64 blocks read through %s during the outage: all intact, in %v", n.addr, took.Round(100*time.Millisecond))
	}
}

// TestClusterAllHoldersAway is issue 26's reproduction, with real
// processes on Debian's etcd and a 2 s lease. Four nodes, copies 3, a
// 512 MiB VDI; 64 blocks of 4 KiB, one in each of 64 objects, written
// with FUA and read back.
//
//  1. Every node is SIGKILLed and started again one at a time, each
//     stagger apart (OVIS_UNFOUND_STAGGER, 3 s by default: longer than
//     the lease). While the first node is back alone, the objects it
//     lacks are unfound there: node list and cluster check (exit 1) say
//     so, and reads through it wait instead of returning zeros; they end
//     intact once the holders are back.
//  2. Three of the four nodes are SIGKILLed, every holder of some
//     objects, while the fourth serves; they come back one at a time.
//
// After each, every block reads back through every node, cluster check
// is clean, and each node's log has no "dropping a copy the nodes that
// went on never had". Before ovis knew unfound objects, 17 of 64 blocks
// read as zeros after step 1.
func TestClusterAllHoldersAway(t *testing.T) {
	stagger := 3 * time.Second
	if s := os.Getenv("OVIS_UNFOUND_STAGGER"); s != "" {
		d, err := time.ParseDuration(s)
		if err != nil {
			t.Fatalf("OVIS_UNFOUND_STAGGER: %v", err)
		}
		stagger = d
	}
	rounds := 1
	if s := os.Getenv("OVIS_UNFOUND_ROUNDS"); s != "" {
		var err error
		if rounds, err = strconv.Atoi(s); err != nil {
			t.Fatalf("OVIS_UNFOUND_ROUNDS: %v", err)
		}
	}
	etcd := testutil.EtcdEndpoints(testutil.StartEtcd(t, 1))
	base := t.TempDir()
	// Requests wait through the whole outage: the holders are back
	// within 3 staggers.
	ioTimeout := max(30*time.Second, 4*stagger)
	lease := []string{"--lease", "2s", "--io-timeout", ioTimeout.String()}
	nodes := make([]*clusterNode, 4)
	for i := range nodes {
		nodes[i] = startClusterNode(t, filepath.Join(base, fmt.Sprintf("n%d", i+1)), etcd, lease...)
	}
	waitUp(t, nodes[0], 4)
	dir := t.TempDir()
	nodes[0].mustAdmin(t, "cluster", "format", "--copies", "3")
	nodes[0].mustAdmin(t, "vdi", "create", "disk0", "512M")
	mustQemuIO(t, dir, "writing the blocks", append([]string{"-f", "raw", "nbd://" + nodes[0].nbd + "/disk0"}, append(qemuIOBlocks("write"), "-c", "flush")...)...)
	readAllBlocks(t, dir, nodes[0], "after writing")

	restart := func(n *clusterNode) *clusterNode {
		return restartClusterNode(t, n.dir, etcd, n.addr, lease...)
	}
	// awayThenBack kills the nodes of down (the others keep serving),
	// starts them again one at a time, stagger apart, and checks what the
	// cluster says and serves meanwhile through first, the first node
	// up once every one of down is dead (one of down when all go).
	awayThenBack := func(when string, down []int) {
		t.Helper()
		for _, i := range down {
			nodes[i].kill(syscall.SIGKILL)
		}
		var first *clusterNode
		rest := down
		if len(down) == len(nodes) {
			nodes[down[0]] = restart(nodes[down[0]])
			first, rest = nodes[down[0]], down[1:]
		} else {
			for i := range nodes {
				if !slices.Contains(down, i) {
					first = nodes[i]
					break
				}
			}
		}
		// Alone (or with the nodes that stayed), once the lease of the
		// dead has run out, the first node lacks what only they hold.
		var unfound int
		var on []string
		waitUntil(t, 30*time.Second, func() (bool, string) {
			unfound, on = unfoundOn(t, first)
			return unfound > 0, fmt.Sprintf("no unfound objects reported through %s", first.addr)
		})
		t.Logf("%s: %d objects unfound, which may be on %v", when, unfound, on)
		// Only written objects (the even ones) can be unfound: the
		// allocation map says the others never held data.
		for _, o := range unfoundObjects(t, first) {
			id, err := object.Parse(o)
			if err != nil {
				t.Fatal(err)
			}
			if id.Index()%2 != 0 {
				t.Fatalf("%s: object %s, never written, is reported unfound", when, o)
			}
		}
		if r := first.admin(t, "cluster", "check"); r.code != 1 || !strings.Contains(r.stdout, "unfound") {
			t.Fatalf("%s: cluster check with objects unfound: exit %d, want 1 naming them\n%s%s", when, r.code, r.stdout, r.stderr)
		} else {
			t.Logf("%s: cluster check exit 1:\n%s", when, firstLines(r.stdout, 4))
		}
		if r := first.mustAdmin(t, "cluster", "info"); !strings.Contains(r.stdout, "UNFOUND") {
			t.Fatalf("%s: cluster info does not say objects are unfound:\n%s", when, r.stdout)
		}
		if m := nodeMetric(t, []*clusterNode{first}, "ovis_recovery_unfound_objects"); m == 0 {
			t.Fatalf("%s: ovis_recovery_unfound_objects is 0 with %d objects unfound", when, unfound)
		}
		wait := startBlockReader(t, dir, first, ioTimeout+time.Minute)
		for _, i := range rest {
			time.Sleep(stagger)
			nodes[i] = restart(nodes[i])
		}
		wait()
		waitRecovered(t, first, len(nodes))
		for _, n := range nodes {
			readAllBlocks(t, dir, n, when)
		}
		checkAll(t, first, when)
		for _, n := range nodes {
			if strings.Contains(n.stderr.String(), "dropping a copy the nodes that went on never had") {
				t.Fatalf("%s: node %s dropped a copy:\n%s", when, n.addr, n.stderr)
			}
		}
	}
	for round := range rounds {
		awayThenBack(fmt.Sprintf("round %d: every node killed, back %v apart", round, stagger), []int{0, 1, 2, 3})
		awayThenBack(fmt.Sprintf("round %d: three of four killed, back %v apart", round, stagger), []int{1, 2, 3})
	}
}

// unfoundObjects returns the unfound objects the nodes name through n
// (at most 32 each).
func unfoundObjects(t *testing.T, n *clusterNode) []string {
	t.Helper()
	var ns []struct {
		Recovery struct {
			UnfoundObjects []string `json:"unfound_objects"`
		} `json:"recovery"`
	}
	r := n.admin(t, "node", "list", "--output", "json")
	if err := json.Unmarshal([]byte(r.stdout), &ns); err != nil {
		t.Fatalf("node list --output json: %v\n%s%s", err, r.stdout, r.stderr)
	}
	var out []string
	for _, x := range ns {
		out = append(out, x.Recovery.UnfoundObjects...)
	}
	return out
}

func firstLines(s string, n int) string {
	l := strings.SplitN(s, "\n", n+1)
	return strings.Join(l[:min(n, len(l))], "\n")
}

// TestClusterMarkLost: three of four nodes die for good while the
// fourth serves (copies 3). The objects only they held are unfound: a
// read of one waits --io-timeout (3 s here) and fails with EIO, never
// zeros. mark-lost refuses without an object, gives one object up by
// name, then the rest with --all-unfound, printing each; the node's
// recovery then completes, the given-up blocks read as zeros and the
// others intact. When one of the dead nodes returns after all, its copies
// of the given-up objects do not come back.
func TestClusterMarkLost(t *testing.T) {
	etcd := testutil.EtcdEndpoints(testutil.StartEtcd(t, 1))
	base := t.TempDir()
	lease := []string{"--lease", "2s"}
	nodes := make([]*clusterNode, 4)
	for i := range nodes {
		extra := lease
		if i == 0 {
			extra = append(extra, "--io-timeout", "3s")
		}
		nodes[i] = startClusterNode(t, filepath.Join(base, fmt.Sprintf("n%d", i+1)), etcd, extra...)
	}
	waitUp(t, nodes[0], 4)
	dir := t.TempDir()
	n1 := nodes[0]
	n1.mustAdmin(t, "cluster", "format", "--copies", "3")
	n1.mustAdmin(t, "vdi", "create", "disk0", "512M")
	mustQemuIO(t, dir, "writing the blocks", append([]string{"-f", "raw", "nbd://" + n1.nbd + "/disk0"}, append(qemuIOBlocks("write"), "-c", "flush")...)...)
	for _, n := range nodes[1:] {
		n.kill(syscall.SIGKILL)
	}
	// The written objects whose every copy was on the dead nodes.
	var written []int
	waitUntil(t, 30*time.Second, func() (bool, string) {
		var rep struct {
			Problems []struct {
				Object string `json:"object"`
				Kind   string `json:"kind"`
			} `json:"problems"`
		}
		r := n1.admin(t, "cluster", "check", "--output", "json")
		if err := json.Unmarshal([]byte(r.stdout), &rep); err != nil {
			return false, r.stdout + r.stderr
		}
		written = written[:0]
		for _, p := range rep.Problems {
			if p.Kind != "unfound" || len(p.Object) != 16 {
				continue // or the line counting those not named
			}
			idx, err := strconv.ParseUint(p.Object[8:], 16, 32)
			if err == nil && idx%2 == 0 {
				written = append(written, int(idx/2))
			}
		}
		return r.code == 1 && len(written) > 0, r.stdout + r.stderr
	})
	t.Logf("blocks whose every copy is away (some of them): %v", written)
	off, p := unfoundBlock(written[0])
	start := time.Now()
	r := runQemuIO(t, dir, "-r", "-f", "raw", "nbd://"+n1.nbd+"/disk0", "-c", fmt.Sprintf("read -P %d %d 4k", p, off))
	took := time.Since(start)
	if !strings.Contains(r.stdout+r.stderr, "Input/output error") || strings.Contains(r.stdout, "Pattern verification failed") {
		t.Fatalf("a read of an unfound object: want EIO after --io-timeout, got:\n%s%s", r.stdout, r.stderr)
	}
	if took < 2*time.Second {
		t.Fatalf("a read of an unfound object failed after %v: it should wait for a holder (--io-timeout 3s)", took)
	}
	t.Logf("a read of an unfound object: EIO after %v", took.Round(100*time.Millisecond))

	if r := n1.admin(t, "cluster", "mark-lost"); r.code == 0 || !strings.Contains(r.stderr, "--all-unfound") {
		t.Fatalf("mark-lost with nothing named: exit %d, want an error naming --all-unfound\n%s%s", r.code, r.stdout, r.stderr)
	}
	one := fmt.Sprintf("0000000100%06x", written[0]*2)
	var lost []struct {
		Object string   `json:"object"`
		VDI    string   `json:"vdi"`
		On     []string `json:"may_be_on"`
	}
	n1.mustAdminJSON(t, &lost, "cluster", "mark-lost", one)
	if len(lost) != 1 || lost[0].Object != one || lost[0].VDI != "disk0" {
		t.Fatalf("mark-lost %s: gave up %+v", one, lost)
	}
	// The rest, all of them (check names at most 32 a node): the blocks
	// given up are those of the objects it prints.
	var rest []struct {
		Object string `json:"object"`
	}
	n1.mustAdminJSON(t, &rest, "cluster", "mark-lost", "--all-unfound")
	written = written[:1]
	for _, u := range rest {
		idx, err := strconv.ParseUint(u.Object[8:], 16, 32)
		if err != nil || len(u.Object) != 16 {
			t.Fatalf("mark-lost --all-unfound: object %q", u.Object)
		}
		if u.Object == one {
			t.Fatalf("mark-lost --all-unfound gave up %s again", one)
		}
		if idx%2 == 0 {
			written = append(written, int(idx/2))
		}
	}
	t.Logf("mark-lost --all-unfound gave up %d more objects; blocks given up: %v", len(rest), written)
	if out := n1.mustAdmin(t, "cluster", "mark-lost", "--all-unfound"); !strings.Contains(out.stdout, "nothing given up") {
		// Nodes may still be deciding the marked objects: what they
		// still report is among those given up already.
		t.Logf("mark-lost --all-unfound again:\n%s", out.stdout)
	}
	waitUntil(t, 30*time.Second, func() (bool, string) {
		u, _ := unfoundOn(t, n1)
		return u == 0, "unfound objects left after mark-lost"
	})
	waitRecovered(t, n1, 1)
	// What was given up reads as zeros, the rest as written.
	readLost := func(when string, n *clusterNode) {
		t.Helper()
		var args []string
		for i := range unfoundBlocks {
			off, p := unfoundBlock(i)
			if slices.Contains(written, i) {
				p = 0
			}
			args = append(args, "-c", fmt.Sprintf("read -P %d %d 4k", p, off))
		}
		r := runQemuIO(t, dir, append([]string{"-r", "-f", "raw", "nbd://" + n.nbd + "/disk0"}, args...)...)
		if r.code != 0 || strings.Contains(r.stdout, "failed") {
			t.Fatalf("%s: %s%s", when, r.stdout, r.stderr)
		}
	}
	readLost("after mark-lost", n1)
	// A holder returns after all: what was given up stays given up.
	nodes[1] = restartClusterNode(t, nodes[1].dir, etcd, nodes[1].addr, lease...)
	waitRecovered(t, n1, 2)
	readLost("after a holder returned", n1)
	readLost("after a holder returned, through it", nodes[1])
	checkAll(t, n1, "after a holder returned")
}

// TestClusterCheckFindsLostObject (issue 26: cluster check knows which
// objects should exist, not only which copies it finds): an object
// written through the cluster whose every copy is then gone from the
// disks of nodes that are up is named by `cluster check`, which exits
// 1. Before allocation maps it compared only the copies it found, and
// said nothing.
func TestClusterCheckFindsLostObject(t *testing.T) {
	etcd := testutil.EtcdEndpoints(testutil.StartEtcd(t, 1))
	base := t.TempDir()
	lease := []string{"--lease", "2s"}
	nodes := make([]*clusterNode, 3)
	for i := range nodes {
		nodes[i] = startClusterNode(t, filepath.Join(base, fmt.Sprintf("n%d", i+1)), etcd, lease...)
	}
	waitUp(t, nodes[0], 3)
	nodes[0].mustAdmin(t, "cluster", "format", "--copies", "2")
	nodes[0].mustAdmin(t, "vdi", "create", "disk0", "64M")
	// Objects 0 and 5 (4 MiB objects) hold data.
	for _, off := range []string{"0", "20M"} {
		w := exec.Command(ovisBin, "vdi", "write", "disk0", off, "-a", nodes[0].addr)
		w.Stdin = strings.NewReader(strings.Repeat("lost", 1024))
		if out, err := w.CombinedOutput(); err != nil {
			t.Fatalf("vdi write at %s: %v, %s", off, err, out)
		}
	}
	if r := nodes[0].admin(t, "cluster", "check"); r.code != 0 {
		t.Fatalf("cluster check before the loss: exit %d\n%s%s", r.code, r.stdout, r.stderr)
	}
	// vdi list says what the map holds: two 4 MiB objects.
	var list []struct {
		Name      string `json:"name"`
		Allocated *int64 `json:"allocated"`
	}
	nodes[0].mustAdminJSON(t, &list, "vdi", "list")
	if len(list) != 1 || list[0].Allocated == nil || *list[0].Allocated != 8<<20 {
		t.Fatalf("vdi list: %+v; want disk0 with 8 MiB allocated", list)
	}

	// Every copy of object 5 goes while the nodes are down; they come
	// back without it.
	for _, n := range nodes {
		n.kill(syscall.SIGKILL)
	}
	var obj string
	removed := 0
	for _, n := range nodes {
		var files []string
		filepath.WalkDir(filepath.Join(n.dir, "objects"), func(path string, d fs.DirEntry, err error) error {
			if err == nil && !d.IsDir() && d.Name() == "00000005" {
				files = append(files, path)
			}
			return nil
		})
		for _, f := range files {
			if err := os.Remove(f); err != nil {
				t.Fatal(err)
			}
			obj = filepath.Base(filepath.Dir(f)) + "00000005"
			removed++
		}
	}
	if removed != 2 {
		t.Fatalf("%d copies of object 5 found to remove, want 2", removed)
	}
	for i, n := range nodes {
		nodes[i] = restartClusterNode(t, n.dir, etcd, n.addr, lease...)
	}
	waitUp(t, nodes[0], 3)
	waitRecovered(t, nodes[0], 3)
	r := nodes[0].admin(t, "cluster", "check")
	if r.code != 1 || !strings.Contains(r.stdout, obj) || !strings.Contains(r.stdout, "no node that is up holds a copy") {
		t.Fatalf("cluster check with object %s lost: exit %d, want 1 naming it\n%s%s", obj, r.code, r.stdout, r.stderr)
	}
	t.Logf("cluster check: exit 1:\n%s", firstLines(r.stdout, 3))
	var rep struct {
		Problems []struct{ Object, Kind string } `json:"problems"`
	}
	r = nodes[0].admin(t, "cluster", "check", "--output", "json")
	if err := json.Unmarshal([]byte(r.stdout), &rep); err != nil || r.code != 1 {
		t.Fatalf("cluster check --output json: exit %d, %v\n%s%s", r.code, err, r.stdout, r.stderr)
	}
	if len(rep.Problems) != 1 || rep.Problems[0].Object != obj || rep.Problems[0].Kind != "absent" {
		t.Fatalf("cluster check --output json: %+v; want object %s absent alone", rep.Problems, obj)
	}
}
