// Package clustertest runs a cluster of ovis nodes in one process, on
// the first node's embedded etcd, with faults a test can inject: cut
// node-to-node links (cluster/protocol/faultnet; each node still
// reaches etcd), kill a node as SIGKILL would and start it again on its
// directory (node.Node.Kill), fill a node's disk (its store sees the
// free space the test sets), and fail a store's file operations
// (cluster/store/vfs/errorfs). Admin calls are typed (cluster/admin),
// and readiness is read through the nodes' API, never from logs.
//
// A Nemesis draws a fault schedule from a seed, so that the faults a
// run injected replay from its seed (the interleaving of requests does
// not).
//
// Tests that need real processes (SIGSTOP, Debian's etcd-server,
// network namespaces, QEMU guests) stay in cmd/ovis.
//
// Locking: mu guards nodes (a Restart replaces one); every method is
// safe for concurrent use.
package clustertest

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ovis-storage/ovis/cluster/admin"
	"github.com/ovis-storage/ovis/cluster/membership"
	"github.com/ovis-storage/ovis/cluster/node"
	"github.com/ovis-storage/ovis/cluster/protocol/faultnet"
	"github.com/ovis-storage/ovis/cluster/store/vfs"
	"github.com/ovis-storage/ovis/cluster/store/vfs/errorfs"
	"github.com/ovis-storage/ovis/nbd"
)

// Options are a cluster's.
type Options struct {
	// Nodes is how many nodes start; at least 1.
	Nodes int
	// LeaseTTL is each node's lease; the default is 3 s.
	LeaseTTL time.Duration
	// ProbeInterval is how often nodes probe their peers; the default
	// is 200 ms, so that a cut-off node leaves within about a second.
	ProbeInterval time.Duration
	// IOTimeout bounds a gateway request; the default is 20 s.
	IOTimeout time.Duration
	// Seed seeds the stores' errorfs; the default is 1.
	Seed uint64
	// Logger, when set, gets every node's log; the default discards.
	Logger *slog.Logger
}

// Cluster is a running in-process cluster. Close its nodes with the
// test's cleanup (Start registers it).
type Cluster struct {
	t   testing.TB
	Net *faultnet.Net

	cfgs  []node.Config
	fs    []*errorfs.FS
	space []*spaceFS

	mu    sync.Mutex
	nodes []*node.Node
}

// spaceFS reports the free space set on it (when set) under a store.
type spaceFS struct {
	vfs.FS
	free atomic.Int64 // bytes; negative: the real figure
}

func (f *spaceFS) Statfs(path string) (unix.Statfs_t, error) {
	st, err := f.FS.Statfs(path)
	if free := f.free.Load(); free >= 0 {
		st.Bsize, st.Bavail = 4096, uint64(free/4096)
	}
	return st, err
}

