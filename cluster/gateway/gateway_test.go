package gateway_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"pgregory.net/rapid"

	"github.com/ovis-storage/ovis/block"
	"github.com/ovis-storage/ovis/cluster/gateway"
	"github.com/ovis-storage/ovis/cluster/node"
	"github.com/ovis-storage/ovis/cluster/object"
	"github.com/ovis-storage/ovis/cluster/owner"
	"github.com/ovis-storage/ovis/cluster/placement"
	"github.com/ovis-storage/ovis/cluster/protocol"
	"github.com/ovis-storage/ovis/cluster/store"
	"github.com/ovis-storage/ovis/cluster/view"
)

var ctx = context.Background()

// epoch is a node's epoch, set by the test.
type epoch struct {
	mu   sync.Mutex
	e    uint64
	wake chan struct{}
}

func newEpoch(e uint64) *epoch { return &epoch{e: e, wake: make(chan struct{})} }

func (p *epoch) Epoch() uint64 { p.mu.Lock(); defer p.mu.Unlock(); return p.e }

func (p *epoch) set(e uint64) {
	p.mu.Lock()
	p.e = e
	close(p.wake)
	p.wake = make(chan struct{})
	p.mu.Unlock()
}

func (p *epoch) AwaitEpoch(ctx context.Context, e uint64) error {
	for {
		p.mu.Lock()
		cur, wake := p.e, p.wake
		p.mu.Unlock()
		if cur >= e {
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-wake:
		}
	}
}

// counting wraps a Caller and counts requests by op and node.
type counting struct {
	next  gateway.Caller
	mu    sync.Mutex
	calls map[string]int // "op addr" and "op sync" keys
}

func (c *counting) Call(ctx context.Context, addr string, req *protocol.Request, resp *protocol.Response) error {
	c.mu.Lock()
	c.calls[req.Op.String()]++
	c.calls[req.Op.String()+" "+addr]++
	if req.Flags&protocol.FlagSync != 0 {
		c.calls[req.Op.String()+" sync"]++
	}
	c.mu.Unlock()
	return c.next.Call(ctx, addr, req, resp)
}

func (c *counting) get(key string) int { c.mu.Lock(); defer c.mu.Unlock(); return c.calls[key] }
func (c *counting) reset()             { c.mu.Lock(); c.calls = map[string]int{}; c.mu.Unlock() }

// testNode is one storage node on loopback: a store and a protocol
// server.
type testNode struct {
	id   string
	addr string
	dir  string
	st   *store.Store
	ep   *epoch
	srv  *protocol.Server
	lis  net.Listener
	done chan error
}

func startNode(t *testing.T, id string, ep uint64, dir string) *testNode {
	t.Helper()
	if dir == "" {
		dir = t.TempDir()
	}
	st, err := store.Open(dir, store.Options{})
	if err != nil {
		t.Fatal(err)
	}
	n := &testNode{id: id, dir: dir, st: st, ep: newEpoch(ep), done: make(chan error, 1)}
	n.srv = protocol.NewServer(&node.Handler{Store: st, Epochs: n.ep, CatchUp: 200 * time.Millisecond, GateWait: 300 * time.Millisecond}, protocol.ServerOptions{})
	n.lis, err = net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	n.addr = n.lis.Addr().String()
	go func() { n.done <- n.srv.Serve(n.lis) }()
	t.Cleanup(func() { n.stop(t) })
	return n
}

// stop shuts the node down; a second stop does nothing.
func (n *testNode) stop(t *testing.T) {
	if n.srv == nil {
		return
	}
	sctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	n.srv.Shutdown(sctx)
	<-n.done
	if err := n.st.Close(); err != nil {
		t.Errorf("node %s: store close: %v", n.id, err)
	}
	n.srv = nil
}

type cluster struct {
	nodes []*testNode
	view  *view.View
	net   *counting
	pool  *protocol.Pool
}

func newCluster(t *testing.T, n int, epoch uint64) *cluster {
	t.Helper()
	c := &cluster{}
	var pn []placement.Node
	addrs := map[string]string{}
	for i := range n {
		tn := startNode(t, fmt.Sprintf("n%d", i), epoch, "")
		c.nodes = append(c.nodes, tn)
		pn = append(pn, placement.Node{ID: tn.id, Weight: 1})
		addrs[tn.id] = tn.addr
	}
	v, err := view.New(epoch, pn, addrs)
	if err != nil {
		t.Fatal(err)
	}
	c.view = v
	c.pool = protocol.NewPool(nil)
	t.Cleanup(func() { c.pool.Close() })
	c.net = &counting{next: c.pool, calls: map[string]int{}}
	return c
}

