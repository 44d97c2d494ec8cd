package membership

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// NodeInfo is what a storage node registers.
type NodeInfo struct {
	// ID names the node for the life of the cluster: 1 to 255 printable
	// bytes, no '/'.
	ID string `json:"id"`
	// Addr is the node's protocol address, HOST:PORT.
	Addr string `json:"addr"`
	// Zone is the node's failure domain; 0 means none was given, and
	// the node is then a domain of its own.
	Zone uint32 `json:"zone"`
	// Weight is the node's share of objects, relative to the others.
	Weight uint32 `json:"weight"`
	// Full: the node's disk is at its reserve. An epoch that lists it
	// places no object on it (unless every node is full), so new copies
	// go to the others, and recovery moves its copies off; it still
	// serves what it holds to recovery. Set by Registration.SetFull.
	Full bool `json:"full,omitempty"`
}

// Validate reports a bad ID or Addr.
func (n NodeInfo) Validate() error {
	if err := validName(n.ID); err != nil {
		return fmt.Errorf("membership: node id: %w", err)
	}
	if n.Addr == "" {
		return fmt.Errorf("membership: node %q: empty address: %w", n.ID, ErrInvalid)
	}
	return nil
}

// View is one epoch: the nodes that were live when it was written.
type View struct {
	Epoch uint64     `json:"epoch"`
	Nodes []NodeInfo `json:"nodes"` // sorted by ID
	// Created is when the epoch was written, on the writer's clock.
	Created time.Time `json:"created"`
}

// Zones returns the number of failure domains among the view's nodes:
// each distinct non-zero zone is one, and each node of zone 0 is one of
// its own.
func (v View) Zones() int {
	seen := map[uint32]bool{}
	n := 0
	for _, nd := range v.Nodes {
		if nd.Zone == 0 {
			n++
		} else if !seen[nd.Zone] {
			seen[nd.Zone] = true
			n++
		}
	}
	return n
}

// Has reports whether the view lists the node id.
func (v View) Has(id string) bool {
	_, ok := slices.BinarySearchFunc(v.Nodes, id, func(n NodeInfo, id string) int { return cmp.Compare(n.ID, id) })
	return ok
}

// nextEpoch is the epoch rule, pure: given the current epoch (ok false
// when none was ever written) and the live node set, it returns the
// epoch to write, or false when the current one already lists exactly
// the live set. An empty live set writes no epoch: the last one stands
// until a node joins. live need not be sorted; it is not modified.
func nextEpoch(cur View, ok bool, live []NodeInfo, now time.Time) (View, bool) {
	if len(live) == 0 {
		return View{}, false
	}
	nodes := slices.Clone(live)
	slices.SortFunc(nodes, func(a, b NodeInfo) int { return cmp.Compare(a.ID, b.ID) })
	if ok && slices.Equal(cur.Nodes, nodes) {
		return View{}, false
	}
	return View{Epoch: cur.Epoch + 1, Nodes: nodes, Created: now}, true
}

// snapshot is the current epoch and the live set, read at one revision.
type snapshot struct {
	cur      View
	ok       bool  // cur exists
	curMod   int64 // mod revision of the epoch key, 0 if none
	live     []NodeInfo
	revision int64
}

// readSnapshot reads the epoch key and the node keys in one txn, so
// both are at one revision.
func (c *Client) readSnapshot(ctx context.Context) (snapshot, error) {
	resp, err := c.cli.Txn(ctx).Then(
		clientv3.OpGet(c.k.epoch()),
		clientv3.OpGet(c.k.nodes(), clientv3.WithPrefix()),
	).Commit()
	if err != nil {
		return snapshot{}, fmt.Errorf("membership: read epoch and nodes: %w", err)
	}
	s := snapshot{revision: resp.Header.Revision}
	if kvs := resp.Responses[0].GetResponseRange().Kvs; len(kvs) > 0 {
		if s.cur, err = decodeView(kvs[0].Value); err != nil {
			return snapshot{}, err
		}
		s.ok, s.curMod = true, kvs[0].ModRevision
	}
	for _, kv := range resp.Responses[1].GetResponseRange().Kvs {
		var n NodeInfo
		if err := json.Unmarshal(kv.Value, &n); err != nil {
			return snapshot{}, fmt.Errorf("membership: node record %s %q: %w", kv.Key, kv.Value, err)
		}
		s.live = append(s.live, n)
	}
	return s, nil
}

