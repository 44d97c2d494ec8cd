package protocol

import (
	"context"
	"errors"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ovis-storage/ovis/cluster/object"
)

// TestPoolReuse: concurrent calls to one address share one dial.
func TestPoolReuse(t *testing.T) {
	noLeaks(t)
	ts := startServer(t, "pipe", &echoHandler{maxSleep: time.Millisecond}, ServerOptions{})
	p := NewPool(ts.dial)
	defer p.Close()
	var wg sync.WaitGroup
	for i := range 200 {
		wg.Go(func() {
			var resp Response
			if err := p.Call(ctx, ts.addr, &Request{Op: OpStat, Object: object.ID(i)}, &resp); err != nil {
				t.Error(err)
			}
		})
	}
	wg.Wait()
	if got := ts.pipe.dials.Load(); got != 1 {
		t.Fatalf("%d dials for 200 calls, want 1", got)
	}
}

// waitDead waits until the pool's connection to addr has failed.
func waitDead(t *testing.T, p *Pool, addr string) {
	t.Helper()
	p.mu.Lock()
	pe := p.mu.peers[addr]
	p.mu.Unlock()
	pe.mu.Lock()
	c := pe.client
	pe.mu.Unlock()
	select {
	case <-c.done:
	case <-time.After(5 * time.Second):
		t.Fatal("connection not seen to fail")
	}
}

// TestPoolRedial: after the server restarts the next call dials again
// and succeeds.
func TestPoolRedial(t *testing.T) {
	noLeaks(t)
	var current atomic.Pointer[testServer]
	var dials atomic.Int32
	dial := func(ctx context.Context, addr string) (net.Conn, error) {
		dials.Add(1)
		return current.Load().dial(ctx, addr)
	}
	p := NewPool(dial)
	defer p.Close()
	var resp Response
	for gen := range 3 {
		ts := startServer(t, "pipe", &echoHandler{}, ServerOptions{})
		current.Store(ts)
		for range 5 {
			if err := p.Call(ctx, "node", &Request{Op: OpStat, Object: 1}, &resp); err != nil {
				t.Fatalf("generation %d: %v", gen, err)
			}
		}
		if got := dials.Load(); got != int32(gen+1) {
			t.Fatalf("generation %d: %d dials", gen, got)
		}
		ts.stop(t)
		waitDead(t, p, "node")
	}
}

// TestPoolRetryNotSent: a kept connection that died unnoticed costs no
// error: the call was not sent and is retried once on a new one.
func TestPoolRetryNotSent(t *testing.T) {
	noLeaks(t)
	ts := startServer(t, "pipe", &echoHandler{}, ServerOptions{})
	p := NewPool(ts.dial)
	defer p.Close()
	var resp Response
	if err := p.Call(ctx, ts.addr, &Request{Op: OpStat}, &resp); err != nil {
		t.Fatal(err)
	}
	// Kill the connection under the pool without it seeing a failed call.
	p.mu.Lock()
	c := p.mu.peers[ts.addr].client
	p.mu.Unlock()
	c.fail(errors.New("test: connection cut"))
	if err := p.Call(ctx, ts.addr, &Request{Op: OpStat}, &resp); err != nil {
		t.Fatalf("call after the cut: %v", err)
	}
	if got := ts.pipe.dials.Load(); got != 2 {
		t.Fatalf("%d dials, want 2", got)
	}
}

// TestPoolDialError: a failed dial names the address; the next call
// dials again.
func TestPoolDialError(t *testing.T) {
	noLeaks(t)
	ts := startServer(t, "pipe", &echoHandler{}, ServerOptions{})
	var fail atomic.Bool
	fail.Store(true)
	p := NewPool(func(ctx context.Context, addr string) (net.Conn, error) {
		if fail.Load() {
			return nil, errors.New("no route to host")
		}
		return ts.dial(ctx, addr)
	})
	var resp Response
	err := p.Call(ctx, "10.1.2.3:7000", &Request{Op: OpStat}, &resp)
	if err == nil || !strings.Contains(err.Error(), "10.1.2.3:7000") || !strings.Contains(err.Error(), "no route") {
		t.Fatalf("dial error: %v", err)
	}
	fail.Store(false)
	if err := p.Call(ctx, "10.1.2.3:7000", &Request{Op: OpStat}, &resp); err != nil {
		t.Fatal(err)
	}
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
	if err := p.Call(ctx, "10.1.2.3:7000", &Request{Op: OpStat}, &resp); err != ErrClosed {
		t.Fatalf("call after Close: %v", err)
	}
	if err := p.Close(); err != ErrClosed {
		t.Fatalf("second Close: %v", err)
	}
}

// TestPoolDefaultDialer: a nil Dialer dials TCP.
func TestPoolDefaultDialer(t *testing.T) {
	noLeaks(t)
	ts := startServer(t, "tcp", &echoHandler{}, ServerOptions{})
	p := NewPool(nil)
	defer p.Close()
	var resp Response
	if err := p.Call(ctx, ts.addr, &Request{Op: OpRead, Object: 4, Length: 10}, &resp); err != nil || len(resp.Payload) != 10 {
		t.Fatalf("%v %+v", err, resp)
	}
}

// TestPoolDrop: Drop closes the connection to an address; the next
// call dials again.
func TestPoolDrop(t *testing.T) {
	noLeaks(t)
	ts := startServer(t, "pipe", &echoHandler{}, ServerOptions{})
	p := NewPool(ts.dial)
	defer p.Close()
	var resp Response
	for round := 1; round <= 2; round++ {
		if err := p.Call(ctx, ts.addr, &Request{Op: OpStat}, &resp); err != nil {
			t.Fatal(err)
		}
		if got := ts.pipe.dials.Load(); got != int32(round) {
			t.Fatalf("round %d: %d dials", round, got)
		}
		p.Drop(ts.addr)
	}
	p.Drop("never-dialed")
}