func (c *cluster) open(t *testing.T, views view.Source, token uint64, size int64, copies int) *gateway.Device {
	t.Helper()
	if views == nil {
		views = view.Static{V: c.view}
	}
	d, err := gateway.Open(ctx, gateway.Config{
		VDI: 7, Name: "test", Size: size, Copies: copies, ObjectShift: object.MinSizeShift,
		Token: token, Views: views, Net: c.net, Local: c.nodes[0].id, RetryTimeout: 5 * time.Second,
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Close() })
	return d
}

func fill(seed uint64, n int) []byte {
	r := rand.New(rand.NewPCG(seed, 1))
	p := make([]byte, n)
	for i := range p {
		p[i] = byte(r.Uint32())
	}
	return p
}

func readAll(t *testing.T, d block.Device) []byte {
	t.Helper()
	p := make([]byte, d.Size())
	if _, err := d.ReadAt(ctx, p, 0); err != nil {
		t.Fatal(err)
	}
	return p
}

// TestModel runs random writes, zero writes, discards, flushes and reads
// against a byte slice, on three nodes with three copies, and checks every
// read and every replica's bytes.
func TestModel(t *testing.T) {
	const size = 5<<20 + 4096 // five objects and a bit: requests cross objects
	c := newCluster(t, 3, 1)
	d := c.open(t, nil, 1, size, 3)
	model := make([]byte, size)
	rapid.Check(t, func(rt *rapid.T) {
		for range rapid.IntRange(1, 20).Draw(rt, "ops") {
			off := rapid.Int64Range(0, size-1).Draw(rt, "off")
			n := rapid.Int64Range(0, min(size-off, 3<<20)).Draw(rt, "n")
			fua := rapid.Bool().Draw(rt, "fua")
			var f block.Flags
			if fua {
				f = block.FUA
			}
			switch rapid.IntRange(0, 4).Draw(rt, "op") {
			case 0, 1:
				p := fill(rapid.Uint64().Draw(rt, "seed"), int(n))
				if _, err := d.WriteAt(ctx, p, off, f); err != nil {
					rt.Fatal(err)
				}
				copy(model[off:], p)
			case 2:
				if rapid.Bool().Draw(rt, "nounmap") {
					f |= block.NoUnmap
				}
				if err := d.WriteZeroes(ctx, off, n, f); err != nil {
					rt.Fatal(err)
				}
				clear(model[off : off+n])
			case 3:
				if err := d.Discard(ctx, off, n, f); err != nil {
					rt.Fatal(err)
				}
				clear(model[off : off+n])
			case 4:
				if err := d.Flush(ctx); err != nil {
					rt.Fatal(err)
				}
			}
			p := make([]byte, n)
			if _, err := d.ReadAt(ctx, p, off); err != nil {
				rt.Fatal(err)
			}
			if !bytes.Equal(p, model[off:off+n]) {
				rt.Fatalf("read %d+%d differs from the model", off, n)
			}
		}
	})
	if got := readAll(t, d); !bytes.Equal(got, model) {
		t.Fatal("whole VDI differs from the model")
	}
	// Every replica holds the same bytes: read each node alone.
	for _, n := range c.nodes {
		v, err := view.New(1, []placement.Node{{ID: n.id, Weight: 1}}, map[string]string{n.id: n.addr})
		if err != nil {
			t.Fatal(err)
		}
		one := c.open(t, view.Static{V: v}, 0, size, 1)
		if got := readAll(t, one); !bytes.Equal(got, model) {
			t.Errorf("node %s: its copy differs from the model", n.id)
		}
	}
	// Extents agree with the model: holes read as zeros.
	ext, err := d.Extents(ctx, 0, size, nil)
	if err != nil {
		t.Fatal(err)
	}
	var at int64
	for _, e := range ext {
		if e.Status&block.StatusZero != 0 && !bytes.Equal(model[at:at+e.Length], make([]byte, e.Length)) {
			t.Errorf("extent %d+%d is reported zero and is not", at, e.Length)
		}
		at += e.Length
	}
	if at != size {
		t.Errorf("extents cover %d bytes, want %d", at, size)
	}
}

