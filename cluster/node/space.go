package node

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/ovis-storage/ovis/cluster/membership"
	"github.com/ovis-storage/ovis/cluster/object"
)

// A node whose disk reaches its reserve leaves placement: it says so in
// its membership record (membership.NodeInfo.Full), the epoch changes,
// and the new epoch places nothing on it (ViewOf), so writes of a
// copies-3 VDI go to three other nodes, and recovery moves the full
// node's copies to the nodes placed now, which drops them from the full
// node (it keeps serving them to recovery meanwhile). When space comes
// back it rejoins placement the same way. Like a dead node, a full one
// leaves a VDI short of failure domains when too few remain (strict
// VDIs then refuse writes); when every node is full, none is left out
// and writes that allocate fail with ENOSPC.
//
// A node leaves only while the nodes that stay placed keep as many
// failure domains as every VDI's copies (mayLeave): otherwise recovery
// would move copies off it that no other domain can take, and the
// objects would stay short of copies. It then stays placed, and writes
// that it cannot take fail with ENOSPC (never acknowledged with a copy
// missing). Two nodes that fill at once may both leave on views that
// still showed the other placed; the VDIs are then short of domains, as
// with a dead node, until space comes back.
//
// Leaving and coming back are apart (spaceFull), so that a node near
// the line does not flap: each change moves data.
const (
	// fullMargin: full below Reserve plus one object of the default
	// size (a new object would be refused: the "full" of node list).
	fullMargin = 1 << object.DefaultSizeShift
	// roomMargin: back in placement from Reserve plus 16 such objects.
	roomMargin = 16 << object.DefaultSizeShift
)

// spaceFull is whether a node that was full (or not) is full now, with
// free bytes on its disk and reserve kept. Pure.
func spaceFull(was bool, free, reserve int64) bool {
	if was {
		return free < reserve+roomMargin
	}
	return free < reserve+fullMargin
}

// checkSpace reads the disk's free space and records whether the node is
// out of placement for it now (n.full), which its registration says
// from the next join.
func (n *Node) checkSpace(ctx context.Context) {
	free, reserve, err := n.st.Space()
	if err != nil {
		n.log.Warn("reading the free space failed", "err", err)
		return
	}
	was := n.full.Load()
	full := spaceFull(was, free, reserve)
	if full == was {
		n.stuck.Store(false)
		return
	}
	if full {
		if err := n.mayLeave(ctx); err != nil {
			if !n.stuck.Swap(true) {
				n.log.Warn("store full, staying in placement: writes it cannot take fail with ENOSPC", "free", free, "reserve", reserve, "why", err)
			}
			return
		}
		n.log.Warn("store full: leaving placement; new copies go to other nodes", "free", free, "reserve", reserve)
	} else {
		n.log.Info("store has room again: back in placement", "free", free, "reserve", reserve)
	}
	n.full.Store(full)
}

// mayLeave returns nil when the nodes of the current epoch that would
// stay placed without this one keep as many failure domains as the
// largest copies of any VDI and of the format, else why not.
func (n *Node) mayLeave(ctx context.Context) error {
	v, err := n.mc.View(ctx)
	if err != nil {
		return err
	}
	f, err := n.mc.GetFormat(ctx)
	if errors.Is(err, membership.ErrNotFormatted) {
		return nil
	} else if err != nil {
		return err
	}
	vs, err := n.mc.ListVDIs(ctx)
	if err != nil {
		return err
	}
	copies := f.Copies
	for _, vd := range vs {
		copies = max(copies, vd.Copies)
	}
	stay := v
	stay.Nodes = slices.DeleteFunc(slices.Clone(v.Nodes), func(ni membership.NodeInfo) bool { return ni.Full || ni.ID == n.id })
	if z := stay.Zones(); z < copies {
		return fmt.Errorf("the other placed nodes make %d failure domains, for copies %d", z, copies)
	}
	return nil
}

// watchSpace checks the disk every SpaceInterval, and brings the
// registration's Full in line with n.full, until ctx ends. A failure
// (etcd away, the lease lost) is tried again at the next check; a new
// registration carries n.full already.
func (n *Node) watchSpace(ctx context.Context) {
	every := orSecond(n.cfg.SpaceInterval)
	ticking(ctx, every, func() {
		n.checkSpace(ctx)
		reg := n.registration()
		if want := n.full.Load(); reg.Err() == nil && reg.Node().Full != want {
			sctx, cancel := context.WithTimeout(ctx, every+5*time.Second)
			if err := reg.SetFull(sctx, want); err != nil && ctx.Err() == nil {
				n.log.Warn("telling the membership the store's fullness failed; trying again", "full", want, "err", err)
			}
			cancel()
		}
	})
}
