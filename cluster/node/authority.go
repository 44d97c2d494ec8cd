package node

import (
	"context"
	"sync"

	"github.com/ovis-storage/ovis/cluster/gateway"
	"github.com/ovis-storage/ovis/cluster/membership"
	"github.com/ovis-storage/ovis/cluster/object"
)

// authority keeps what recovery reads from etcd again and again: the
// views of past epochs, which never change once written, and the VDIs'
// records (their shape: copies and object size).
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

// forgetVDIs drops the cached VDI records, so that a VDI deleted (or
// changed) since they were read is seen: each recovery run starts so.
func (a *authority) forgetVDIs() {
	a.mu.Lock()
	a.vdis = map[object.VDI]membership.VDI{}
	a.mu.Unlock()
}
