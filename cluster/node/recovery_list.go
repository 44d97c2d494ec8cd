package node

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/ovis-storage/ovis/cluster/membership"
	"github.com/ovis-storage/ovis/cluster/object"
	"github.com/ovis-storage/ovis/cluster/protocol"
	"github.com/ovis-storage/ovis/cluster/recovery"
	"github.com/ovis-storage/ovis/cluster/view"
)

// unheld finds, among the objects of every VDI that are placed on this
// node in v and that no node of v holds (not in held), those that may
// have been written while held by nodes that are away now, and adds them
// to unfound; of a VDI with an allocation map, only the objects in it.
// A listing shows only what the nodes that answered hold:
// an object whose every holder is away is in no listing, and its absence
// is evidence only if recovery.Unfound says so. An object this node was
// placed for in every epoch since it was last known current needs no
// look: it received every write.
func (r *recoverer) unheld(ctx context.Context, v *view.View, rk *ranker, held map[object.ID][]recovery.Copy, unfound map[object.ID][]string) error {
	vdis, err := r.meta.ListVDIs(ctx)
	if err != nil {
		return fmt.Errorf("listing the VDIs: %w", err)
	}
	if walk, err := r.someoneAway(ctx, v, vdis); err != nil || !walk {
		return err
	}
	nodes := v.IDs()
	for _, vd := range vdis {
		if vd.Epoch > v.Epoch {
			continue // created after v: nothing of it was written before
		}
		count := uint32((vd.Size + 1<<vd.ObjectShift - 1) >> vd.ObjectShift)
		// With an allocation map, only the objects in it were ever
		// written: a mark completes before any of the object's data
		// reaches a node, so the data a node that is away holds was
		// marked before v began, before this read.
		var indices []uint32 // nil: every one
		if vd.Allocation {
			written, err := r.meta.Allocated(ctx, vd.ID)
			if err != nil {
				return fmt.Errorf("vdi %s: %w", vd.Name, err)
			}
			indices = make([]uint32, 0, written.Len())
			written.Each(func(i uint32) {
				if i < count {
					indices = append(indices, i)
				}
			})
		}
		n := count
		if indices != nil {
			n = uint32(len(indices))
		}
		for k := range n {
			if k%4096 == 0 && ctx.Err() != nil {
				return ctx.Err()
			}
			i := k
			if indices != nil {
				i = indices[k]
			}
			obj := object.Make(vd.ID, i)
			if _, ok := held[obj]; ok {
				continue
			}
			mine, err := r.placedOn(ctx, v, obj, r.id)
			if err != nil {
				return err
			}
			if !mine {
				continue
			}
			if ok, err := r.continuous(ctx, obj, v.Epoch); err != nil || ok {
				if err != nil {
					return err
				}
				continue
			}
			_, away, err := rk.judge(ctx, obj, nil, nodes)
			if err != nil {
				return err
			}
			if away != nil {
				unfound[obj] = away
			}
		}
	}
	return nil
}

// someoneAway reports whether an object of vdis may have every replica
// of some epoch away now (out of v): whether, in some epoch since the
// oldest VDI's creation, as many of its nodes are out of v as the fewest
// replicas any VDI had then. When not, every object has an answering
// replica in every epoch, nothing can be unfound, and unheld need not
// walk the objects: the common case, a node or two down at a time.
func (r *recoverer) someoneAway(ctx context.Context, v *view.View, vdis []membership.VDI) (bool, error) {
	from := v.Epoch + 1
	for _, vd := range vdis {
		from = min(from, vd.Epoch)
	}
	for e := max(from, 1); e <= v.Epoch; e++ {
		ve, err := r.a.view(ctx, e)
		if errors.Is(err, membership.ErrNoEpoch) {
			return true, nil // not known: look
		}
		if err != nil {
			return false, err
		}
		away := 0
		for id := range ve.Addr {
			if v.Addr[id] == "" {
				away++
			}
		}
		if away == 0 {
			continue
		}
		need := ve.Map.Zones()
		for _, vd := range vdis {
			if vd.Epoch > e {
				continue
			}
			copies, known := vd.CopiesAt(e)
			if !known {
				copies = 1
			}
			need = min(need, copies)
		}
		if away >= need {
			return true, nil
		}
	}
	return false, nil
}

