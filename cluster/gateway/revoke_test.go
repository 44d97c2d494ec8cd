package gateway_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ovis-storage/ovis/block"
	"github.com/ovis-storage/ovis/cluster/gateway"
	"github.com/ovis-storage/ovis/cluster/object"
	"github.com/ovis-storage/ovis/cluster/owner"
	"github.com/ovis-storage/ovis/cluster/protocol"
	"github.com/ovis-storage/ovis/cluster/view"
)

// stalling is a Caller whose calls to one address wait, as on a node
// stopped with SIGSTOP (its kernel takes the bytes, nobody answers),
// until resume or until the call's context ends.
type stalling struct {
	next gateway.Caller
	addr string

	mu      sync.Mutex
	resumed chan struct{}
}

func (s *stalling) Call(ctx context.Context, addr string, req *protocol.Request, resp *protocol.Response) error {
	s.mu.Lock()
	resumed := s.resumed
	s.mu.Unlock()
	if addr == s.addr {
		select {
		case <-resumed:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return s.next.Call(ctx, addr, req, resp)
}

func (s *stalling) resume() {
	s.mu.Lock()
	defer s.mu.Unlock()
	close(s.resumed)
}

// TestRevokedOnStaleToken: a writable device refused for a stale token
// (another owner took the lock) revokes its owner: the write that met
// the refusal and every later one fail with ErrRevoked (EPERM over
// NBD), the later ones before reaching any node; the owner moves once;
// reads go on; Flush of what was written before still works.
func TestRevokedOnStaleToken(t *testing.T) {
	c := newCluster(t, 3, 1)
	var told atomic.Int32
	own := owner.New(owner.Config{Token: 10, Changed: func(_ owner.Machine, e owner.Event, to owner.Machine) {
		told.Add(1)
		if e.Kind != owner.Stale || to.State != owner.Revoked || protocol.StatusOf(e.Why) != protocol.StatusStaleToken {
			t.Errorf("the owner moved by %s (%v) to %s, want revoked by the stale-token refusal", e.Kind, e.Why, to.State)
		}
	}})
	old, err := gateway.Open(ctx, gateway.Config{VDI: 7, Name: "test", Size: 8 << 20, Copies: 3, ObjectShift: object.MinSizeShift,
		Owner: own, Views: view.Static{V: c.view}, Net: c.net, Local: c.nodes[0].id, RetryTimeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer old.Close()
	want := fill(1, 4096)
	if _, err := old.WriteAt(ctx, want, 0, 0); err != nil {
		t.Fatal(err)
	}
	if own.Lost() != nil {
		t.Fatalf("an owner that may write says %v", own.Lost())
	}
	c.open(t, nil, 11, 8<<20, 3) // the new owner
	_, err = old.WriteAt(ctx, fill(2, 4096), 4096, 0)
	if !errors.Is(err, gateway.ErrRevoked) || !errors.Is(err, block.ErrReadOnly) || protocol.StatusOf(err) != protocol.StatusStaleToken {
		t.Fatalf("the write refused for its token: %v, want ErrRevoked wrapping the refusal", err)
	}
	if !errors.Is(own.Lost(), gateway.ErrRevoked) || told.Load() != 1 {
		t.Fatalf("after the refusal: Lost() %v, the owner moved %d times", own.Lost(), told.Load())
	}
	c.net.reset()
	start := time.Now()
	for i := range 10 {
		if _, err := old.WriteAt(ctx, []byte{byte(i)}, 0, block.FUA); !errors.Is(err, gateway.ErrRevoked) {
			t.Fatalf("write %d after the revocation: %v, want ErrRevoked", i, err)
		}
	}
	if err := old.Discard(ctx, 0, 1<<20, 0); !errors.Is(err, gateway.ErrRevoked) {
		t.Fatalf("discard after the revocation: %v", err)
	}
	if d := time.Since(start); d > time.Second {
		t.Errorf("11 refused requests took %v: they do not fail fast", d)
	}
	if n := c.net.get("write") + c.net.get("discard") + c.net.get("remove"); n != 0 {
		t.Errorf("%d requests of the revoked device reached a node", n)
	}
	if told.Load() != 1 {
		t.Errorf("the owner moved %d times, want once", told.Load())
	}
	got := make([]byte, 4096)
	if _, err := old.ReadAt(ctx, got, 0); err != nil || string(got) != string(want) {
		t.Fatalf("read through the revoked device: %v (data equal: %v)", err, string(got) == string(want))
	}
	if err := old.Flush(ctx); err != nil {
		t.Errorf("flush of the revoked device's earlier writes: %v", err)
	}
}

// TestRevoke: the lock broken while the device is suspended (the node
// saw it in etcd: owner.Broken) makes writes fail at once with
// ErrRevoked, reaching no node, lets the held requests go (their writes
// failing) and keeps reads; a later loss keeps the first reason.
func TestRevoke(t *testing.T) {
	c := newCluster(t, 1, 1)
	own := owner.New(owner.Config{Token: 5})
	d, err := gateway.Open(ctx, gateway.Config{VDI: 7, Name: "test", Size: 1 << 20, Copies: 1, ObjectShift: object.MinSizeShift,
		Owner: own, Views: view.Static{V: c.view}, Net: c.net})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	if _, err := d.WriteAt(ctx, []byte{9}, 0, 0); err != nil {
		t.Fatal(err)
	}
	own.Apply(owner.Event{Kind: owner.LeaseLost})
	held := make(chan error, 1)
	go func() {
		_, err := d.WriteAt(ctx, []byte{1}, 0, 0)
		held <- err
	}()
	select {
	case err := <-held:
		t.Fatalf("a write on a suspended device returned %v", err)
	case <-time.After(100 * time.Millisecond):
	}
	c.net.reset()
	own.Apply(owner.Event{Kind: owner.Broken, Why: errors.New("lock broken")})
	select {
	case err := <-held:
		if !errors.Is(err, gateway.ErrRevoked) {
			t.Fatalf("the held write: %v, want ErrRevoked", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the held write still waits after Revoke")
	}
	if _, err := d.WriteAt(ctx, []byte{2}, 0, 0); !errors.Is(err, gateway.ErrRevoked) {
		t.Fatalf("a write after Revoke: %v", err)
	}
	own.Apply(owner.Event{Kind: owner.Abandon, Why: errors.New("later")})
	if err := own.Lost(); !errors.Is(err, gateway.ErrRevoked) || errors.Is(err, gateway.ErrLeaseLost) {
		t.Fatalf("after Revoke then Lose: %v, want the first reason", err)
	}
	if n := c.net.get("write"); n != 0 {
		t.Errorf("%d writes reached a node after Revoke", n)
	}
	b := make([]byte, 1)
	if _, err := d.ReadAt(ctx, b, 0); err != nil || b[0] != 9 {
		t.Fatalf("read after Revoke: %v, %d", err, b[0])
	}
}

// TestOpenDoesNotWaitForSilentNode: a new owner's Open does not wait for
// a node that takes requests but never answers (stopped with SIGSTOP):
// it returns after FenceWait, writes to objects that node does not hold
// succeed at once, a write to one it holds waits for it. Once the node
// answers it gets the token in the background, before the waiting
// write, and refuses the old owner from then on.
func TestOpenDoesNotWaitForSilentNode(t *testing.T) {
	c := newCluster(t, 3, 1)
	silent := c.nodes[2]
	net := &stalling{next: c.net, addr: silent.addr, resumed: make(chan struct{})}
	const fenceWait = 100 * time.Millisecond
	start := time.Now()
	d, err := gateway.Open(ctx, gateway.Config{VDI: 7, Name: "test", Size: 64 << 20, Copies: 2, ObjectShift: object.MinSizeShift,
		Token: 20, Views: view.Static{V: c.view}, Net: net, Local: c.nodes[0].id, RetryTimeout: 30 * time.Second,
		FenceWait: fenceWait})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	if took := time.Since(start); took < fenceWait || took > fenceWait+2*time.Second {
		t.Fatalf("Open took %v with a silent node, want about FenceWait (%v)", took, fenceWait)
	}
	// The answering nodes take it: by the time Open returns on a quiet
	// machine, within a few seconds on a loaded one (Open waits at most
	// FenceWait for anyone; the fences go on in the background).
	for _, n := range c.nodes[:2] {
		deadline := time.Now().Add(5 * time.Second)
		for n.st.Token(7) != 20 && time.Now().Before(deadline) {
			time.Sleep(10 * time.Millisecond)
		}
		if tok := n.st.Token(7); tok != 20 {
			t.Fatalf("node %s has token %d 5 s after Open, want 20", n.id, tok)
		}
	}
	// Objects by whether the silent node holds them (copies 2 of 3).
	var free, held int64 = -1, -1
	for i := int64(0); i < 64 && (free < 0 || held < 0); i++ {
		nodes, err := c.view.Map.Place(object.Make(7, uint32(i)), 2, nil)
		if err != nil {
			t.Fatal(err)
		}
		on := nodes[0] == silent.id || nodes[1] == silent.id
		switch {
		case on && held < 0:
			held = i
		case !on && free < 0:
			free = i
		}
	}
	if free < 0 || held < 0 {
		t.Fatal("no object on and off the silent node")
	}
	wstart := time.Now()
	if _, err := d.WriteAt(ctx, fill(3, 4096), free<<object.MinSizeShift, block.FUA); err != nil {
		t.Fatalf("write of an object the silent node does not hold: %v", err)
	}
	if took := time.Since(wstart); took > time.Second {
		t.Errorf("the write took %v with a silent node that does not hold it", took)
	}
	waiting := make(chan error, 1)
	go func() {
		_, err := d.WriteAt(ctx, fill(4, 4096), held<<object.MinSizeShift, block.FUA)
		waiting <- err
	}()
	select {
	case err := <-waiting:
		t.Fatalf("a write to the silent node's object returned %v before it answered", err)
	case <-time.After(200 * time.Millisecond):
	}
	if tok := silent.st.Token(7); tok != 0 {
		t.Fatalf("the silent node has token %d before it answered", tok)
	}
	net.resume()
	select {
	case err := <-waiting:
		if err != nil {
			t.Fatalf("the write after the node answered: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the write still waits 10 s after the node answered")
	}
	waitFor(t, func() bool { return silent.st.Token(7) == 20 })
	// The old owner's token is refused everywhere now.
	if _, err := open2(t, c, 19); protocol.StatusOf(err) != protocol.StatusStaleToken || !errors.Is(err, gateway.ErrRevoked) {
		t.Fatalf("opening at the old token: %v, want a stale-token refusal", err)
	}
}

// waitFor polls cond for up to 10 s.
func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal("condition not met in 10 s")
		}
		time.Sleep(10 * time.Millisecond)
	}
}