// reconcile writes the next epoch if the live set differs from the
// current epoch's, retrying when another writer won the race, and
// returns the view that matches the live set it last read, with the
// revision it read at.
func (c *Client) reconcile(ctx context.Context) (View, int64, error) {
	for {
		s, err := c.readSnapshot(ctx)
		if err != nil {
			return View{}, 0, err
		}
		next, ok := nextEpoch(s.cur, s.ok, s.live, c.now().UTC())
		if !ok {
			return s.cur, s.revision, nil
		}
		won, err := c.writeEpoch(ctx, next, s.curMod)
		if err != nil {
			return View{}, 0, err
		}
		if won {
			c.log.Info("new epoch", "epoch", next.Epoch, "nodes", len(next.Nodes))
			return next, s.revision, nil
		}
		// Another node wrote an epoch first: read again.
	}
}

// writeEpoch stores v as the current epoch and in the history, if the
// epoch key's mod revision is still curMod (0: the key does not exist).
// It reports whether the write won.
func (c *Client) writeEpoch(ctx context.Context, v View, curMod int64) (bool, error) {
	cmps, ops, err := c.epochTxn(v, curMod)
	if err != nil {
		return false, err
	}
	resp, err := c.cli.Txn(ctx).If(cmps...).Then(ops...).Commit()
	if err != nil {
		return false, fmt.Errorf("membership: write epoch %d: %w", v.Epoch, err)
	}
	return resp.Succeeded, nil
}

// epochTxn returns the guards and the puts that write v as the next
// epoch after the one whose key's mod revision is curMod (0: none yet).
// Every epoch is written through it (writeEpoch, AlterCopies), so that
// the history rules hold for all: numbers never skip, and a record is
// never rewritten.
func (c *Client) epochTxn(v View, curMod int64) ([]clientv3.Cmp, []clientv3.Op, error) {
	b, err := json.Marshal(v)
	if err != nil {
		return nil, nil, fmt.Errorf("membership: epoch %d: %w", v.Epoch, err)
	}
	guard := clientv3.Compare(clientv3.ModRevision(c.k.epoch()), "=", curMod)
	if curMod == 0 {
		guard = clientv3.Compare(clientv3.CreateRevision(c.k.epoch()), "=", 0)
	}
	return []clientv3.Cmp{
			guard,
			// Never overwrite history, even after a trim went wrong.
			clientv3.Compare(clientv3.CreateRevision(c.k.epochAt(v.Epoch)), "=", 0),
		}, []clientv3.Op{
			clientv3.OpPut(c.k.epoch(), string(b)),
			clientv3.OpPut(c.k.epochAt(v.Epoch), string(b)),
		}, nil
}

func decodeView(b []byte) (View, error) {
	var v View
	if err := json.Unmarshal(b, &v); err != nil {
		return View{}, fmt.Errorf("membership: epoch record %q: %w", b, err)
	}
	if v.Epoch == 0 {
		return View{}, fmt.Errorf("membership: epoch record %q: epoch 0", b)
	}
	return v, nil
}

// decodeHistory decodes an epochs/ record and checks that its key and
// its epoch agree.
func (c *Client) decodeHistory(key, value []byte) (View, error) {
	e, err := c.k.parseEpochKey(string(key))
	if err != nil {
		return View{}, err
	}
	v, err := decodeView(value)
	if err != nil {
		return View{}, err
	}
	if v.Epoch != e {
		return View{}, fmt.Errorf("membership: epoch record %s holds epoch %d", key, v.Epoch)
	}
	return v, nil
}

// View returns the current epoch, or ErrNoEpoch when no node ever
// joined. The caller owns the returned slices.
func (c *Client) View(ctx context.Context) (View, error) {
	v, _, err := c.view(ctx)
	return v, err
}