// gather lists, from every node of v and from the local store, the
// copies of the objects placed on this node in v.
func (r *recoverer) gather(ctx context.Context, v *view.View) (map[object.ID][]recovery.Copy, error) {
	held := map[object.ID][]recovery.Copy{}
	own, err := r.st.List(0)
	if err != nil {
		return nil, fmt.Errorf("recovery: listing the local store: %w", err)
	}
	for _, in := range own {
		placed, err := r.placedOn(ctx, v, in.ID, r.id)
		if err != nil {
			return nil, err
		}
		if placed {
			held[in.ID] = append(held[in.ID], recovery.Copy{Node: r.id, Version: in.Version, Suspect: in.Suspect, Tombstone: in.Tombstone})
		}
	}
	ids := make([]string, 0, len(v.Addr))
	for id := range v.Addr {
		if id != r.id {
			ids = append(ids, id)
		}
	}
	slices.Sort(ids)
	type listing struct {
		infos []protocol.ObjectInfo
		err   error
	}
	out := make([]listing, len(ids))
	var wg sync.WaitGroup
	for i, id := range ids {
		wg.Add(1)
		go func() {
			defer wg.Done()
			out[i].infos, out[i].err = r.listFor(ctx, v, id)
		}()
	}
	wg.Wait()
	for i, id := range ids {
		if out[i].err != nil {
			return nil, fmt.Errorf("recovery: epoch %d: %w", v.Epoch, out[i].err)
		}
		for _, in := range out[i].infos {
			held[in.ID] = append(held[in.ID], recovery.Copy{Node: id, Version: in.Version, Suspect: in.Suspect, Tombstone: in.Tombstone})
		}
	}
	return held, nil
}

// listFor pages through OpListFor on node id, retrying a node that does
// not answer until ctx ends (a dead node leaves the epoch, which ends
// the run).
func (r *recoverer) listFor(ctx context.Context, v *view.View, id string) ([]protocol.ObjectInfo, error) {
	var all []protocol.ObjectInfo
	for cursor, backoff := uint64(0), 10*time.Millisecond; ; {
		var resp protocol.Response
		req := &protocol.Request{Op: protocol.OpListFor, Epoch: v.Epoch, Offset: cursor, Payload: []byte(r.id)}
		err := r.net.Call(ctx, v.Addr[id], req, &resp)
		if err != nil {
			if ctx.Err() != nil {
				return nil, fmt.Errorf("listing node %s: %w", id, ctx.Err())
			}
			r.dead.report(id)
			select {
			case <-ctx.Done():
				return nil, fmt.Errorf("listing node %s: %w (after %v)", id, ctx.Err(), err)
			case <-time.After(backoff):
			}
			backoff = min(2*backoff, time.Second)
			continue
		}
		page, err := protocol.ParseObjectInfos(nil, resp.Payload)
		if err != nil {
			return nil, fmt.Errorf("listing node %s: %w", id, err)
		}
		all = append(all, page...)
		if len(page) < protocol.MaxListEntries {
			return all, nil
		}
		cursor = uint64(page[len(page)-1].ID) + 1
	}
}

// serveListFor lists the objects held here of which node target is a
// replica in view v, from ID cursor on.
func (r *recoverer) serveListFor(ctx context.Context, v *view.View, target string, cursor uint64) ([]protocol.ObjectInfo, error) {
	infos, err := r.st.List(0)
	if err != nil {
		return nil, err
	}
	var out []protocol.ObjectInfo
	for _, in := range infos {
		if uint64(in.ID) < cursor {
			continue
		}
		placed, err := r.placedOn(ctx, v, in.ID, target)
		if err != nil {
			return nil, err
		}
		if placed {
			out = append(out, infoOf(in))
			if len(out) == protocol.MaxListEntries {
				break
			}
		}
	}
	return out, nil
}

// placedOn reports whether node id is one of obj's replicas in v. An
// object of a VDI the table no longer has is placed nowhere.
func (r *recoverer) placedOn(ctx context.Context, v *view.View, obj object.ID, id string) (bool, error) {
	reps, err := r.replicas(ctx, v, obj)
	if errors.Is(err, errNoVDI) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	return slices.Contains(reps, id), nil
}

var errNoVDI = errors.New("no such VDI")

func (r *recoverer) replicas(ctx context.Context, v *view.View, obj object.ID) ([]string, error) {
	vd, err := r.a.vdiAt(ctx, obj.VDI(), v.Epoch)
	if err != nil {
		if errors.Is(err, membership.ErrNoVDI) {
			return nil, fmt.Errorf("object %s: %w", obj, errNoVDI)
		}
		return nil, fmt.Errorf("object %s: its VDI: %w", obj, err)
	}
	return placeIn(v, obj, vd, nil)
}

// listFor is the handler's ListFor.
func (n *Node) listFor(ctx context.Context, epoch uint64, target string, cursor uint64) ([]protocol.ObjectInfo, error) {
	v, err := n.rec.a.view(ctx, epoch)
	if err != nil {
		return nil, err
	}
	return n.rec.serveListFor(ctx, v, target, cursor)
}
