package clustertest

import (
	"bytes"
	"context"
	"fmt"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/ovis-storage/ovis/block"
	"github.com/ovis-storage/ovis/cluster/admin"
	"github.com/ovis-storage/ovis/cluster/object"
	"github.com/ovis-storage/ovis/cluster/placement"
	"github.com/ovis-storage/ovis/cluster/store"
)

// eventually polls ok every 50 ms until it returns nil, failing the
// test with its last error after d.
func eventually(t *testing.T, d time.Duration, what string, ok func() error) {
	t.Helper()
	var err error
	for deadline := time.Now().Add(d); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		if err = ok(); err == nil {
			return
		}
	}
	t.Fatalf("%s: %v", what, err)
}

// writeAll writes 4 KiB of b at the start of each of objects 4 MiB
// objects through dev, and flushes.
func writeAll(ctx context.Context, t *testing.T, dev block.Device, objects int, b byte) {
	t.Helper()
	for i := range objects {
		if _, err := dev.WriteAt(ctx, bytes.Repeat([]byte{b}, 4096), int64(i)<<22, 0); err != nil {
			t.Fatalf("write of object %d: %v", i, err)
		}
	}
	if err := dev.Flush(ctx); err != nil {
		t.Fatal(err)
	}
}

// readAll checks that each object starts with 4 KiB of b through dev.
func readAll(ctx context.Context, t *testing.T, dev block.Device, objects int, b byte) {
	t.Helper()
	got := make([]byte, 4096)
	for i := range objects {
		if _, err := dev.ReadAt(ctx, got, int64(i)<<22); err != nil || !bytes.Equal(got, bytes.Repeat([]byte{b}, 4096)) {
			t.Fatalf("object %d reads %d... (%v), want %d", i, got[0], err, b)
		}
	}
}

// checked returns nil when cluster check finds objects objects with
// three copies each and nothing wrong.
func checked(ctx context.Context, c *Cluster, objects int) error {
	r, err := c.Check(ctx)
	if err != nil {
		return err
	}
	if len(r.Bad) != 0 || r.Objects != objects || r.Copies != 3*objects {
		return fmt.Errorf("check: %d objects, %d copies, problems %+v", r.Objects, r.Copies, r.Bad)
	}
	return nil
}

// held is how many objects node i holds, by node list.
func held(ctx context.Context, t *testing.T, c *Cluster, i int) int {
	t.Helper()
	for _, ns := range nodeList(ctx, t, c) {
		if ns.ID == c.ID(i) {
			return ns.Objects
		}
	}
	t.Fatalf("node list lacks %s", c.ID(i))
	return 0
}

// startDisk starts a cluster of n nodes, copies 3, with a VDI "disk" of
// objects 4 MiB objects, and opens it through node 0.
func startDisk(ctx context.Context, t *testing.T, n, objects int) (*Cluster, block.Device) {
	t.Helper()
	c := Start(t, Options{Nodes: n})
	c.Format(ctx, 3)
	c.CreateVDI(ctx, "disk", int64(objects)<<22, 22)
	c.AwaitNodes(n)
	exp, err := c.Open(ctx, 0, "disk")
	if err != nil {
		t.Fatal(err)
	}
	return c, exp.Device
}

// TestFullNodeLeavesPlacement (issue 27, a full node): four nodes,
// copies 3. When one node's disk reaches its reserve it leaves
// placement: writes of every object succeed, each object ends with
// three copies on the other three nodes, the full node's copies are
// moved off it, and check finds nothing wrong. When space comes back it
// is placed again, and recovery puts copies back on it.
func TestFullNodeLeavesPlacement(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	const objects = 16
	c, dev := startDisk(ctx, t, 4, objects)
	placed := func(i int) bool {
		return slices.ContainsFunc(c.Node(i).View().Map.Nodes(), func(p placement.Node) bool { return p.ID == c.ID(3) })
	}
	writeAll(ctx, t, dev, objects, 1)
	if held(ctx, t, c, 3) == 0 {
		t.Fatal("the node to fill holds no copy: the test needs some")
	}

	c.SetFree(3, 1<<20) // under one object above its reserve (0)
	eventually(t, time.Minute, "the full node leaves placement", func() error {
		for i := range 4 {
			if placed(i) || c.Node(i).View().Addr[c.ID(3)] == "" {
				return fmt.Errorf("%s: epoch %d places the full node %v, or lost its address", c.ID(i), c.Node(i).View().Epoch, placed(i))
			}
		}
		return nil
	})
	if info, err := admin.GetInfo.Do(ctx, c.Admin(1), admin.None{}); err != nil || !slices.Equal(info.Full, []string{c.ID(3)}) {
		t.Errorf("cluster info: full nodes %v (%v), want %s", info.Full, err, c.ID(3))
	}
	writeAll(ctx, t, dev, objects, 2)
	readAll(ctx, t, dev, objects, 2)
	eventually(t, time.Minute, "every object has three copies off the full node", func() error { return checked(ctx, c, objects) })
	eventually(t, time.Minute, "the full node's copies are moved off", func() error {
		if n := held(ctx, t, c, 3); n != 0 {
			return fmt.Errorf("the full node still holds %d copies", n)
		}
		return nil
	})

	c.SetFree(3, -1)
	eventually(t, time.Minute, "the node is placed again", func() error {
		for i := range 4 {
			if !placed(i) {
				return fmt.Errorf("%s: epoch %d does not place it", c.ID(i), c.Node(i).View().Epoch)
			}
		}
		return nil
	})
	eventually(t, time.Minute, "copies are back on it", func() error {
		if err := checked(ctx, c, objects); err != nil {
			return err
		}
		if held(ctx, t, c, 3) == 0 {
			return fmt.Errorf("the node holds no copy again")
		}
		return nil
	})
	readAll(ctx, t, dev, objects, 2)
}

