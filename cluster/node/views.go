package node

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/ovis-storage/ovis/cluster/membership"
	"github.com/ovis-storage/ovis/cluster/object"
	"github.com/ovis-storage/ovis/cluster/placement"
	"github.com/ovis-storage/ovis/cluster/view"
)

// Views follows the membership's epochs and hands them out: as the
// gateway's views (placement and addresses) and as the node's own epoch,
// which its handler checks requests against. One goroutine reads the
// watch; readers take the newest view under a mutex held only to copy a
// pointer.
type Views struct {
	mu   sync.Mutex
	v    *view.View
	wake chan struct{} // closed and replaced when v changes

	log  *slog.Logger
	done chan struct{}
}

// ViewOf builds the gateway's view of a membership view. A full node
// (membership.NodeInfo.Full) is left out of placement, unless every node
// is full, but keeps its address: it serves what it holds to recovery,
// which moves its copies to the nodes placed now.
func ViewOf(mv membership.View) (*view.View, error) {
	allFull := true
	for _, n := range mv.Nodes {
		allFull = allFull && n.Full
	}
	nodes := make([]placement.Node, 0, len(mv.Nodes))
	addrs := make(map[string]string, len(mv.Nodes))
	for _, n := range mv.Nodes {
		if !n.Full || allFull {
			nodes = append(nodes, placement.Node{ID: n.ID, Zone: n.Zone, Weight: n.Weight})
		}
		addrs[n.ID] = n.Addr
	}
	return view.New(mv.Epoch, nodes, addrs)
}

// FollowViews starts following c's epochs from its current one. It
// returns once the current epoch is known. The goroutine it starts ends
// with ctx; Wait waits for it.
//
// Each view carries the VDIs' copies in its epoch (View.Copies), from
// the VDI table read once the epoch is known: AlterCopies writes the
// record and the epoch in one txn, so that read sees every change up to
// the epoch, and the record's history (VDI.CopiesAt) gives the epoch's
// copies even when a later change is read too. A view is handed out
// only with its table, so that no request is placed with old copies.
func FollowViews(ctx context.Context, c *membership.Client, log *slog.Logger) (*Views, error) {
	mv, err := c.View(ctx)
	if err != nil {
		return nil, fmt.Errorf("node: reading the membership: %w", err)
	}
	v, err := ViewOf(mv)
	if err != nil {
		return nil, err
	}
	if v.Copies, err = copiesIn(ctx, c, mv.Epoch); err != nil {
		return nil, err
	}
	vs := &Views{v: v, wake: make(chan struct{}), log: log, done: make(chan struct{})}
	ch := c.Watch(ctx)
	go func() {
		defer close(vs.done)
		for mv := range ch {
			v, err := ViewOf(mv)
			if err != nil {
				// An epoch the placement cannot use (no nodes: every
				// node left) is skipped; requests wait for a usable one.
				log.Warn("membership epoch skipped", "epoch", mv.Epoch, "err", err)
				continue
			}
			for backoff := 50 * time.Millisecond; ; backoff = min(2*backoff, 2*time.Second) {
				if v.Copies, err = copiesIn(ctx, c, mv.Epoch); err == nil || ctx.Err() != nil {
					break
				}
				// Without the table the epoch's copies are unknown: the
				// requests of the older epoch are refused meanwhile,
				// and wait, as for any epoch not yet known here.
				log.Warn("membership epoch: reading the VDI table", "epoch", mv.Epoch, "err", err)
				select {
				case <-ctx.Done():
				case <-time.After(backoff):
				}
			}
			if ctx.Err() != nil {
				return
			}
			vs.set(v)
		}
	}()
	return vs, nil
}

// copiesIn reads the VDI table and returns each VDI's copies in epoch e.
// The caller knows e already, so the read sees every change of copies
// made with e or before.
func copiesIn(ctx context.Context, c *membership.Client, e uint64) (map[object.VDI]int, error) {
	vds, err := c.ListVDIs(ctx)
	if err != nil {
		return nil, fmt.Errorf("node: the VDIs' copies in epoch %d: %w", e, err)
	}
	m := make(map[object.VDI]int, len(vds))
	for _, vd := range vds {
		// An epoch older than the record's history cannot be the one
		// just written: its copies are always known here.
		m[vd.ID], _ = vd.CopiesAt(e)
	}
	return m, nil
}

// Wait waits for the watching goroutine to end (its context ended).
func (vs *Views) Wait() { <-vs.done }

func (vs *Views) set(v *view.View) {
	vs.mu.Lock()
	defer vs.mu.Unlock()
	if v.Epoch <= vs.v.Epoch {
		return
	}
	old := vs.v
	vs.v = v
	old.Supersede()
	close(vs.wake)
	vs.wake = make(chan struct{})
	vs.log.Info("membership epoch", "epoch", v.Epoch, "nodes", len(v.Addr))
}

// View returns the newest view.
func (vs *Views) View() *view.View {
	vs.mu.Lock()
	defer vs.mu.Unlock()
	return vs.v
}

// Await returns a view newer than epoch.
func (vs *Views) Await(ctx context.Context, epoch uint64) (*view.View, error) {
	for {
		vs.mu.Lock()
		v, wake := vs.v, vs.wake
		vs.mu.Unlock()
		if v.Epoch > epoch {
			return v, nil
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("node: waiting for an epoch after %d: %w", epoch, ctx.Err())
		case <-wake:
		}
	}
}

// Epoch is the node's epoch.
func (vs *Views) Epoch() uint64 { return vs.View().Epoch }

// AwaitEpoch returns once the node knows epoch e.
func (vs *Views) AwaitEpoch(ctx context.Context, e uint64) error {
	if vs.Epoch() >= e {
		return nil
	}
	_, err := vs.Await(ctx, e-1)
	return err
}
