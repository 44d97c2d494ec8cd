package membership

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// MinTTL is the shortest lease a node may register with: etcd refuses
// or silently extends shorter ones.
const MinTTL = 2 * time.Second

// Registration is one node's membership: its key under a lease, the
// loop that renews the lease and fences the node when it cannot, and
// the loop that writes a new epoch when the live set changes.
//
// Locking: mu guards lastRenew; it is taken after Client.mu, and never
// held across a call to etcd.
//
// Safe for concurrent use. End with Leave (or Client.Close, which stops
// the loops and lets the lease expire).
type Registration struct {
	c     *Client
	node  NodeInfo
	lease clientv3.LeaseID
	ttl   time.Duration

	fenced    chan struct{}
	fenceOnce sync.Once
	// deadline is fenceDeadline of the last successful renewal, in Unix
	// nanoseconds: Valid compares the clock with it on every request, so
	// that a node that was suspended past its lease refuses writes the
	// moment it runs again, before keepAlive notices.
	deadline atomic.Int64
	// cancel stops the loops; wg waits for them.
	cancel context.CancelFunc
	wg     sync.WaitGroup

	mu struct {
		sync.Mutex
		// reason says why the registration ended; empty while live.
		reason string
		left   bool
		// full is the Full the node key holds now (SetFull).
		full bool
	}
}

// fenceMargin is how much before the lease's TTL runs out, counted from
// the last successful renewal's send time, the node fences itself: the
// server's clock may run ahead of ours, and the node needs time to stop.
func fenceMargin(ttl time.Duration) time.Duration {
	return max(ttl/6, 100*time.Millisecond)
}

// fenceDeadline is when a registration whose last successful renewal
// was sent at lastSent must consider its lease lost. Pure.
func fenceDeadline(lastSent time.Time, ttl time.Duration) time.Time {
	return lastSent.Add(ttl - fenceMargin(ttl))
}

// Join registers n under a new lease of ttl (at least MinTTL, rounded
// up to whole seconds). A live node registered with the same ID is
// refused with ErrDuplicateNode, naming its address; a removed ID
// (RemoveNode) with ErrRemovedNode. Join returns once
// the current epoch lists n.
func (c *Client) Join(ctx context.Context, n NodeInfo, ttl time.Duration) (*Registration, error) {
	if err := n.Validate(); err != nil {
		return nil, err
	}
	if ttl < MinTTL {
		return nil, fmt.Errorf("membership: join %q: lease ttl %v is below %v: %w", n.ID, ttl, MinTTL, ErrInvalid)
	}
	if err := c.checkOpen(); err != nil {
		return nil, err
	}
	secs := int64((ttl + time.Second - 1) / time.Second)
	ttl = time.Duration(secs) * time.Second
	sent := c.now()
	g, err := c.cli.Grant(ctx, secs)
	if err != nil {
		return nil, fmt.Errorf("membership: join %q: grant lease: %w", n.ID, err)
	}
	revoke := func() {
		rctx, cancel := context.WithTimeout(context.Background(), time.Second)
		c.cli.Revoke(rctx, g.ID)
		cancel()
	}
	b, err := json.Marshal(n)
	if err != nil {
		revoke()
		return nil, fmt.Errorf("membership: join %q: %w", n.ID, err)
	}
	key := c.k.node(n.ID)
	resp, err := c.cli.Txn(ctx).
		If(clientv3.Compare(clientv3.CreateRevision(key), "=", 0),
			// A removed ID never comes back (RemoveNode).
			clientv3.Compare(clientv3.CreateRevision(c.k.removed(n.ID)), "=", 0)).
		Then(clientv3.OpPut(key, string(b), clientv3.WithLease(g.ID))).
		Else(clientv3.OpGet(key), clientv3.OpGet(c.k.removed(n.ID), clientv3.WithCountOnly())).
		Commit()
	if err != nil {
		revoke()
		return nil, fmt.Errorf("membership: join %q: put %s: %w", n.ID, key, err)
	}
	if !resp.Succeeded {
		revoke()
		if resp.Responses[1].GetResponseRange().Count > 0 {
			return nil, fmt.Errorf("membership: join %q: %w", n.ID, ErrRemovedNode)
		}
		other := "?"
		if kvs := resp.Responses[0].GetResponseRange().Kvs; len(kvs) > 0 {
			var o NodeInfo
			if json.Unmarshal(kvs[0].Value, &o) == nil {
				other = o.Addr
			}
		}
		return nil, fmt.Errorf("membership: join %q: %w (at %s)", n.ID, ErrDuplicateNode, other)
	}

	r := &Registration{c: c, node: n, lease: g.ID, ttl: ttl, fenced: make(chan struct{})}
	r.mu.full = n.Full
	r.deadline.Store(fenceDeadline(sent, ttl).UnixNano())
	var lctx context.Context
	lctx, r.cancel = context.WithCancel(c.bg)
	c.mu.Lock()
	if c.mu.closed {
		c.mu.Unlock()
		r.cancel()
		revoke()
		return nil, ErrClosed
	}
	c.mu.regs[r] = struct{}{}
	c.mu.Unlock()
	r.wg.Add(2)
	go func() {
		defer r.wg.Done()
		r.keepAlive(lctx, sent)
	}()
	go func() {
		defer r.wg.Done()
		r.bumpEpochs(lctx)
	}()

	v, _, err := c.reconcile(ctx)
	if err == nil && !v.Has(n.ID) {
		err = fmt.Errorf("membership: join %q: epoch %d does not list it: %w", n.ID, v.Epoch, ErrFenced)
	}
	if err != nil {
		lctx, cancel := context.WithTimeout(context.Background(), time.Second)
		r.Leave(lctx)
		cancel()
		return nil, fmt.Errorf("membership: join %q: %w", n.ID, err)
	}
	c.log.Info("joined", "node", n.ID, "addr", n.Addr, "epoch", v.Epoch, "lease", fmt.Sprintf("%x", int64(g.ID)))
	return r, nil
}

