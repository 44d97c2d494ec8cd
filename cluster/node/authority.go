package node

import (
	"context"
	"fmt"
	"slices"
	"sync"

	"github.com/ovis-storage/ovis/cluster/gateway"
	"github.com/ovis-storage/ovis/cluster/membership"
	"github.com/ovis-storage/ovis/cluster/object"
)

// authority decides whether this node's lack of an object means the
// object was never written (see Handler.Authority). It keeps what it
// read from etcd: the views of past epochs and the VDIs' records, both
// of which never change once written.
type authority struct {
	n *Node

	mu    sync.Mutex
	views map[uint64]*gateway.View
	vdis  map[object.VDI]membership.VDI
}

func newAuthority(n *Node) *authority {
	return &authority{n: n, views: map[uint64]*gateway.View{}, vdis: map[object.VDI]membership.VDI{}}
}

func (a *authority) vdi(ctx context.Context, id object.VDI) (membership.VDI, error) {
	a.mu.Lock()
	v, ok := a.vdis[id]
	a.mu.Unlock()
	if ok {
		return v, nil
	}
	v, err := a.n.mc.GetVDIByID(ctx, id)
	if err != nil {
		return v, err
	}
	a.mu.Lock()
	a.vdis[id] = v
	a.mu.Unlock()
	return v, nil
}

func (a *authority) view(ctx context.Context, e uint64) (*gateway.View, error) {
	if cur := a.n.views.View(); cur.Epoch == e {
		return cur, nil
	}
	a.mu.Lock()
	v := a.views[e]
	a.mu.Unlock()
	if v != nil {
		return v, nil
	}
	mv, err := a.n.mc.EpochView(ctx, e)
	if err != nil {
		return nil, err
	}
	if v, err = ViewOf(mv); err != nil {
		return nil, err
	}
	a.mu.Lock()
	a.views[e] = v
	a.mu.Unlock()
	return v, nil
}

// check returns nil when this node was one of obj's replicas in every
// epoch from its VDI's creation to now.
func (a *authority) check(ctx context.Context, obj object.ID) error {
	vd, err := a.vdi(ctx, obj.VDI())
	if err != nil {
		return fmt.Errorf("object %s: its VDI: %w", obj, err)
	}
	if vd.Epoch == 0 {
		return fmt.Errorf("object %s: vdi %q records no creation epoch", obj, vd.Name)
	}
	cur := a.n.views.Epoch()
	var buf [16]string
	for e := vd.Epoch; e <= cur; e++ {
		v, err := a.view(ctx, e)
		if err != nil {
			return fmt.Errorf("object %s: epoch %d: %w", obj, e, err)
		}
		reps, err := v.Map.Place(obj, min(vd.Copies, v.Map.Zones()), buf[:0])
		if err != nil {
			return fmt.Errorf("object %s: epoch %d: %w", obj, e, err)
		}
		if !slices.Contains(reps, a.n.id) {
			return fmt.Errorf("object %s is not on this node, which was not one of its replicas in epoch %d: its data may be on that epoch's nodes, and moving it here is recovery's work (not implemented yet)", obj, e)
		}
	}
	return nil
}