// TestCutOffNodeLeaves (issue 27, a node that reaches etcd but not its
// peers): four nodes, copies 3; node n3's links to every other node are
// cut, while it still reaches etcd. Writes through n0 to every object
// (some placed on n3) go on without an error: within a few probe rounds
// n3 leaves the epoch by itself and the others write without it. The
// others do not leave: the cut costs one epoch. Once the links heal, n3
// joins again, and check finds every object's three copies equal.
//
// The cut is made two ways: both ends see it at once (isolated), or n3
// sees it first (its dials fail at once, its peers' hang until they
// time out), as a node whose own link went down does: its reports name
// its three peers before any of them reports it. The peers, which
// cannot yet say they miss anyone, must not take those reports as proof
// that they are dead and leave (they did, and never came back, before
// a silent node stopped being named).
func TestCutOffNodeLeaves(t *testing.T) {
	for _, cut := range []struct {
		name string
		cut  func(c *Cluster)
	}{
		{"isolated", func(c *Cluster) { c.Isolate(3) }},
		{"seeing it first", func(c *Cluster) {
			for j := range 3 {
				c.Drop(3, j)
			}
		}},
	} {
		t.Run(cut.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
			defer cancel()
			const objects = 16
			c, dev := startDisk(ctx, t, 4, objects)
			writeAll(ctx, t, dev, objects, 1)
			before := c.Node(0).View().Epoch

			cut.cut(c)
			start := time.Now()
			writeAll(ctx, t, dev, objects, 2)
			t.Logf("writes of all %d objects with n3 cut off took %v", objects, time.Since(start).Round(10*time.Millisecond))
			for i := range 3 {
				v := c.Node(i).View()
				if _, in := v.Addr[c.ID(3)]; in {
					t.Fatalf("%s: epoch %d still lists the cut-off node after the writes", c.ID(i), v.Epoch)
				}
				for j := range 3 {
					if _, in := v.Addr[c.ID(j)]; !in {
						t.Fatalf("%s: epoch %d lost %s, which was not cut off", c.ID(i), v.Epoch, c.ID(j))
					}
				}
			}
			if e := c.AwaitNodes(3); e != before+1 {
				t.Errorf("epoch %d after the cut, from %d: the peers left and came back too", e, before)
			}
			r1, err := c.Open(ctx, 1, "disk")
			if err != nil {
				t.Fatal(err)
			}
			readAll(ctx, t, r1.Device, objects, 2)

			c.HealAll()
			c.AwaitNodes(4)
			eventually(t, time.Minute, "after the links healed", func() error { return checked(ctx, c, objects) })
		})
	}
}

