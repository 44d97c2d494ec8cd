package gateway_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/ovis-storage/ovis/cluster/gateway"
	"github.com/ovis-storage/ovis/cluster/object"
	"github.com/ovis-storage/ovis/cluster/owner"
	"github.com/ovis-storage/ovis/cluster/view"
)

// lease is a node's lease as the gateway sees it: live or not, and a
// wait for it to come back.
type lease struct {
	mu   sync.Mutex
	live bool
	back chan struct{}
}

func newLease() *lease {
	l := &lease{live: true, back: make(chan struct{})}
	close(l.back)
	return l
}

func (l *lease) Valid(time.Time) bool { l.mu.Lock(); defer l.mu.Unlock(); return l.live }

func (l *lease) set(live bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if live == l.live {
		return
	}
	if l.live = live; live {
		close(l.back)
	} else {
		l.back = make(chan struct{})
	}
}

func (l *lease) Await(ctx context.Context) error {
	l.mu.Lock()
	back := l.back
	l.mu.Unlock()
	select {
	case <-back:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// TestRejoin walks a writable device and its owner through its node
// losing the lease and rejoining: a write waits while the lease is gone
// (no error, no request); once the owner is suspended a new write is
// held until the lock is taken again (Fence, then owner.Retaken), and
// then goes with the new token, which every node now demands (the old
// one is refused); a refused relock fails later writes with
// ErrLeaseLost and keeps reads; Abandon lets held requests go, failing.
func TestRejoin(t *testing.T) {
	c := newCluster(t, 3, 1)
	l := newLease()
	open := func(token uint64) (*gateway.Device, *owner.Authority) {
		own := owner.New(owner.Config{Token: token, Valid: l.Valid, AwaitValid: l.Await})
		d, err := gateway.Open(ctx, gateway.Config{VDI: 7, Name: "test", Size: 8 << 20, Copies: 3, ObjectShift: object.MinSizeShift,
			Owner: own, Views: view.Static{V: c.view}, Net: c.net, Local: c.nodes[0].id, RetryTimeout: 5 * time.Second})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { d.Close() })
		return d, own
	}
	d, own := open(10)
	write := func(d *gateway.Device, b byte) <-chan error {
		done := make(chan error, 1)
		go func() {
			_, err := d.WriteAt(ctx, []byte{b}, 0, 0)
			done <- err
		}()
		return done
	}
	pending := func(done <-chan error, what string) {
		t.Helper()
		select {
		case err := <-done:
			t.Fatalf("%s returned %v, want it to wait", what, err)
		case <-time.After(200 * time.Millisecond):
		}
	}
	result := func(done <-chan error) error {
		t.Helper()
		select {
		case err := <-done:
			return err
		case <-time.After(10 * time.Second):
			t.Fatal("a request still waits after 10 s")
			return nil
		}
	}

	// The lease goes: a write waits, and reaches no node.
	l.set(false)
	c.net.reset()
	w := write(d, 1)
	pending(w, "a write while the lease is gone")
	if n := c.net.get("write"); n != 0 {
		t.Fatalf("%d writes reached a node while the lease was gone", n)
	}
	// The node rejoins and suspends the device while it takes the lock
	// again: the waiting write goes on (old token); a new one is held.
	own.Apply(owner.Event{Kind: owner.LeaseLost})
	l.set(true)
	if err := result(w); err != nil {
		t.Fatalf("the write that waited for the lease: %v", err)
	}
	w = write(d, 2)
	pending(w, "a write while the device is suspended")
	own.Apply(owner.Event{Kind: owner.Rejoined})
	pending(w, "a write while the lock is taken again")
	if err := d.Fence(ctx, 20); err != nil {
		t.Fatal(err)
	}
	if !own.Apply(owner.Event{Kind: owner.Retaken, Token: 20}) {
		t.Fatal("the owner did not take token 20")
	}
	if err := result(w); err != nil {
		t.Fatalf("the write held for the relock: %v", err)
	}
	// Every node now refuses the old token.
	if _, err := open2(t, c, 10); err == nil {
		t.Fatal("a device at the old token was opened after the fence of the new one")
	}

	// Lost: writes fail, reads go on.
	own.Apply(owner.Event{Kind: owner.LeaseLost})
	w = write(d, 3)
	pending(w, "a write while the device is suspended again")
	own.Apply(owner.Event{Kind: owner.Refused, Why: errors.New("taken over")})
	if err := result(w); !errors.Is(err, gateway.ErrLeaseLost) {
		t.Fatalf("the held write after the relock was refused: %v, want ErrLeaseLost", err)
	}
	b := make([]byte, 1)
	if _, err := d.ReadAt(ctx, b, 0); err != nil || b[0] != 2 {
		t.Fatalf("read after the loss: %v, byte %d, want 2", err, b[0])
	}

	// Abandon: a device held for a relock that will not come.
	e, eown := open(30)
	eown.Apply(owner.Event{Kind: owner.LeaseLost})
	w = write(e, 4)
	pending(w, "a write on a suspended device")
	eown.Apply(owner.Event{Kind: owner.Abandon, Why: errors.New("closing")})
	if err := result(w); !errors.Is(err, gateway.ErrLeaseLost) {
		t.Fatalf("the held write after Abandon: %v, want ErrLeaseLost", err)
	}
	if _, err := e.WriteAt(ctx, []byte{5}, 0, 0); !errors.Is(err, gateway.ErrLeaseLost) {
		t.Fatalf("a write after Abandon: %v, want ErrLeaseLost", err)
	}
}

// open2 opens a writable device at token without failing the test.
func open2(t *testing.T, c *cluster, token uint64) (*gateway.Device, error) {
	return gateway.Open(ctx, gateway.Config{VDI: 7, Name: "test", Size: 8 << 20, Copies: 3, ObjectShift: object.MinSizeShift,
		Token: token, Views: view.Static{V: c.view}, Net: c.net, Local: c.nodes[0].id, RetryTimeout: time.Second})
}
