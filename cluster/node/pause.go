package node

import (
	"context"
	"fmt"
	"sync/atomic"
	"time"
)

// pauseGuard notices that this process may have been paused (SIGSTOP, a
// frozen VM, a stall of the whole runtime) and makes the store learn
// the VDIs' locks again before it takes another write.
//
// Why: a new owner sends its token to every node (gateway invariant 5),
// but a node that was paused gets it only when it runs again, and then
// in no particular order with the other requests it finds waiting,
// among them writes of the old owner (its own gateway's, if the paused
// node held the lock). Without this, such a write can land on the
// paused node's copy before the fence does: it is never acknowledged
// (the other replicas refuse it), but that copy keeps it.
//
// A ticker records the time every gap/4; a write that finds the last
// tick older than gap (or a pause the ticker saw that no resync has
// covered yet) raises the store's tokens from the locks in etcd first
// (resync, a linearizable read made after the pause ended, which sees
// any lock broken and taken meanwhile). Pauses shorter than gap are not
// seen. A busy machine that delays the ticker costs a resync, never a
// refused write.
//
// Time is the monotonic clock, read through now (a test sets it). Safe
// for concurrent use; no lock is held at all.
type pauseGuard struct {
	gap    time.Duration
	now    func() time.Duration // monotonic time since some start
	resync func(ctx context.Context) error

	last      atomic.Int64  // now() at the last tick or resync
	pauses    atomic.Uint64 // pauses seen
	confirmed atomic.Uint64 // pauses a successful resync began after
}

// newPauseGuard returns a guard with gap, calling resync; its clock
// starts now.
func newPauseGuard(gap time.Duration, resync func(ctx context.Context) error) *pauseGuard {
	start := time.Now()
	g := &pauseGuard{gap: gap, resync: resync, now: func() time.Duration { return time.Since(start) }}
	g.last.Store(int64(g.now()))
	return g
}

// tick records that the process runs, counting a pause first when the
// last tick is older than gap.
func (g *pauseGuard) tick() {
	now := int64(g.now())
	if now-g.last.Load() > int64(g.gap) {
		g.pauses.Add(1) // before last moves on, so that check sees one or the other
	}
	g.raiseLast(now)
}

func (g *pauseGuard) raiseLast(now int64) {
	for {
		l := g.last.Load()
		if now <= l || g.last.CompareAndSwap(l, now) {
			return
		}
	}
}

// run ticks every gap/4 until ctx ends.
func (g *pauseGuard) run(ctx context.Context) { ticking(ctx, g.gap/4, g.tick) }

// check returns at once unless a pause may have happened that no resync
// has covered; it then resyncs first. It is Handler.Resync.
func (g *pauseGuard) check(ctx context.Context) error {
	began := int64(g.now())
	if began-g.last.Load() > int64(g.gap) {
		g.pauses.Add(1)
	}
	p := g.pauses.Load()
	if g.confirmed.Load() >= p {
		return nil
	}
	if err := g.resync(ctx); err != nil {
		return fmt.Errorf("node: raising the tokens after a pause: %w", err)
	}
	g.raiseLast(began)
	for {
		c := g.confirmed.Load()
		if c >= p || g.confirmed.CompareAndSwap(c, p) {
			return nil
		}
	}
}
