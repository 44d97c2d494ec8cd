package node

import (
	"context"
	"errors"
	"fmt"
	"slices"

	"github.com/ovis-storage/ovis/cluster/membership"
	"github.com/ovis-storage/ovis/cluster/object"
	"github.com/ovis-storage/ovis/cluster/recovery"
	"github.com/ovis-storage/ovis/cluster/view"
)

// ranker ranks the copies of the objects decided in one epoch
// (recovery.Copy.Rank): the latest epoch in which a copy's holder is
// known to have received every acknowledged write of the object.
//
// A copy is known current in an epoch s when its holder completed the
// run of s (its recovered epoch in etcd), or when the VDI was created in
// s (nobody had any write), or when s is the epoch of the copy's version
// (a node takes a write only once its copy is current). From such an s,
// every further epoch in which the holder stays placed for the object
// brought it every acknowledged write too (the gateway acknowledges a
// write only once every replica of the epoch has it). The rank is the
// end of that unbroken run of epochs. A node cut off while its gateway
// wrote ranks at its last epoch; the nodes that went on rank later.
//
// Ranks only ever err low: a recovered epoch read before a newer one was
// recorded, or an epoch no longer kept in etcd, ends the run early.
type ranker struct {
	r    *recoverer
	upTo uint64            // the epoch being recovered
	rec  map[string]uint64 // each node's last recovered epoch; read only
	// lost maps the objects an operator gave up to the epoch of the
	// mark (membership.MarkLost); read only.
	lost map[object.ID]uint64
}

// rankerFor returns a ranker for decisions in epoch e: the one already
// made for e (by the run, or an earlier on-demand recovery), so that an
// object recovered on demand costs no etcd read for it; otherwise one
// made from every node's recovered epoch, read now (fresh: always so,
// for a run, which also sees the objects marked lost since). A ranker
// kept while nodes record newer epochs only ranks lower, which is safe;
// one kept while an object is marked lost still finds it unfound until
// the next run.
func (r *recoverer) rankerFor(ctx context.Context, e uint64, fresh bool) (*ranker, error) {
	r.mu.Lock()
	rk := r.rk
	r.mu.Unlock()
	if rk != nil && rk.upTo == e && !fresh {
		return rk, nil
	}
	rec, err := r.meta.Recovered(ctx)
	if err != nil {
		return nil, fmt.Errorf("recovery: epoch %d: %w", e, err)
	}
	rec[r.id] = max(rec[r.id], r.done.Load())
	lost, err := r.meta.Lost(ctx)
	if err != nil {
		return nil, fmt.Errorf("recovery: epoch %d: %w", e, err)
	}
	rk = &ranker{r: r, upTo: e, rec: rec, lost: lost}
	r.mu.Lock()
	if r.rk == nil || r.rk.upTo <= e {
		r.rk = rk
	}
	r.mu.Unlock()
	return rk, nil
}

// judge ranks obj's copies (those of the nodes of nodes, which all
// answered: the copies they hold are in copies), and says whether they
// settle the object: it sets the Rank of each copy, adds for each node of
// nodes that holds nothing an Absent copy with its rank, when that rank
// says something (above 0), and returns the nodes that did not answer
// and may hold a newer copy (recovery.Unfound), nil when none. An object
// of a VDI the table no longer has is placed nowhere: its copies come
// back as they are, and recovery drops them.
func (k *ranker) judge(ctx context.Context, obj object.ID, copies []recovery.Copy, nodes []string) ([]recovery.Copy, []string, error) {
	vd, err := k.r.a.vdiAt(ctx, obj.VDI(), k.upTo)
	if errors.Is(err, membership.ErrNoVDI) {
		return copies, nil, nil
	}
	if err != nil {
		return nil, nil, fmt.Errorf("object %s: its VDI: %w", obj, err)
	}
	placed := map[uint64][]string{}
	if copies, err = k.rank(ctx, obj, vd, copies, nodes, placed); err != nil {
		return nil, nil, err
	}
	// An object given up (ovis cluster mark-lost) is judged only by the
	// epochs after the mark.
	from := max(vd.Epoch, k.lost[obj]+1)
	away, err := recovery.Unfound(copies, func(id string) bool { _, ok := slices.BinarySearch(nodes, id); return ok }, from, k.upTo,
		func(e uint64) (recovery.Placement, error) {
			reps, err := k.r.placement(ctx, obj, vd, e, placed)
			if errors.Is(err, membership.ErrNoEpoch) {
				// The copies of e are no longer known: every node of e
				// must have answered (some of them were the replicas).
				v, verr := k.r.a.view(ctx, e)
				if verr != nil {
					return recovery.Placement{}, fmt.Errorf("object %s: epoch %d: %w", obj, e, verr)
				}
				return recovery.Placement{Nodes: v.IDs()}, nil
			}
			return recovery.Placement{Nodes: reps, Exact: true}, err
		})
	if err != nil {
		return nil, nil, fmt.Errorf("object %s: %w", obj, err)
	}
	return copies, away, nil
}

