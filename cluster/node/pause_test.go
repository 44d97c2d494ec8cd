package node

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ovis-storage/ovis/cluster/object"
	"github.com/ovis-storage/ovis/cluster/protocol"
	"github.com/ovis-storage/ovis/cluster/store"
)

// fakeClock is a monotonic clock the test moves.
type fakeClock struct{ t atomic.Int64 }

func (c *fakeClock) now() time.Duration  { return time.Duration(c.t.Load()) }
func (c *fakeClock) add(d time.Duration) { c.t.Add(int64(d)) }
func guardAt(c *fakeClock, gap time.Duration, resync func(context.Context) error) *pauseGuard {
	g := &pauseGuard{gap: gap, now: c.now, resync: resync}
	g.last.Store(int64(c.now()))
	return g
}

// TestPauseGuard: no resync while the ticker keeps up; one after a gap
// longer than the guard's, seen by the write itself or by the ticker
// first; a failed resync refuses and is tried again by the next write.
func TestPauseGuard(t *testing.T) {
	var clock fakeClock
	var resyncs atomic.Int32
	fail := false
	g := guardAt(&clock, 200*time.Millisecond, func(context.Context) error {
		resyncs.Add(1)
		if fail {
			return errors.New("etcd away")
		}
		return nil
	})
	step := func(d time.Duration, want int32) {
		t.Helper()
		clock.add(d)
		if err := g.check(context.Background()); err != nil {
			t.Fatalf("check after %v: %v", d, err)
		}
		if got := resyncs.Load(); got != want {
			t.Fatalf("after %v: %d resyncs, want %d", d, got, want)
		}
	}
	// Ticking every 50 ms: nothing to do.
	for range 10 {
		step(50*time.Millisecond, 0)
		g.tick()
	}
	step(150*time.Millisecond, 0) // within the gap
	g.tick()
	// A pause the write sees first (the ticker did not run since).
	step(2*time.Second, 1)
	step(10*time.Millisecond, 1) // covered: the resync moved last on
	// A pause the ticker sees first: the write still resyncs.
	clock.add(time.Second)
	g.tick()
	step(0, 2)
	step(0, 2)
	// A failed resync refuses the write; the next one tries again.
	clock.add(time.Second)
	fail = true
	if err := g.check(context.Background()); err == nil {
		t.Fatal("check with a failing resync succeeded")
	}
	fail = false
	step(0, 4)
	step(50*time.Millisecond, 4)
}

// TestHandlerResyncsBeforeWrites: a write reaches the store only after
// Resync, which can refuse it (StatusShutdown) or raise the token that
// then refuses it (the old owner's write after a pause); reads do not
// resync.
func TestHandlerResyncsBeforeWrites(t *testing.T) {
	st, err := store.Open(t.TempDir(), store.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	obj := object.Make(7, 0)
	var resyncs atomic.Int32
	var resync func(context.Context) error
	h := &Handler{Store: st, Epochs: &movingEpoch{e: 1}, Resync: func(ctx context.Context) error {
		resyncs.Add(1)
		return resync(ctx)
	}}
	write := func(token uint64, b byte) protocol.Status {
		var resp protocol.Response
		h.Serve(context.Background(), &protocol.Request{Op: protocol.OpWrite, Epoch: 1, Token: token, Object: obj, Length: 1, Payload: []byte{b}}, &resp)
		return resp.Status
	}
	read := func() byte {
		t.Helper()
		var resp protocol.Response
		h.Serve(context.Background(), &protocol.Request{Op: protocol.OpRead, Epoch: 1, Object: obj, Length: 1}, &resp)
		if resp.Status != protocol.StatusOK || len(resp.Payload) != 1 {
			t.Fatalf("read: %s", resp.Status)
		}
		return resp.Payload[0]
	}
	resync = func(context.Context) error { return nil }
	if s := write(5, 1); s != protocol.StatusOK {
		t.Fatalf("write: %s", s)
	}
	resync = func(context.Context) error { return errors.New("etcd away") }
	if s := write(5, 2); s != protocol.StatusShutdown {
		t.Fatalf("write with a failing resync: %s, want %s", s, protocol.StatusShutdown)
	}
	// The locks say another owner has token 9 now.
	resync = func(context.Context) error { return st.Fence(7, 9) }
	if s := write(5, 3); s != protocol.StatusStaleToken {
		t.Fatalf("the old owner's write after the resync: %s, want %s", s, protocol.StatusStaleToken)
	}
	n := resyncs.Load()
	if b := read(); b != 1 {
		t.Fatalf("the copy holds %d, want 1: a refused write landed", b)
	}
	if resyncs.Load() != n {
		t.Error("a read resynced")
	}
	if s := write(9, 4); s != protocol.StatusOK || read() != 4 {
		t.Fatalf("the new owner's write: %s", s)
	}
}
