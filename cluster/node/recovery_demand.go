package node

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/ovis-storage/ovis/cluster/membership"
	"github.com/ovis-storage/ovis/cluster/object"
	"github.com/ovis-storage/ovis/cluster/protocol"
	"github.com/ovis-storage/ovis/cluster/recovery"
	"github.com/ovis-storage/ovis/cluster/store"
	"github.com/ovis-storage/ovis/cluster/view"
)

// ready returns once obj may be served from this node's copy in epoch
// e: at once when it is known current, else after recovering it on
// demand. The handler calls it for every request on an object, and
// calls done when the request ended. A write (write set) holds the
// object until then: a recovery of it (busy) waits for the writes under
// way here to end before it looks at the copy (awaitUnused), and no
// write starts while one runs. Once the run of e is done no recovery of
// e decides anything more (a repair aside, of a copy no write reaches),
// so nothing is held.
func (r *recoverer) ready(ctx context.Context, obj object.ID, e uint64, write bool) (done func(), err error) {
	if r.done.Load() >= e {
		return nop, nil
	}
	for {
		if err := r.awaitIdle(ctx, obj); err != nil {
			return nil, err
		}
		r.mu.Unlock()
		ok, err := r.known(ctx, obj, e)
		if err != nil {
			return nil, err
		}
		if !ok {
			v := r.views.View()
			if v.Epoch != e {
				return nil, fmt.Errorf("object %s: the node moved from epoch %d to %d", obj, e, v.Epoch)
			}
			if err := r.now(ctx, v, obj, false); err != nil {
				return nil, err
			}
			continue // current now: take the object below
		}
		r.mu.Lock()
		if r.busy[obj] != nil {
			r.mu.Unlock()
			continue // a recovery began meanwhile: wait for it
		}
		if !write {
			r.mu.Unlock()
			return nop, nil
		}
		r.using[obj]++
		r.mu.Unlock()
		return func() { r.leave(obj) }, nil
	}
}

func nop() {}

// leave ends one write's hold on obj (ready).
func (r *recoverer) leave(obj object.ID) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.using[obj]--; r.using[obj] > 0 {
		return
	}
	delete(r.using, obj)
	if ch := r.unused[obj]; ch != nil {
		close(ch)
		delete(r.unused, obj)
	}
}

// awaitUnused waits until no write holds obj. The caller made obj busy,
// so no write takes it meanwhile.
func (r *recoverer) awaitUnused(ctx context.Context, obj object.ID) error {
	r.mu.Lock()
	for r.using[obj] > 0 {
		ch := r.unused[obj]
		if ch == nil {
			ch = make(chan struct{})
			r.unused[obj] = ch
		}
		r.mu.Unlock()
		select {
		case <-ch:
		case <-ctx.Done():
			return fmt.Errorf("object %s: waiting for the writes under way: %w", obj, ctx.Err())
		}
		r.mu.Lock()
	}
	r.mu.Unlock()
	return nil
}

// settle readies obj's copy for a look by a recovery that holds it
// (busy): the writes under way here end, and so do those of epochs
// before e (drainOlder), so that the copy's version says all it took.
func (r *recoverer) settle(ctx context.Context, obj object.ID, e uint64) error {
	if err := r.awaitUnused(ctx, obj); err != nil {
		return err
	}
	if err := r.h.drainOlder(ctx, e); err != nil {
		return fmt.Errorf("object %s: %w", obj, err)
	}
	return nil
}

// current reports, without waiting or recovering, whether obj's copy is
// known current in epoch e (the handler's Current).
func (r *recoverer) current(obj object.ID, e uint64) bool {
	ok, err := r.known(context.Background(), obj, e)
	return err == nil && ok
}

// known reports whether obj's copy is known current in epoch e: the run
// of e is done; or obj was recovered on demand in e (early); or the
// run's listing is done, and obj is not pending; or, before that, the
// node was placed for obj in every epoch since it was last current
// (continuous). A copy being recovered is not known current.
//
// A copy recovered on demand is current for the rest of its epoch: every
// write of the epoch that reached the node meanwhile waited for the
// recovery (ready) and was applied after it. Recovering it again in the
// same epoch would be wrong, not only slow: while the epoch's writes are
// in flight, the copies' versions do not order them (disjoint writes
// reach the replicas in different orders, each counting its own), so a
// second decision could pull another replica's copy over this one and
// lose a write this copy took and that one has not received yet.
func (r *recoverer) known(ctx context.Context, obj object.ID, e uint64) (bool, error) {
	if r.done.Load() >= e {
		return true, nil
	}
	r.mu.Lock()
	busy := r.busy[obj] != nil
	st := r.objs.State(obj, e)
	r.mu.Unlock()
	switch {
	case busy:
		return false, nil
	case st != recovery.Undecided:
		return st == recovery.Current, nil
	}
	return r.continuous(ctx, obj, e)
}

// awaitIdle waits until no recovery of obj is under way and returns with
// r.mu held; on ctx's end it returns its error, unlocked.
func (r *recoverer) awaitIdle(ctx context.Context, obj object.ID) error {
	r.mu.Lock()
	for {
		ch := r.busy[obj]
		if ch == nil {
			return nil
		}
		r.mu.Unlock()
		select {
		case <-ch:
		case <-ctx.Done():
			return ctx.Err()
		}
		r.mu.Lock()
	}
}