// TestFUAIsOneSyncRequest: a FUA write is one sync request per replica and
// no flush; a plain write is a plain request, and Flush goes only to the
// nodes written to.
func TestFUAIsOneSyncRequest(t *testing.T) {
	c := newCluster(t, 5, 1)
	d := c.open(t, nil, 1, 64<<20, 3)
	c.net.reset()
	if _, err := d.WriteAt(ctx, fill(1, 4096), 0, block.FUA); err != nil {
		t.Fatal(err)
	}
	if got := c.net.get("write sync"); got != 3 {
		t.Errorf("FUA write: %d sync writes, want 3 (one per replica)", got)
	}
	if got := c.net.get("write"); got != 3 {
		t.Errorf("FUA write: %d writes, want 3", got)
	}
	if err := d.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	if got := c.net.get("flush"); got != 0 {
		t.Errorf("flush after only FUA writes sent %d flushes, want 0", got)
	}
	c.net.reset()
	if _, err := d.WriteAt(ctx, fill(2, 4096), 1<<20, 0); err != nil {
		t.Fatal(err)
	}
	if got := c.net.get("write sync"); got != 0 {
		t.Errorf("plain write: %d sync writes, want 0", got)
	}
	if err := d.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	if got := c.net.get("flush"); got != 3 {
		t.Errorf("flush after one plain write went to %d nodes, want its 3 replicas", got)
	}
	// The flush went to the object's replicas exactly.
	reps, err := c.view.Map.Place(object.Make(7, 1), 3, nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, id := range reps {
		if got := c.net.get("flush " + c.view.Addr[id]); got != 1 {
			t.Errorf("replica %s got %d flushes, want 1", id, got)
		}
	}
	c.net.reset()
	if err := d.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	if got := c.net.get("flush"); got != 0 {
		t.Errorf("a second flush with nothing written sent %d flushes", got)
	}
}

// switchViews is a Views the test moves to a new epoch.
type switchViews struct {
	mu   sync.Mutex
	v    *view.View
	wake chan struct{}
}

func (s *switchViews) View() *view.View { s.mu.Lock(); defer s.mu.Unlock(); return s.v }

func (s *switchViews) set(v *view.View) {
	s.mu.Lock()
	s.v = v
	close(s.wake)
	s.wake = make(chan struct{})
	s.mu.Unlock()
}

func (s *switchViews) Await(ctx context.Context, e uint64) (*view.View, error) {
	for {
		s.mu.Lock()
		v, wake := s.v, s.wake
		s.mu.Unlock()
		if v.Epoch > e {
			return v, nil
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-wake:
		}
	}
}

// TestEpochRetry: nodes move to epoch 2 while the gateway is at 1. The
// gateway's requests are refused as old, it waits for epoch 2, and the
// client sees success.
func TestEpochRetry(t *testing.T) {
	c := newCluster(t, 3, 1)
	sv := &switchViews{v: c.view, wake: make(chan struct{})}
	d := c.open(t, sv, 1, 8<<20, 3)
	for _, n := range c.nodes {
		n.ep.set(2)
	}
	v2 := *c.view
	v2.Epoch = 2
	var refused atomic.Bool
	go func() {
		// Publish epoch 2 to the gateway only once a node refused epoch 1.
		for c.net.get("write") == 0 {
			time.Sleep(time.Millisecond)
		}
		refused.Store(true)
		sv.set(&v2)
	}()
	want := fill(3, 8192)
	if _, err := d.WriteAt(ctx, want, 4096, 0); err != nil {
		t.Fatalf("write across an epoch change: %v", err)
	}
	if !refused.Load() {
		t.Fatal("the write succeeded before the gateway knew epoch 2")
	}
	got := make([]byte, len(want))
	if _, err := d.ReadAt(ctx, got, 4096); err != nil || !bytes.Equal(got, want) {
		t.Fatalf("read back after the epoch change: %v, equal %v", err, bytes.Equal(got, want))
	}
	// A request straight from epoch 1 is refused with the node's epoch.
	var resp protocol.Response
	err := c.pool.Call(ctx, c.nodes[0].addr, &protocol.Request{Op: protocol.OpRead, Epoch: 1, Object: object.Make(7, 0), Length: 512}, &resp)
	var pe *protocol.Error
	if !errors.As(err, &pe) || pe.Status != protocol.StatusOldEpoch {
		t.Fatalf("a read of epoch 1 at a node of epoch 2: %v, want StatusOldEpoch", err)
	}
}

// TestFencing: once a second owner opens the VDI with a higher token, the
// first owner cannot change a byte, and its error says why.
func TestFencing(t *testing.T) {
	c := newCluster(t, 3, 1)
	old := c.open(t, nil, 10, 8<<20, 3)
	if _, err := old.WriteAt(ctx, fill(4, 4096), 0, 0); err != nil {
		t.Fatal(err)
	}
	nw := c.open(t, nil, 11, 8<<20, 3)
	want := readAll(t, nw)
	_, err := old.WriteAt(ctx, fill(5, 4096), 0, 0)
	if protocol.StatusOf(err) != protocol.StatusStaleToken {
		t.Fatalf("write by a fenced owner: %v, want StatusStaleToken", err)
	}
	// The refusal revoked the device: later writes fail at once, read-only.
	c.net.reset()
	if err := old.WriteZeroes(ctx, 0, 8<<20, 0); !errors.Is(err, gateway.ErrRevoked) || !errors.Is(err, block.ErrReadOnly) {
		t.Fatalf("zero write by a fenced owner: %v, want ErrRevoked", err)
	}
	if n := c.net.get("write-zeroes") + c.net.get("write"); n != 0 {
		t.Fatalf("%d requests of a revoked owner reached a node", n)
	}
	if got := readAll(t, nw); !bytes.Equal(got, want) {
		t.Fatal("the fenced owner changed data")
	}
	if _, err := nw.WriteAt(ctx, fill(6, 4096), 0, 0); err != nil {
		t.Fatalf("the new owner's write: %v", err)
	}
	// A read-only device refuses writes itself.
	ro := c.open(t, nil, 0, 8<<20, 3)
	if _, err := ro.WriteAt(ctx, []byte{1}, 0, 0); !errors.Is(err, block.ErrReadOnly) {
		t.Fatalf("write to a read-only device: %v", err)
	}
}

// TestReadFallback: with one replica's node dead, every read still
// succeeds from the others; a write fails rather than being acknowledged
// with a copy missing.
func TestReadFallback(t *testing.T) {
	c := newCluster(t, 3, 1)
	d := c.open(t, nil, 1, 4<<20, 3)
	want := fill(7, 4<<20)
	if _, err := d.WriteAt(ctx, want, 0, 0); err != nil {
		t.Fatal(err)
	}
	if err := d.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	c.nodes[0].stop(t) // the local node, read first
	if got := readAll(t, d); !bytes.Equal(got, want) {
		t.Fatal("read with the local node dead differs")
	}
	if _, err := d.WriteAt(ctx, []byte{1}, 0, 0); err == nil {
		t.Fatal("a write with a replica dead was acknowledged")
	}
}

// TestRange: requests past the end fail before reaching a node.
func TestRange(t *testing.T) {
	c := newCluster(t, 1, 1)
	d := c.open(t, nil, 1, 1<<20, 1)
	c.net.reset()
	if _, err := d.WriteAt(ctx, make([]byte, 2), 1<<20-1, 0); !errors.Is(err, block.ErrOutOfRange) {
		t.Errorf("write past the end: %v", err)
	}
	if _, err := d.ReadAt(ctx, make([]byte, 1), 1<<20); !errors.Is(err, block.ErrOutOfRange) {
		t.Errorf("read past the end: %v", err)
	}
	if n := c.net.get("write") + c.net.get("read"); n != 0 {
		t.Errorf("%d requests reached a node", n)
	}
	if _, err := gateway.Open(ctx, gateway.Config{VDI: 1, Size: 1, Copies: 1, ObjectShift: 12, Views: view.Static{V: c.view}, Net: c.net}); err == nil {
		t.Error("an object size of 4 KiB was accepted")
	}
}

// TestLeaseLost: a node whose lease may have expired serves no object,
// and a gateway whose lock's lease may have expired writes nothing.
func TestLeaseLost(t *testing.T) {
	c := newCluster(t, 1, 1)
	var live atomic.Bool
	live.Store(true)
	d, err := gateway.Open(ctx, gateway.Config{VDI: 7, Name: "test", Size: 1 << 20, Copies: 1, ObjectShift: object.MinSizeShift,
		Owner: owner.New(owner.Config{Token: 1, Valid: func(time.Time) bool { return live.Load() }}), Views: view.Static{V: c.view}, Net: c.net})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	if _, err := d.WriteAt(ctx, []byte{1}, 0, 0); err != nil {
		t.Fatal(err)
	}
	live.Store(false)
	c.net.reset()
	if _, err := d.WriteAt(ctx, []byte{2}, 0, 0); !errors.Is(err, gateway.ErrLeaseLost) {
		t.Fatalf("write after the lease was lost: %v, want ErrLeaseLost", err)
	}
	if n := c.net.get("write"); n != 0 {
		t.Errorf("%d writes reached a node after the lease was lost", n)
	}

	// The node side: a handler whose lease is gone refuses everything
	// but HELLO.
	st, err := store.Open(t.TempDir(), store.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	h := &node.Handler{Store: st, Epochs: newEpoch(1), Live: func(time.Time) bool { return false }}
	for _, op := range []protocol.Op{protocol.OpWrite, protocol.OpRead, protocol.OpFlush, protocol.OpFence} {
		req := &protocol.Request{Op: op, Epoch: 1, Token: 5, Object: object.Make(7, 0)}
		if op == protocol.OpWrite {
			req.Payload, req.Length = []byte{1}, 1
		}
		if op == protocol.OpRead {
			req.Length = 1
		}
		var resp protocol.Response
		h.Serve(ctx, req, &resp)
		if resp.Status != protocol.StatusShutdown {
			t.Errorf("%s at a node that lost its lease: status %s, want %s", op, resp.Status, protocol.StatusShutdown)
		}
	}
	if _, err := st.Stat(object.Make(7, 0)); !errors.Is(err, store.ErrNotFound) {
		t.Errorf("the refused write reached the store: %v", err)
	}
}
