package node

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/ovis-storage/ovis/cluster/membership"
)

// The node's membership: it registers at start, and again by itself
// whenever its lease is lost (etcd unreachable for longer than the
// lease, its quorum lost, a partition), so that I/O resumes once etcd is
// back, with no restart.
//
// While the lease does not hold, the handler refuses every request on
// objects (StatusShutdown, which other gateways retry) and this node's
// gateway requests wait (owner.Config.AwaitValid). Rejoining is, in
// order: a new registration (a dead one of this node, at this address,
// is evicted: this process holds the data directory, so it is ours);
// every store token raised to its lock's (fenceFromLocks); the new
// registration made the node's (the handler serves again, and requests
// under way go on); then the locks of the VDIs open writable here taken
// again, each kept only if no other owner took the VDI meanwhile
// (vdis.relock), while new requests on them are held (their machines
// are Suspended, then Relocking: cluster/owner). The recovery of
// the epoch the rejoin makes brings the node's copies up to date; copies
// it changed while cut off rank below the others' (cluster/recovery).

// register joins the membership under a new lease.
func (n *Node) register(ctx context.Context) (*membership.Registration, error) {
	info := membership.NodeInfo{ID: n.id, Addr: n.addr, Zone: n.cfg.Zone, Weight: n.cfg.Weight, Full: n.full.Load()}
	reg, err := n.mc.Join(ctx, info, n.cfg.LeaseTTL)
	if errors.Is(err, membership.ErrDuplicateNode) {
		// This process holds the data directory's lock, so a registration
		// of this node at this address is a dead process's (a crash, a
		// kill) or this one's lost one: end it rather than wait out its
		// lease.
		if ok, eerr := n.mc.Evict(ctx, n.id, n.addr); eerr == nil && ok {
			reg, err = n.mc.Join(ctx, info, n.cfg.LeaseTTL)
		}
	}
	if err != nil {
		return nil, fmt.Errorf("node: %w", err)
	}
	return reg, nil
}

// registration returns the node's registration (the lost one while it
// rejoins).
func (n *Node) registration() *membership.Registration {
	n.regMu.Lock()
	defer n.regMu.Unlock()
	return n.reg
}

// live reports whether the node's lease holds at now (Handler.Live).
func (n *Node) live(now time.Time) bool {
	reg := n.registration()
	return reg != nil && reg.Valid(now)
}

// awaitLive waits until the node's lease holds (owner.Config.AwaitValid),
// ctx ends or the node closes.
func (n *Node) awaitLive(ctx context.Context) error {
	for {
		n.regMu.Lock()
		reg, back := n.reg, n.back
		n.regMu.Unlock()
		if reg != nil && reg.Valid(time.Now()) {
			return nil
		}
		select {
		case <-back:
			// Live by the record, but the lease just ran out: keepMember
			// is about to notice.
			select {
			case <-time.After(50 * time.Millisecond):
			case <-ctx.Done():
				return ctx.Err()
			case <-n.quit:
				return errors.New("node: closing")
			}
		case <-ctx.Done():
			return ctx.Err()
		case <-n.quit:
			return errors.New("node: closing")
		}
	}
}

// keepMember rejoins the membership whenever the registration is lost,
// until ctx ends (Close).
func (n *Node) keepMember(ctx context.Context) {
	for {
		reg := n.registration()
		select {
		case <-reg.Fenced():
		case <-ctx.Done():
			return
		}
		if ctx.Err() != nil || errors.Is(reg.Err(), membership.ErrClosed) {
			return
		}
		n.regMu.Lock()
		n.back = make(chan struct{})
		n.regMu.Unlock()
		n.vdis.suspend()
		n.m.Rejoins.Inc()
		n.log.Error("lost the membership lease: serving nothing until the node has rejoined", "err", reg.Err())
		if !n.rejoin(ctx) {
			return
		}
	}
}

// rejoin registers again, raises the tokens and takes the VDIs' locks
// again, then makes the new registration the node's. It tries until it
// succeeds (true) or ctx ends (false).
func (n *Node) rejoin(ctx context.Context) bool {
	start := time.Now()
	var removed error
	if !untilDone(ctx, "rejoining the membership", n.log, func(ctx context.Context) error {
		err := n.joinAgain(ctx)
		if errors.Is(err, membership.ErrRemovedNode) {
			removed = err // final: ovis node remove was run for this node
			return nil
		}
		return err
	}) {
		return false
	}
	if removed != nil {
		n.log.Error("removed from the cluster while away: stopping", "err", removed)
		n.stop(fmt.Errorf("node: %w", removed))
		return false
	}
	n.log.Info("rejoined the membership", "epoch", n.views.Epoch(), "away", time.Since(start).Round(time.Millisecond))
	return true
}

// joinAgain is one try of rejoin.
func (n *Node) joinAgain(ctx context.Context) error {
	if err := n.reachAll(ctx); err != nil {
		return err
	}
	reg, err := n.register(ctx)
	if err != nil {
		return err
	}
	if err := n.fenceFromLocks(ctx); err != nil {
		lctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Second)
		reg.Leave(lctx)
		cancel()
		return err
	}
	// Live again: the handler serves, and requests under way go on. The
	// devices stay suspended until their locks are taken again.
	n.regMu.Lock()
	n.reg = reg
	close(n.back)
	n.regMu.Unlock()
	untilDone(ctx, "taking the VDIs' locks again", n.log, func(ctx context.Context) error {
		if err := n.vdis.relock(ctx, reg); err != nil && reg.Err() == nil {
			return err
		}
		return nil // done, or the registration is lost again: keepMember's
	})
	return nil
}

// untilDone calls try until it returns nil (true) or ctx ends (false),
// with a growing pause between tries, each failure logged.
func untilDone(ctx context.Context, what string, log *slog.Logger, try func(context.Context) error) bool {
	for backoff := 200 * time.Millisecond; ; backoff = min(2*backoff, 5*time.Second) {
		err := try(ctx)
		if err == nil {
			return true
		}
		if ctx.Err() != nil {
			return false
		}
		log.Warn(what+" failed; trying again", "err", err, "in", backoff)
		select {
		case <-ctx.Done():
			return false
		case <-time.After(backoff):
		}
	}
}