// now recovers obj on demand: its copies are stat'ed on every node of v,
// and the decision carried out at once. An object the run found unfound
// is refused at once (only a new epoch changes that); one found unfound
// here is refused too (*unfoundError).
func (r *recoverer) now(ctx context.Context, v *view.View, obj object.ID, repair bool) error {
	if err := r.awaitIdle(ctx, obj); err != nil {
		return err
	}
	if r.objs.State(obj, v.Epoch) == recovery.Current && !repair {
		// Recovered while this waited (by the run, or on demand for
		// another request): current now, and not to be decided again.
		r.mu.Unlock()
		return nil
	}
	if away, ok := r.objs.Away(obj, v.Epoch); ok {
		r.mu.Unlock()
		return &unfoundError{obj: obj, away: away}
	}
	ch := make(chan struct{})
	r.busy[obj] = ch
	r.mu.Unlock()
	defer func() {
		r.mu.Lock()
		delete(r.busy, obj)
		r.mu.Unlock()
		close(ch)
	}()
	if err := r.settle(ctx, obj, v.Epoch); err != nil {
		return err
	}
	copies, err := r.statAll(ctx, v, obj)
	if err != nil {
		return err
	}
	rk, err := r.rankerFor(ctx, v.Epoch, false)
	if err != nil {
		return err
	}
	copies, away, err := rk.judge(ctx, obj, copies, v.IDs())
	if err != nil {
		return err
	}
	if away != nil {
		return &unfoundError{obj: obj, away: away}
	}
	st := recovery.Decide(r.id, copies)
	if st.Hide {
		r.log.Info("recovery: on demand, pulling a copy to withhold", "object", obj.String(), "epoch", v.Epoch, "copies", copiesString(copies))
	}
	if err := r.apply(ctx, v, obj, st); err != nil {
		return err
	}
	r.mu.Lock()
	r.objs.Recovered(obj, v.Epoch)
	r.mu.Unlock()
	return nil
}

// liveHere reports whether this node's copy of obj took writes of epoch
// e (recovery.Copy.Live): its version is of e and it is not suspect.
func (r *recoverer) liveHere(obj object.ID, e uint64) (bool, error) {
	in, err := r.st.Stat(obj)
	switch {
	case errors.Is(err, store.ErrNotFound):
		return false, nil
	case err != nil:
		return false, fmt.Errorf("object %s: %w", obj, err)
	}
	return !in.Suspect && store.VersionEpoch(in.Version) == e, nil
}

// repair recovers a copy found suspect while serving a request.
func (r *recoverer) repair(ctx context.Context, obj object.ID, e uint64) error {
	v := r.views.View()
	if v.Epoch != e {
		return fmt.Errorf("object %s: the node moved from epoch %d to %d", obj, e, v.Epoch)
	}
	return r.now(ctx, v, obj, true)
}

// statAll asks every node of v for its copy of obj.
func (r *recoverer) statAll(ctx context.Context, v *view.View, obj object.ID) ([]recovery.Copy, error) {
	var copies []recovery.Copy
	if in, err := r.st.Stat(obj); err == nil {
		copies = append(copies, recovery.Copy{Node: r.id, Version: in.Version, Suspect: in.Suspect, Tombstone: in.Tombstone})
	} else if !errors.Is(err, store.ErrNotFound) {
		return nil, fmt.Errorf("object %s: %w", obj, err)
	}
	var (
		mu   sync.Mutex
		errs []error
		wg   sync.WaitGroup
	)
	for id, addr := range v.Addr {
		if id == r.id {
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			var resp protocol.Response
			req := &protocol.Request{Op: protocol.OpStat, Flags: protocol.FlagRecovery, Epoch: v.Epoch, Object: obj}
			err := r.net.Call(ctx, addr, req, &resp)
			if protocol.StatusOf(err) == protocol.StatusNoEnt {
				return
			}
			var infos []protocol.ObjectInfo
			if err == nil {
				infos, err = protocol.ParseObjectInfos(nil, resp.Payload)
				if err == nil && len(infos) != 1 {
					err = fmt.Errorf("%d object infos", len(infos))
				}
			}
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				r.dead.report(id)
				errs = append(errs, fmt.Errorf("stat on node %s: %w", id, err))
				return
			}
			copies = append(copies, recovery.Copy{Node: id, Version: infos[0].Version, Suspect: infos[0].Suspect, Tombstone: infos[0].Tombstone})
		}()
	}
	wg.Wait()
	if len(errs) > 0 {
		// A node that did not answer may hold the newest copy: deciding
		// without it could serve a stale one.
		return nil, fmt.Errorf("object %s: recovery: %w", obj, errors.Join(errs...))
	}
	return copies, nil
}

// continuous reports whether this node was placed for obj in every epoch
// from its last recovered one (or the VDI's creation, when later) to e:
// every write of obj since then reached it.
func (r *recoverer) continuous(ctx context.Context, obj object.ID, e uint64) (bool, error) {
	vd, err := r.a.vdiAt(ctx, obj.VDI(), e)
	if err != nil {
		if errors.Is(err, membership.ErrNoVDI) {
			return true, nil // no VDI: nothing to serve, nothing to recover
		}
		return false, fmt.Errorf("object %s: its VDI: %w", obj, err)
	}
	end, err := r.placedRun(ctx, obj, vd, r.id, max(vd.Epoch, r.done.Load()), e, map[uint64][]string{})
	return end == e, err
}