// TestReturnPullsOnlyWhatDiffers (issue 26, Decide's equal versions):
// three nodes, copies 3, eight objects. While n2 is away, objects 0..3
// are written again; n2's copy of object 5 gets other bytes at its own
// version (as a cut-off writer's unacknowledged write can reach the
// others' count). Back, n2 must pull exactly the five that differ, and
// keep the three nobody wrote: ranks differ, versions are equal, and the
// checksums decide. Every copy then agrees (cluster check).
func TestReturnPullsOnlyWhatDiffers(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	const objects = 8
	c := Start(t, Options{Nodes: 3})
	c.Format(ctx, 3)
	vd := c.CreateVDI(ctx, "disk", objects<<22, 22)
	c.AwaitNodes(3)
	exp, err := c.Open(ctx, 0, "disk")
	if err != nil {
		t.Fatal(err)
	}
	dev := exp.Device
	writeAll(ctx, t, dev, objects, 1)
	eventually(t, 30*time.Second, "the copies agree", func() error { return checked(ctx, c, objects) })

	c.Kill(2)
	c.AwaitNodes(2)
	for i := range 4 {
		if _, err := dev.WriteAt(ctx, bytes.Repeat([]byte{2}, 4096), int64(i)<<22, 0); err != nil {
			t.Fatalf("write of object %d with n2 away: %v", i, err)
		}
	}
	if err := dev.Flush(ctx); err != nil {
		t.Fatal(err)
	}

	// n2's copy of object 5: other bytes, the same version.
	st, err := store.Open(filepath.Join(c.cfgs[2].Dir, "objects"), store.Options{})
	if err != nil {
		t.Fatal(err)
	}
	obj := object.Make(vd.ID, 5)
	in, err := st.Stat(obj)
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Replace(obj, in.Version, bytes.Repeat([]byte{9}, 4096)); err != nil {
		t.Fatal(err)
	}
	if err := st.Close(); err != nil {
		t.Fatal(err)
	}

	c.Restart(2)
	c.AwaitNodes(3)
	var stats admin.RecoveryStats
	eventually(t, 60*time.Second, "n2 recovers", func() error {
		for _, ns := range nodeList(ctx, t, c) {
			if ns.ID == c.ID(2) {
				stats = ns.Recovery
				if ns.Recovery.Done < ns.Epoch {
					return fmt.Errorf("n2 at epoch %d recovered %d", ns.Epoch, ns.Recovery.Done)
				}
				return nil
			}
		}
		return fmt.Errorf("node list lacks n2")
	})
	if stats.Recovered != 5 || stats.Verified != 3 {
		t.Errorf("n2 recovered %d objects and kept %d by checksum, want 5 (objects 0..3 written while it was away, and object 5) and 3", stats.Recovered, stats.Verified)
	}
	eventually(t, 30*time.Second, "the copies agree", func() error { return checked(ctx, c, objects) })
	got := make([]byte, 4096)
	for i := range objects {
		want := byte(1)
		if i < 4 {
			want = 2
		}
		if _, err := dev.ReadAt(ctx, got, int64(i)<<22); err != nil || !bytes.Equal(got, bytes.Repeat([]byte{want}, 4096)) {
			t.Fatalf("object %d reads %d... (%v), want %d", i, got[0], err, want)
		}
	}
}

// nodeList is node list through node 0.
func nodeList(ctx context.Context, t *testing.T, c *Cluster) []admin.NodeStatus {
	t.Helper()
	list, err := admin.NodeList.Do(ctx, c.Admin(0), admin.None{})
	if err != nil {
		t.Fatal(err)
	}
	return list
}

// TestNodeCutOffEtcdRejoins: four nodes, copies 3. n3 is cut off etcd
// alone (it still reaches its peers): its lease runs out, it says
// "rejoining" and serves nothing, and the others go on in an epoch
// without it, where writes through n0 succeed. Once etcd is back, n3
// rejoins, recovers what it missed, and every copy agrees.
func TestNodeCutOffEtcdRejoins(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	const objects = 8
	c, dev := startDisk(ctx, t, 4, objects)
	writeAll(ctx, t, dev, objects, 1)

	c.CutEtcd(3)
	eventually(t, 30*time.Second, "the others leave n3 out", func() error {
		for i := range 3 {
			if v := c.Node(i).View(); v.Addr[c.ID(3)] != "" || len(v.Addr) != 3 {
				return fmt.Errorf("%s at epoch %d of %d nodes", c.ID(i), v.Epoch, len(v.Addr))
			}
		}
		return nil
	})
	eventually(t, 30*time.Second, "n3 says it is rejoining", func() error { return inState(ctx, c, 3, "rejoining") })
	writeAll(ctx, t, dev, objects, 2)
	readAll(ctx, t, dev, objects, 2)

	c.HealEtcd(3)
	c.AwaitNodes(4)
	eventually(t, 60*time.Second, "n3 is up and the copies agree", func() error {
		if err := inState(ctx, c, 3, "up"); err != nil {
			return err
		}
		return checked(ctx, c, objects)
	})
	readAll(ctx, t, dev, objects, 2)
}

// inState returns nil when node i says it is in state, by its own
// status.
func inState(ctx context.Context, c *Cluster, i int, state string) error {
	st, err := admin.NodeSelf.Do(ctx, c.Admin(i), admin.None{})
	if err != nil {
		return err
	}
	if st.State != state {
		return fmt.Errorf("%s is %q, not %q", c.ID(i), st.State, state)
	}
	return nil
}
