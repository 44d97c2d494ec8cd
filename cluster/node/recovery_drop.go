package node

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/ovis-storage/ovis/cluster/object"
	"github.com/ovis-storage/ovis/cluster/recovery"
	"github.com/ovis-storage/ovis/cluster/store"
	"github.com/ovis-storage/ovis/cluster/view"
)

// dropMoved deletes the copies this node holds but is no longer placed
// for in v, once every node placed for each has recorded v's epoch as
// recovered. Copies whose new holders are not there yet are left for a
// later pass (the next run, or this one's retries).
func (r *recoverer) dropMoved(ctx context.Context, v *view.View) error {
	clean := false
	for backoff := 100 * time.Millisecond; ; backoff = min(2*backoff, 10*time.Second) {
		infos, err := r.st.List(0)
		if err != nil {
			return err
		}
		rec, err := r.meta.Recovered(ctx)
		if err != nil {
			return err
		}
		left := 0
		gone := map[object.VDI]bool{}
		for _, in := range infos {
			if gone[in.ID.VDI()] {
				continue
			}
			reps, err := r.replicas(ctx, v, in.ID)
			if errors.Is(err, errNoVDI) {
				// The VDI table has no such VDI, and IDs are never
				// reused: it was deleted while this node was away (or
				// the delete missed it). Its objects go now, so that
				// they can never come back.
				gone[in.ID.VDI()] = true
				if err := r.st.RemoveVDI(in.ID.VDI(), r.st.Token(in.ID.VDI())); err != nil {
					return fmt.Errorf("removing the objects of deleted vdi %08x: %w", uint32(in.ID.VDI()), err)
				}
				r.log.Info("removed the objects of a deleted VDI", "vdi", fmt.Sprintf("%08x", uint32(in.ID.VDI())))
				continue
			}
			if err != nil {
				return err
			}
			if slices.Contains(reps, r.id) {
				continue
			}
			through, err := r.recoveredThrough(ctx, in.ID, reps, v.Epoch, rec)
			if err != nil {
				return err
			}
			if !recovery.MayDrop(r.id, reps, v.Epoch, through) {
				left++
				continue
			}
			if err := dropCopy(r.st, in.ID); err != nil {
				return fmt.Errorf("object %s: dropping the moved copy: %w", in.ID, err)
			}
			r.mu.Lock()
			r.stats.Dropped++
			r.mu.Unlock()
		}
		if left == 0 {
			if !clean {
				if err := r.meta.SetClean(ctx, r.id, v.Epoch); err != nil {
					return err
				}
				clean = true
				r.mu.Lock()
				r.clean = v.Epoch
				r.mu.Unlock()
			}
			// Tombstones wait for the other nodes to be clean too; look
			// again now and then until none is left or the epoch moves.
			kept, err := r.forgetTombstones(ctx)
			if err != nil || kept == 0 {
				return err
			}
		}
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(backoff):
		}
	}
}

// recoveredThrough gives, for each node of reps (obj's replicas in epoch
// e), its recorded epoch (rec) when it is at least e and the node stayed
// placed for obj from e up to it: its run then made its copy of obj
// current (recovery.MayDrop). A run of an epoch in which the node was no
// longer placed for obj says nothing of obj.
func (r *recoverer) recoveredThrough(ctx context.Context, obj object.ID, reps []string, e uint64, rec map[string]uint64) (map[string]uint64, error) {
	last := e
	for _, n := range reps {
		last = max(last, rec[n])
	}
	// A record read once the last of those epochs was known gives its
	// copies.
	vd, err := r.a.vdiAt(ctx, obj.VDI(), last)
	if err != nil {
		return nil, fmt.Errorf("object %s: its VDI: %w", obj, err)
	}
	through := make(map[string]uint64, len(reps))
	placed := map[uint64][]string{}
	for _, n := range reps {
		if rec[n] < e {
			continue
		}
		end, err := r.placedRun(ctx, obj, vd, n, e, rec[n], placed)
		if err != nil {
			return nil, err
		}
		if end == rec[n] {
			through[n] = rec[n]
		}
	}
	return through, nil
}

// forgetTombstones deletes the tombstones held here that no node needs
// any more. A tombstone of epoch T may go once every node that ever
// recovered an epoch (so may hold copies) has recorded a clean epoch
// after T: each such node then holds either the tombstone or nothing of
// the object, so no stale copy is left anywhere to come back. A node
// that is away keeps every tombstone since it left alive until it
// returns.
func (r *recoverer) forgetTombstones(ctx context.Context) (kept int, err error) {
	rec, err := r.meta.Recovered(ctx)
	if err != nil {
		return 0, err
	}
	clean, err := r.meta.Clean(ctx)
	if err != nil {
		return 0, err
	}
	floor := recovery.TombstoneFloor(rec, clean)
	infos, err := r.st.List(0)
	if err != nil {
		return 0, err
	}
	forgot := 0
	for _, in := range infos {
		if !in.Tombstone {
			continue
		}
		if store.VersionEpoch(in.Version) >= floor {
			kept++
			continue
		}
		if err := r.st.Forget(in.ID, in.Version); err != nil {
			return kept, fmt.Errorf("object %s: forgetting its tombstone: %w", in.ID, err)
		}
		forgot++
	}
	if forgot > 0 {
		r.log.Info("forgot tombstones every node has seen", "tombstones", forgot, "below_epoch", floor)
	}
	return kept, nil
}