// Start starts o.Nodes nodes, the first embedding etcd, and waits until
// every node's epoch lists them all.
func Start(t testing.TB, o Options) *Cluster {
	t.Helper()
	if o.Nodes < 1 {
		t.Fatalf("clustertest: %d nodes", o.Nodes)
	}
	if o.LeaseTTL == 0 {
		o.LeaseTTL = 3 * time.Second
	}
	if o.ProbeInterval == 0 {
		o.ProbeInterval = 200 * time.Millisecond
	}
	if o.IOTimeout == 0 {
		o.IOTimeout = 20 * time.Second
	}
	if o.Seed == 0 {
		o.Seed = 1
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	c := &Cluster{t: t, Net: faultnet.New()}
	for i := range o.Nodes {
		efs := errorfs.New(vfs.Default, o.Seed+uint64(i))
		sfs := &spaceFS{FS: efs}
		sfs.free.Store(-1)
		id := fmt.Sprintf("n%d", i)
		cfg := node.Config{Dir: t.TempDir(), ID: id, Listen: "127.0.0.1:0", LeaseTTL: o.LeaseTTL,
			Logger: o.Logger.With("node", id), Dialer: c.Net.Dialer(id), EtcdDialer: c.Net.Dialer(id), ProbeInterval: o.ProbeInterval,
			IOTimeout: o.IOTimeout, SpaceInterval: 50 * time.Millisecond, StoreFS: sfs}
		if i == 0 {
			cfg.EtcdListen, cfg.EtcdPeer = "http://127.0.0.1:0", "http://127.0.0.1:0"
		} else {
			cfg.Etcd = c.nodes[0].EtcdEndpoints()
		}
		c.cfgs = append(c.cfgs, cfg)
		c.fs = append(c.fs, efs)
		c.space = append(c.space, sfs)
		c.nodes = append(c.nodes, nil)
		c.start(i)
		if i == 0 {
			// n0's embedded etcd is "etcd" on the network, so that a
			// test can cut a node off it (CutEtcd).
			for _, u := range c.nodes[0].EtcdEndpoints() {
				c.Net.Name(strings.TrimPrefix(u, "http://"), Etcd)
			}
		}
	}
	c.AwaitNodes(o.Nodes)
	return c
}

// Etcd is the name of the cluster's etcd on its network (Net): Cut(id,
// Etcd) cuts node id off etcd, as CutEtcd does.
const Etcd = "etcd"

// CutEtcd cuts node i off etcd (only: its peers still reach it): its
// connections to etcd fail now, and new ones are refused until HealEtcd.
func (c *Cluster) CutEtcd(i int) { c.Net.Cut(c.ID(i), Etcd) }

// HealEtcd ends CutEtcd(i).
func (c *Cluster) HealEtcd(i int) { c.Net.Heal(c.ID(i), Etcd) }

// start starts node i on its configuration (again, after Kill).
func (c *Cluster) start(i int) {
	c.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	nd, err := node.Start(ctx, c.cfgs[i])
	if err != nil {
		c.t.Fatalf("clustertest: start %s: %v", c.cfgs[i].ID, err)
	}
	c.Net.Name(nd.Addr(), nd.ID())
	c.mu.Lock()
	c.nodes[i] = nd
	c.mu.Unlock()
	// Cleanups run last first: node 0, with etcd, closes last.
	c.t.Cleanup(func() {
		select {
		case <-nd.Done():
			return // killed or closed by the test
		default:
		}
		cctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := nd.Close(cctx); err != nil {
			c.t.Errorf("clustertest: close %s: %v", nd.ID(), err)
		}
	})
}

// Len is the number of nodes, live or killed.
func (c *Cluster) Len() int { return len(c.cfgs) }

// ID is node i's ID: "n<i>".
func (c *Cluster) ID(i int) string { return c.cfgs[i].ID }

// Node is node i, as last started.
func (c *Cluster) Node(i int) *node.Node {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.nodes[i]
}

// Up reports whether node i runs (was not killed, or was started again).
func (c *Cluster) Up(i int) bool {
	select {
	case <-c.Node(i).Done():
		return false
	default:
		return true
	}
}

// Admin returns a typed admin client of node i, closed with the test.
func (c *Cluster) Admin(i int) *admin.Client {
	cl := admin.Dial(c.Node(i).Addr(), nil)
	c.t.Cleanup(func() { cl.Close() })
	return cl
}

// Format formats the cluster with copies, through node 0's admin.
func (c *Cluster) Format(ctx context.Context, copies int) {
	c.t.Helper()
	if _, err := admin.Format.Do(ctx, c.Admin(0), admin.FormatRequest{Copies: copies}); err != nil {
		c.t.Fatalf("clustertest: format: %v", err)
	}
}

// CreateVDI creates a VDI through node 0's admin.
func (c *Cluster) CreateVDI(ctx context.Context, name string, size int64, objectShift uint8) membership.VDI {
	c.t.Helper()
	v, err := admin.VDICreate.Do(ctx, c.Admin(0), admin.VDICreateRequest{Name: name, Size: size, ObjectShift: objectShift})
	if err != nil {
		c.t.Fatalf("clustertest: create vdi %s: %v", name, err)
	}
	return v
}

// Open opens VDI name through node i's gateway.
func (c *Cluster) Open(ctx context.Context, i int, name string) (*nbd.Export, error) {
	return c.Node(i).Open(ctx, name)
}

// Check runs cluster check through node 0's admin.
func (c *Cluster) Check(ctx context.Context) (admin.CheckReport, error) {
	return admin.Check.Do(ctx, c.Admin(0), admin.None{})
}

// Cut cuts the links between nodes i and j, both ways.
func (c *Cluster) Cut(i, j int) { c.Net.Cut(c.ID(i), c.ID(j)) }

// Heal heals the links between nodes i and j.
func (c *Cluster) Heal(i, j int) { c.Net.Heal(c.ID(i), c.ID(j)) }

// Isolate cuts node i off every other node; it still reaches etcd.
func (c *Cluster) Isolate(i int) {
	for j := range c.Len() {
		if j != i {
			c.Cut(i, j)
		}
	}
}

// Drop cuts node i off node j so that i sees the cut at once and j
// only when its dials time out (faultnet.Net.Drop from j to i): of the
// two, i reports the other first.
func (c *Cluster) Drop(i, j int) {
	c.Net.Cut(c.ID(i), c.ID(j))
	c.Net.Drop(c.ID(j), c.ID(i))
}

// HealAll heals every link.
func (c *Cluster) HealAll() {
	for i := range c.Len() {
		for j := i + 1; j < c.Len(); j++ {
			c.Heal(i, j)
		}
		c.HealEtcd(i)
	}
}

// Kill kills node i (node.Node.Kill). Killing node 0 takes etcd down.
func (c *Cluster) Kill(i int) {
	if err := c.Node(i).Kill(); err != nil {
		c.t.Errorf("clustertest: kill %s: %v", c.ID(i), err)
	}
}

// Restart starts node i again on its directory, after Kill.
func (c *Cluster) Restart(i int) { c.start(i) }

// SetFree makes node i's store see free bytes free on its disk (its
// reserve is 0); a negative free gives back the real figure.
func (c *Cluster) SetFree(i int, free int64) { c.space[i].free.Store(free) }

// FS is node i's store file system, for failing its operations.
func (c *Cluster) FS(i int) *errorfs.FS { return c.fs[i] }

// AwaitNodes waits until every running node follows one epoch listing
// n nodes, and returns that epoch; it fails the test after 30 s.
func (c *Cluster) AwaitNodes(n int) uint64 {
	c.t.Helper()
	var last string
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		var e uint64
		same := true
		for i := range c.Len() {
			if !c.Up(i) {
				continue
			}
			v := c.Node(i).View()
			if e == 0 {
				e = v.Epoch
			}
			if v.Epoch != e || len(v.Addr) != n {
				same = false
				last = fmt.Sprintf("%s at epoch %d of %d nodes", c.ID(i), v.Epoch, len(v.Addr))
			}
		}
		if same {
			return e
		}
	}
	c.t.Fatalf("clustertest: no common epoch of %d nodes after 30 s (%s)", n, last)
	return 0
}
