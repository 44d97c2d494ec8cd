package node

import (
	"context"
	"sync"

	"github.com/ovis-storage/ovis/cluster/membership"
	"github.com/ovis-storage/ovis/cluster/object"
	"github.com/ovis-storage/ovis/cluster/view"
)

// authority keeps what recovery reads from etcd again and again: the
// views of past epochs, which never change once written, and the VDIs'
// records (their shape: copies and object size).
//
// A record gives the copies of every epoch up to the one the node knew
// when it was read (membership.VDI.CopiesAt: a change of copies is
// written with its epoch), so each is kept with that epoch, and one
// asked for a later epoch is read again.
type authority struct {
	epochs *Views
	meta   authorityMeta

	mu    sync.Mutex
	views map[uint64]*view.View
	vdis  map[object.VDI]knownVDI
}

// knownVDI is a VDI's record and the node's epoch when it was read.
type knownVDI struct {
	rec  membership.VDI
	seen uint64
}

// authorityMeta is what authority reads from etcd (membership.Client).
type authorityMeta interface {
	GetVDIByID(ctx context.Context, id object.VDI) (membership.VDI, error)
	EpochView(ctx context.Context, e uint64) (membership.View, error)
}

func newAuthority(epochs *Views, meta authorityMeta) *authority {
	return &authority{epochs: epochs, meta: meta, views: map[uint64]*view.View{}, vdis: map[object.VDI]knownVDI{}}
}

// vdi returns the VDI's record, for its object size.
func (a *authority) vdi(ctx context.Context, id object.VDI) (membership.VDI, error) {
	return a.vdiAt(ctx, id, 0)
}

// vdiAt returns a record of the VDI read once epoch e was known, so that
// its CopiesAt(e) holds.
func (a *authority) vdiAt(ctx context.Context, id object.VDI, e uint64) (membership.VDI, error) {
	a.mu.Lock()
	k, ok := a.vdis[id]
	a.mu.Unlock()
	if ok && k.seen >= e {
		return k.rec, nil
	}
	// The epoch known before the read; any caller asking for e holds a
	// view of e, so the read comes after e was written either way.
	seen := max(a.epochs.Epoch(), e)
	v, err := a.meta.GetVDIByID(ctx, id)
	if err != nil {
		return v, err
	}
	a.mu.Lock()
	if k, ok := a.vdis[id]; !ok || k.seen < seen {
		a.vdis[id] = knownVDI{rec: v, seen: seen}
	}
	a.mu.Unlock()
	return v, nil
}

func (a *authority) view(ctx context.Context, e uint64) (*view.View, error) {
	if cur := a.epochs.View(); cur.Epoch == e {
		return cur, nil
	}
	a.mu.Lock()
	v := a.views[e]
	a.mu.Unlock()
	if v != nil {
		return v, nil
	}
	mv, err := a.meta.EpochView(ctx, e)
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
	a.vdis = map[object.VDI]knownVDI{}
	a.mu.Unlock()
}
