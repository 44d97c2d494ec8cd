package gateway_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/ovis-storage/ovis/cluster/gateway"
	"github.com/ovis-storage/ovis/cluster/object"
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

// TestRejoin walks a writable device through its node losing the lease
// and rejoining: a write waits while the lease is gone (no error, no
// request); after Suspend a new write is held until Retoken, and then
// goes with the new token, which every node now demands (the old one is
// refused); Lose fails later writes with ErrLeaseLost and keeps reads;
// Abandon lets held requests go, failing.
func TestRejoin(t *testing.T) {
	c := newCluster(t, 3, 1)
	l := newLease()
	open := func(token uint64) *gateway.Device {
		d, err := gateway.Open(ctx, gateway.Config{VDI: 7, Name: "test", Size: 8 << 20, Copies: 3, ObjectShift: object.MinSizeShift,
			Token: token, Views: gateway.StaticViews{V: c.view}, Net: c.net, Local: c.nodes[0].id, RetryTimeout: 5 * time.Second,
			Live: l.Valid, AwaitLive: l.Await})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { d.Close() })
		return d
	}
	d := open(10)
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
	d.Suspend()
	l.set(true)
	if err := result(w); err != nil {
		t.Fatalf("the write that waited for the lease: %v", err)
	}
	w = write(d, 2)
	pending(w, "a write while the device is suspended")
	if err := d.Retoken(ctx, 20); err != nil {
		t.Fatal(err)
	}
	if err := result(w); err != nil {
		t.Fatalf("the write held for the relock: %v", err)
	}
	// Every node now refuses the old token.
	if _, err := open2(t, c, 10); err == nil {
		t.Fatal("a device at the old token was opened after Retoken")
	}

	// Lost: writes fail, reads go on.
	d.Suspend()
	w = write(d, 3)
	pending(w, "a write while the device is suspended again")
	d.Lose(errors.New("taken over"))
	if err := result(w); !errors.Is(err, gateway.ErrLeaseLost) {
		t.Fatalf("the held write after Lose: %v, want ErrLeaseLost", err)
	}
	b := make([]byte, 1)
	if _, err := d.ReadAt(ctx, b, 0); err != nil || b[0] != 2 {
		t.Fatalf("read after Lose: %v, byte %d, want 2", err, b[0])
	}

	// Abandon: a device held for a relock that will not come.
	e := open(30)
	e.Suspend()
	w = write(e, 4)
	pending(w, "a write on a suspended device")
	e.Abandon(errors.New("closing"))
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
		Token: token, Views: gateway.StaticViews{V: c.view}, Net: c.net, Local: c.nodes[0].id, RetryTimeout: time.Second})
}