// rank sets the Rank of each of obj's copies, and adds for each node of
// nodes that holds nothing an Absent copy with its rank, when that rank
// says something (above 0).
func (k *ranker) rank(ctx context.Context, obj object.ID, vd membership.VDI, copies []recovery.Copy, nodes []string, placed map[uint64][]string) ([]recovery.Copy, error) {
	return recovery.Ranked(copies, nodes, k.upTo, func(id string, version uint64) (uint64, error) {
		return recovery.Rank(version, k.rec[id], vd.Epoch, k.upTo, k.r.placedFn(ctx, obj, vd, id, placed))
	})
}

// placement returns obj's replicas in epoch e, with the VDI's copies of
// that epoch; placed caches them by epoch across calls. An epoch whose
// copies the record no longer says gives membership.ErrNoEpoch, as does
// one etcd no longer keeps.
func (r *recoverer) placement(ctx context.Context, obj object.ID, vd membership.VDI, e uint64, placed map[uint64][]string) ([]string, error) {
	if reps, ok := placed[e]; ok {
		return reps, nil
	}
	// An epoch older than the record's history of its copies is not
	// known.
	if _, known := vd.CopiesAt(e); !known {
		return nil, membership.ErrNoEpoch
	}
	v, err := r.a.view(ctx, e)
	if err != nil {
		return nil, err
	}
	var buf [16]string
	reps, err := placeIn(v, obj, vd, buf[:0])
	if err != nil {
		return nil, err
	}
	reps = slices.Clone(reps)
	placed[e] = reps
	return reps, nil
}

// placeIn places obj in v with the copies its VDI had in v's epoch
// (membership.AlterCopies: requests of that epoch were placed with them,
// not with the newest), appending to buf. Where the record no longer says
// (an epoch before its history of copies), CopiesAt's answer, the oldest
// it knows, is used; placement refuses such epochs before calling.
func placeIn(v *view.View, obj object.ID, vd membership.VDI, buf []string) ([]string, error) {
	copies, _ := vd.CopiesAt(v.Epoch)
	reps, err := v.Map.Place(obj, min(copies, v.Map.Zones()), buf)
	if err != nil {
		return nil, fmt.Errorf("object %s: epoch %d: %w", obj, v.Epoch, err)
	}
	return reps, nil
}

// placedRun returns the last epoch of the unbroken run of epochs from s
// up to upTo in which node id is placed for obj (recovery.PlacedRun).
// An epoch etcd no longer keeps, or whose copies the VDI's record no
// longer says, ends the run. placed caches obj's placement by epoch
// across calls.
func (r *recoverer) placedRun(ctx context.Context, obj object.ID, vd membership.VDI, id string, s, upTo uint64, placed map[uint64][]string) (uint64, error) {
	return recovery.PlacedRun(s, upTo, r.placedFn(ctx, obj, vd, id, placed))
}

// placedFn says, for recovery.Rank and PlacedRun, whether node id is
// placed for obj in an epoch.
func (r *recoverer) placedFn(ctx context.Context, obj object.ID, vd membership.VDI, id string, placed map[uint64][]string) func(e uint64) (bool, bool, error) {
	return func(e uint64) (bool, bool, error) {
		reps, err := r.placement(ctx, obj, vd, e, placed)
		if errors.Is(err, membership.ErrNoEpoch) {
			return false, false, nil
		}
		if err != nil {
			return false, false, fmt.Errorf("object %s: epoch %d: %w", obj, e, err)
		}
		return slices.Contains(reps, id), true, nil
	}
}