// Node returns what the registration registered, with its Full as the
// node key holds it now.
func (r *Registration) Node() NodeInfo {
	n := r.node
	r.mu.Lock()
	n.Full = r.mu.full
	r.mu.Unlock()
	return n
}

// SetFull writes full into the node's key, under the registration's
// lease: the epoch changes (bumpEpochs sees the key change), and the new
// one places nothing on a full node. It fails with ErrFenced when the
// key is no longer this registration's.
func (r *Registration) SetFull(ctx context.Context, full bool) error {
	if err := r.Err(); err != nil {
		return err
	}
	n := r.Node()
	n.Full = full
	b, err := json.Marshal(n)
	if err != nil {
		return fmt.Errorf("membership: node %q: %w", n.ID, err)
	}
	key := r.c.k.node(n.ID)
	resp, err := r.c.cli.Txn(ctx).
		If(clientv3.Compare(clientv3.LeaseValue(key), "=", r.lease)).
		Then(clientv3.OpPut(key, string(b), clientv3.WithLease(r.lease))).
		Commit()
	if err != nil {
		return fmt.Errorf("membership: node %q: setting full %v: %w", n.ID, full, err)
	}
	if !resp.Succeeded {
		return fmt.Errorf("membership: node %q: setting full %v: the node key is not this registration's: %w", n.ID, full, ErrFenced)
	}
	r.mu.Lock()
	r.mu.full = full
	r.mu.Unlock()
	return nil
}

// LeaseID returns the registration's lease; the VDI locks a node takes
// live under it.
func (r *Registration) LeaseID() clientv3.LeaseID { return r.lease }

// TTL returns the lease's TTL.
func (r *Registration) TTL() time.Duration { return r.ttl }

// Fenced returns a channel closed once the registration ends: its
// lease was found lost, or could not be renewed before
// fenceDeadline, or Leave or Client.Close ended it. The node must then
// stop serving.
func (r *Registration) Fenced() <-chan struct{} { return r.fenced }

// Err returns nil while the registration is live, and then an error
// wrapping ErrFenced (or ErrClosed after Leave) that says why it ended.
func (r *Registration) Err() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	switch {
	case r.mu.reason == "":
		return nil
	case r.mu.left:
		return fmt.Errorf("membership: node %q: %s: %w", r.node.ID, r.mu.reason, ErrClosed)
	}
	return fmt.Errorf("membership: node %q: %s: %w", r.node.ID, r.mu.reason, ErrFenced)
}

// fence ends the registration for reason and stops its loops.
func (r *Registration) fence(reason string, left bool) {
	r.fenceOnce.Do(func() {
		r.mu.Lock()
		r.mu.reason, r.mu.left = reason, left
		r.mu.Unlock()
		close(r.fenced)
		r.cancel()
		if !left {
			r.c.log.Warn("fenced", "node", r.node.ID, "reason", reason)
		}
	})
}

// Valid reports whether the registration still holds at now, by this
// node's clock: it was not fenced, and its last renewal is recent enough
// that the lease cannot have expired at the server (see fenceMargin).
func (r *Registration) Valid(now time.Time) bool {
	select {
	case <-r.fenced:
		return false
	default:
	}
	return now.UnixNano() < r.deadline.Load()
}

// Leave stops the loops and revokes the lease: the node key and every
// lock under the lease go at once, and the other nodes write the next
// epoch. A second call returns ErrClosed.
func (r *Registration) Leave(ctx context.Context) error {
	r.mu.Lock()
	if r.mu.left {
		r.mu.Unlock()
		return ErrClosed
	}
	r.mu.left = true
	r.mu.Unlock()
	r.fence("left", true)
	r.wg.Wait()
	r.c.mu.Lock()
	delete(r.c.mu.regs, r)
	r.c.mu.Unlock()
	if _, err := r.c.cli.Revoke(ctx, r.lease); err != nil && !errors.Is(err, rpctypes.ErrLeaseNotFound) {
		return fmt.Errorf("membership: leave %q: revoke lease %x: %w", r.node.ID, int64(r.lease), err)
	}
	return nil
}