// view also returns the revision the view was read at.
func (c *Client) view(ctx context.Context) (View, int64, error) {
	resp, err := c.cli.Get(ctx, c.k.epoch())
	if err != nil {
		return View{}, 0, fmt.Errorf("membership: get %s: %w", c.k.epoch(), err)
	}
	if len(resp.Kvs) == 0 {
		return View{}, resp.Header.Revision, ErrNoEpoch
	}
	v, err := decodeView(resp.Kvs[0].Value)
	return v, resp.Header.Revision, err
}

// EpochView returns the historic epoch e. Every epoch is kept until
// TrimEpochs removes it; a missing one gives ErrNoEpoch.
func (c *Client) EpochView(ctx context.Context, e uint64) (View, error) {
	resp, err := c.cli.Get(ctx, c.k.epochAt(e))
	if err != nil {
		return View{}, fmt.Errorf("membership: get %s: %w", c.k.epochAt(e), err)
	}
	if len(resp.Kvs) == 0 {
		return View{}, fmt.Errorf("membership: epoch %d: %w", e, ErrNoEpoch)
	}
	return c.decodeHistory(resp.Kvs[0].Key, resp.Kvs[0].Value)
}

// Epochs returns the kept epochs from..to inclusive (to 0: up to the
// newest), oldest first.
func (c *Client) Epochs(ctx context.Context, from, to uint64) ([]View, error) {
	end := c.k.epochAt(to + 1)
	if to == 0 || to == ^uint64(0) {
		end = clientv3.GetPrefixRangeEnd(c.k.epochs())
	}
	resp, err := c.cli.Get(ctx, c.k.epochAt(from), clientv3.WithRange(end))
	if err != nil {
		return nil, fmt.Errorf("membership: get epochs %d..%d: %w", from, to, err)
	}
	vs := make([]View, 0, len(resp.Kvs))
	for _, kv := range resp.Kvs {
		v, err := c.decodeHistory(kv.Key, kv.Value)
		if err != nil {
			return nil, err
		}
		vs = append(vs, v)
	}
	return vs, nil
}

// TrimEpochs deletes the kept epochs older than below, never the
// current one. Recovery needs the epochs back to the oldest one any
// node has not recovered from; only the caller knows which that is.
func (c *Client) TrimEpochs(ctx context.Context, below uint64) (int64, error) {
	v, err := c.View(ctx)
	if err != nil {
		return 0, err
	}
	below = min(below, v.Epoch)
	resp, err := c.cli.Delete(ctx, c.k.epochAt(0), clientv3.WithRange(c.k.epochAt(below)))
	if err != nil {
		return 0, fmt.Errorf("membership: trim epochs below %d: %w", below, err)
	}
	return resp.Deleted, nil
}

// WaitEpoch returns the current view once its epoch is at least min,
// or ctx's error.
func (c *Client) WaitEpoch(ctx context.Context, min uint64) (View, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	for {
		v, rev, err := c.view(ctx)
		if err != nil && !errors.Is(err, ErrNoEpoch) {
			return View{}, err
		}
		if err == nil && v.Epoch >= min {
			return v, nil
		}
		wc := c.cli.Watch(ctx, c.k.epoch(), clientv3.WithRev(rev+1))
		for wr := range wc {
			if wr.Err() != nil {
				break // compacted or cancelled: read again
			}
			for _, ev := range wr.Events {
				if ev.Type != clientv3.EventTypePut {
					continue
				}
				if v, err := decodeView(ev.Kv.Value); err == nil && v.Epoch >= min {
					return v, nil
				}
			}
		}
		if ctx.Err() != nil {
			return View{}, fmt.Errorf("membership: wait for epoch %d: %w", min, ctx.Err())
		}
	}
}

// Watch returns a channel that gets the current epoch, then every newer
// epoch in order, none skipped while the history keeps them. It ends
// (the channel closes) when ctx ends or the Client closes. When etcd
// has compacted past the watch, it reloads the missed epochs from the
// history. The Client owns the goroutine feeding the channel.
func (c *Client) Watch(ctx context.Context) <-chan View {
	out := make(chan View, 1)
	ctx, cancel := context.WithCancel(ctx)
	started := c.goTracked(func() {
		defer close(out)
		defer cancel()
		stop := context.AfterFunc(c.bg, cancel)
		defer stop()
		// Start with the current epoch, read with retries like the rest.
		for ctx.Err() == nil {
			v, rev, err := c.view(ctx)
			switch {
			case err == nil:
				select {
				case out <- v:
				case <-ctx.Done():
					return
				}
				c.watchEpochs(ctx, out, v.Epoch, rev+1)
				return
			case errors.Is(err, ErrNoEpoch):
				c.watchEpochs(ctx, out, 0, rev+1)
				return
			}
			c.log.Warn("epoch watch: read current epoch", "err", err)
			select {
			case <-time.After(500 * time.Millisecond):
			case <-ctx.Done():
			}
		}
	})
	if !started {
		cancel()
		close(out)
	}
	return out
}

// watchEpochs sends epochs after last to out. rev, when not 0, is the
// revision to watch from: the caller has seen everything before it. It
// returns when ctx ends.
func (c *Client) watchEpochs(ctx context.Context, out chan<- View, last uint64, rev int64) {
	send := func(v View) bool {
		if v.Epoch <= last {
			return true
		}
		select {
		case out <- v:
			last = v.Epoch
			return true
		case <-ctx.Done():
			return false
		}
	}
	retry := time.NewTimer(0)
	defer retry.Stop()
	for ctx.Err() == nil {
		if rev == 0 {
			// (Re)load: the epochs after last from the history, then
			// watch from the revision they were read at.
			var err error
			rev, err = c.catchUp(ctx, last, send)
			if err != nil {
				if ctx.Err() == nil {
					c.log.Warn("epoch watch reload failed", "err", err)
				}
				retry.Reset(500 * time.Millisecond)
				select {
				case <-retry.C:
				case <-ctx.Done():
				}
				rev = 0
				continue
			}
		}
		wctx, wcancel := context.WithCancel(ctx)
		wc := c.cli.Watch(clientv3.WithRequireLeader(wctx), c.k.epochs(), clientv3.WithPrefix(), clientv3.WithRev(rev))
		for wr := range wc {
			if err := wr.Err(); err != nil {
				if errors.Is(err, rpctypes.ErrCompacted) {
					c.log.Info("epoch watch compacted; reloading", "from", rev, "compacted", wr.CompactRevision)
				}
				break
			}
			ok := true
			for _, ev := range wr.Events {
				rev = ev.Kv.ModRevision + 1
				if ev.Type != clientv3.EventTypePut {
					continue
				}
				v, err := c.decodeHistory(ev.Kv.Key, ev.Kv.Value)
				if err != nil {
					c.log.Warn("bad epoch record", "key", string(ev.Kv.Key), "err", err)
					continue
				}
				if v.Epoch > last+1 {
					// A gap (the watch missed records): reload.
					ok = false
					break
				}
				if !send(v) {
					wcancel()
					return
				}
			}
			if !ok {
				break
			}
		}
		wcancel()
		rev = 0 // reload: the history fills whatever the watch missed
	}
}

// catchUp sends the kept epochs after last, oldest first, and returns
// the revision to watch from.
func (c *Client) catchUp(ctx context.Context, last uint64, send func(View) bool) (int64, error) {
	resp, err := c.cli.Get(ctx, c.k.epochAt(last+1), clientv3.WithRange(clientv3.GetPrefixRangeEnd(c.k.epochs())))
	if err != nil {
		return 0, fmt.Errorf("membership: get epochs after %d: %w", last, err)
	}
	for _, kv := range resp.Kvs {
		v, err := c.decodeHistory(kv.Key, kv.Value)
		if err != nil {
			c.log.Warn("bad epoch record", "key", string(kv.Key), "err", err)
			continue
		}
		if !send(v) {
			return 0, ctx.Err()
		}
	}
	return resp.Header.Revision + 1, nil
}