// stop ends the loops without revoking the lease (Client.Close).
func (r *Registration) stop() {
	r.fence("client closed", true)
	r.wg.Wait()
}

// keepAlive renews the lease every TTL/3, and fences the registration
// when etcd says the lease is gone or no renewal succeeded before the
// deadline. lastSent is when the grant was sent.
func (r *Registration) keepAlive(ctx context.Context, lastSent time.Time) {
	c := r.c
	t := time.NewTimer(0)
	defer t.Stop()
	next := lastSent.Add(r.ttl / 3)
	for {
		deadline := fenceDeadline(lastSent, r.ttl)
		r.deadline.Store(deadline.UnixNano())
		now := c.now()
		if !now.Before(deadline) {
			r.fence(fmt.Sprintf("lease %x not renewed within its ttl %v (last renewal sent %v ago)",
				int64(r.lease), r.ttl, now.Sub(lastSent).Round(time.Millisecond)), false)
			r.revokeQuietly()
			return
		}
		wake := next
		if deadline.Before(wake) {
			wake = deadline
		}
		t.Reset(wake.Sub(now))
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		now = c.now()
		if !now.Before(deadline) {
			continue
		}
		kctx, cancel := context.WithDeadline(ctx, deadline)
		resp, err := c.cli.KeepAliveOnce(kctx, r.lease)
		cancel()
		switch {
		case err == nil && resp.TTL > 0:
			lastSent = now
			next = now.Add(r.ttl / 3)
		case errors.Is(err, rpctypes.ErrLeaseNotFound):
			r.fence(fmt.Sprintf("lease %x lost", int64(r.lease)), false)
			return
		case ctx.Err() != nil:
			return
		default:
			// Transient: retry soon, until the deadline.
			next = c.now().Add(r.ttl / 10)
		}
	}
}

// revokeQuietly revokes the lease after a time-out fence, so that locks
// under it go now rather than at the server's expiry; etcd may well be
// unreachable.
func (r *Registration) revokeQuietly() {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	r.c.cli.Revoke(ctx, r.lease)
}

// bumpEpochs watches the node keys and the epoch key, and writes the
// next epoch whenever the live set differs from the current epoch's.
// It fences the registration when its own key is deleted.
func (r *Registration) bumpEpochs(ctx context.Context) {
	c := r.c
	own := c.k.node(r.node.ID)
	retry := time.NewTimer(0)
	defer retry.Stop()
	wait := func(d time.Duration) bool {
		retry.Reset(d)
		select {
		case <-retry.C:
			return true
		case <-ctx.Done():
			return false
		}
	}
	for ctx.Err() == nil {
		v, rev, err := c.reconcile(ctx)
		if err != nil {
			if ctx.Err() == nil {
				c.log.Warn("epoch reconcile failed", "node", r.node.ID, "err", err)
				wait(r.ttl / 4)
			}
			continue
		}
		if !v.Has(r.node.ID) {
			// Our key is gone from the live set we just read.
			if ok, err := c.keyExists(ctx, own); err == nil && !ok {
				r.fence(fmt.Sprintf("node key %s deleted", own), false)
				return
			}
		}
		wctx, wcancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
		nodes := c.cli.Watch(wctx, c.k.nodes(), clientv3.WithPrefix(), clientv3.WithRev(rev+1))
		epoch := c.cli.Watch(wctx, c.k.epoch(), clientv3.WithRev(rev+1))
		// A periodic check catches anything a broken watch hides.
		tick := time.NewTicker(r.ttl)
	events:
		for {
			select {
			case <-ctx.Done():
				break events
			case <-tick.C:
				break events
			case wr, ok := <-nodes:
				if !ok || wr.Err() != nil {
					break events
				}
				for _, ev := range wr.Events {
					if ev.Type == clientv3.EventTypeDelete && string(ev.Kv.Key) == own {
						tick.Stop()
						wcancel()
						r.fence(fmt.Sprintf("node key %s deleted", own), false)
						return
					}
				}
				if len(wr.Events) > 0 {
					break events
				}
			case wr, ok := <-epoch:
				if !ok || wr.Err() != nil || len(wr.Events) > 0 {
					break events
				}
			}
		}
		tick.Stop()
		wcancel()
	}
}

// keyExists reports whether key exists.
func (c *Client) keyExists(ctx context.Context, key string) (bool, error) {
	resp, err := c.cli.Get(ctx, key, clientv3.WithCountOnly())
	if err != nil {
		return false, err
	}
	return resp.Count > 0, nil
}
