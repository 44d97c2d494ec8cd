package node

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ovis-storage/ovis/cluster/membership"
	"github.com/ovis-storage/ovis/cluster/object"
	"github.com/ovis-storage/ovis/cluster/protocol"
	"github.com/ovis-storage/ovis/cluster/recovery"
	"github.com/ovis-storage/ovis/cluster/store"
	"github.com/ovis-storage/ovis/cluster/view"
)

// recoverer brings this node's copies up to date after every epoch
// change, and answers the handler's question "may this object be served
// as it is here" (ready). The decisions are cluster/recovery's; this is
// the loop that gathers the copies and carries the steps out.
//
// A run recovers one epoch E:
//
//  1. List: every node of E says which objects it holds that are placed
//     on this node in E (OpListFor), with versions; this node adds its
//     own. recovery.Decide gives a step for each; those not Keep are
//     pending.
//  2. Pull: workers carry out the pending steps, in parallel.
//  3. Record: E is written as this node's recovered epoch in etcd, then
//     kept in done: from then on every object is served without a check.
//     Not while an object placed here is unfound (recovery.Unfound: a
//     node that did not answer may hold its newest copy): the run then
//     pulls the rest and waits for a new epoch (a holder's return), and
//     the unfound objects are served by nobody meanwhile.
//  4. Drop: copies this node holds but is no longer placed for are
//     deleted once every node placed for them has recorded E
//     (recovery.MayDrop).
//
// A newer epoch cancels the run and starts another; what was pulled
// stays pulled (its version now equals the source's), so the new run
// lists again but pulls only what is still behind.
//
// Until the run of the current epoch is done, a request for an object
// is served at once when the object is known current: listed and not
// pending or unfound, or (before the listing ends) placed on this node in every
// epoch since the node's last recovered epoch (or the VDI's creation),
// so that every write of it reached this node. Any other object is
// recovered on demand first (its copies stat'ed on every node of the
// epoch), so that a VM runs while recovery goes on and is never served a
// stale copy.
//
// Locking: mu guards the run's state; it is never held across I/O. An
// object being recovered is in busy, whose channel closes when it is
// done; requests for it wait on the channel.
type recoverer struct {
	n *Node
	a *authority

	done atomic.Uint64 // the last epoch whose run completed

	// Knobs for this package's tests, set while the node runs: runs wait
	// for holdRuns to close before they list, and pulls never hide
	// (noHide), to show what hiding prevents.
	holdRuns atomic.Pointer[chan struct{}]
	noHide   atomic.Bool

	// disagreed is when agreed last logged each object's disagreement
	// (guarded by mu).
	disagreed map[object.ID]time.Time

	mu sync.Mutex
	// objs is each object's recovery state in the epoch of the run under
	// way (or of the last run): pending, unavailable, current, and the
	// objects recovered on demand.
	objs recovery.Table[object.ID]
	busy map[object.ID]chan struct{}
	// using counts, per object, the writes that hold it (ready), and
	// unused has a channel closed when an object's count drops to 0
	// while a recovery waits for it (awaitUnused).
	using  map[object.ID]int
	unused map[object.ID]chan struct{}
	stats  RecoveryStats

	// The throttle: maxRate bytes per second (0: none), paused stops the
	// background pulls; resumed is closed and replaced on every change.
	maxRate int64
	paused  bool
	resumed chan struct{}
	next    time.Time // when the throttle lets the next pull start

	clean uint64 // the last epoch whose moved copies were all dropped

	kicked chan struct{} // closed by kick, and replaced

	rk *ranker // the ranker of the newest epoch decided in (rankerFor)
}

// maxUnfoundShown bounds RecoveryStats.UnfoundObjects.
const maxUnfoundShown = 32

func newRecoverer(n *Node, a *authority, done uint64) *recoverer {
	r := &recoverer{n: n, a: a,
		busy: map[object.ID]chan struct{}{}, using: map[object.ID]int{}, unused: map[object.ID]chan struct{}{}, resumed: make(chan struct{}), kicked: make(chan struct{})}
	r.done.Store(done)
	return r
}

// Stats returns the recovery's progress.
func (r *recoverer) Stats() RecoveryStats {
	r.mu.Lock()
	defer r.mu.Unlock()
	s := r.stats
	s.Epoch, s.Done, s.Listed, s.Pending = r.objs.Epoch(), r.done.Load(), r.objs.Listed(), r.objs.PendingCount()
	s.Paused, s.MaxRate, s.Clean = r.paused, r.maxRate, r.clean
	objs, away := r.objs.Unavailable()
	s.Unfound = len(objs)
	for _, obj := range objs {
		s.UnfoundOn = append(s.UnfoundOn, away[obj]...)
	}
	slices.Sort(s.UnfoundOn)
	s.UnfoundOn = slices.Compact(s.UnfoundOn)
	for _, obj := range objs[:min(len(objs), maxUnfoundShown)] {
		s.UnfoundObjects = append(s.UnfoundObjects, obj.String())
	}
	return s
}

// control applies `ovis node recovery`'s settings.
func (r *recoverer) control(c RecoveryControl) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if c.MaxRate != nil {
		r.maxRate = max(*c.MaxRate, 0)
		r.next = time.Time{}
	}
	if c.Paused != nil {
		r.paused = *c.Paused
	}
	close(r.resumed)
	r.resumed = make(chan struct{})
	if c.MaxRate != nil || c.Paused != nil {
		r.n.log.Info("recovery settings", "paused", r.paused, "max_rate", r.maxRate)
	}
}

// throttle waits until a background pull of n bytes may start: not while
// paused, and no faster than maxRate over time. On-demand recoveries do
// not wait: a VM's request is never held back by the throttle.
func (r *recoverer) throttle(ctx context.Context, n int64) error {
	for {
		r.mu.Lock()
		paused, wake := r.paused, r.resumed
		var wait time.Duration
		if !paused && r.maxRate > 0 {
			now := time.Now()
			if r.next.Before(now) {
				r.next = now
			}
			wait = r.next.Sub(now)
			if wait == 0 {
				r.next = r.next.Add(time.Duration(float64(n) / float64(r.maxRate) * float64(time.Second)))
			}
		}
		r.mu.Unlock()
		if !paused && wait == 0 {
			return nil
		}
		var t *time.Timer
		var tc <-chan time.Time
		if !paused {
			t = time.NewTimer(wait)
			tc = t.C
		}
		select {
		case <-ctx.Done():
		case <-wake:
		case <-tc:
		}
		if t != nil {
			t.Stop()
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
	}
}

// loop runs recovery for every new epoch until ctx ends.
func (r *recoverer) loop(ctx context.Context) {
	// A run that finds objects unfound runs again after unfoundWait,
	// which doubles (to maxUnfoundRetry) while the epoch stays: each run
	// lists every node. A holder's return makes a new epoch, and a
	// mark-lost kicks the run, at once.
	var unfoundEpoch uint64
	unfoundWait := unfoundRetry
	for ctx.Err() == nil {
		v := r.n.views.View()
		if v.Epoch > r.done.Load() {
			rctx, cancel := context.WithCancel(ctx)
			go func() {
				// A newer epoch ends this run.
				if _, err := r.n.views.Await(rctx, v.Epoch); err == nil {
					cancel()
				}
			}()
			err := r.run(rctx, v)
			cancel()
			if err != nil && ctx.Err() == nil && r.n.views.Epoch() == v.Epoch {
				r.n.log.Warn("recovery", "epoch", v.Epoch, "err", err)
				// An unfound object waits for a holder's return, which
				// makes a new epoch; look again now and then all the same.
				wait := 500 * time.Millisecond
				if errors.Is(err, errRunUnfound) {
					if unfoundEpoch != v.Epoch {
						unfoundEpoch, unfoundWait = v.Epoch, unfoundRetry
					}
					wait, unfoundWait = unfoundWait, min(2*unfoundWait, maxUnfoundRetry)
				}
				r.mu.Lock()
				kicked := r.kicked
				r.mu.Unlock()
				wctx, cancel := context.WithTimeout(ctx, wait)
				// Ends with wctx, at the latest when the wait does.
				go func() {
					select {
					case <-kicked:
						cancel()
					case <-wctx.Done():
					}
				}()
				_, _ = r.n.views.Await(wctx, v.Epoch)
				cancel()
				if ctx.Err() != nil {
					return
				}
			}
			continue
		}
		if _, err := r.n.views.Await(ctx, v.Epoch); err != nil {
			return
		}
	}
}

// run recovers epoch v.Epoch.
func (r *recoverer) run(ctx context.Context, v *view.View) error {
	r.mu.Lock()
	if r.objs.Epoch() != v.Epoch {
		r.stats = RecoveryStats{}
	}
	r.objs.Begin(v.Epoch)
	r.mu.Unlock()
	start := time.Now()
	r.a.forgetVDIs()
	if hold := r.holdRuns.Load(); hold != nil {
		select {
		case <-*hold:
		case <-ctx.Done():
			return ctx.Err()
		}
	}

	held, err := r.gather(ctx, v)
	if err != nil {
		return err
	}
	rk, err := r.rankerFor(ctx, v.Epoch, true)
	if err != nil {
		return err
	}
	nodes := v.IDs()
	pending := map[object.ID]recovery.Step{}
	unfound := map[object.ID][]string{}
	for obj, copies := range held {
		copies, away, err := rk.judge(ctx, obj, copies, nodes)
		if err != nil {
			return fmt.Errorf("recovery: epoch %d: %w", v.Epoch, err)
		}
		if away != nil {
			unfound[obj] = away
			continue
		}
		if st := recovery.Decide(r.n.id, copies); st.Action != recovery.Keep {
			pending[obj] = st
			if st.Hide {
				r.n.log.Info("recovery: listed a pull to withhold", "object", obj.String(), "epoch", v.Epoch, "copies", copiesString(copies))
			}
		}
	}
	if err := r.unheld(ctx, v, rk, held, unfound); err != nil {
		return fmt.Errorf("recovery: epoch %d: %w", v.Epoch, err)
	}
	r.mu.Lock()
	if !r.objs.List(v.Epoch, pending, unfound) {
		r.mu.Unlock()
		return nil
	}
	r.mu.Unlock()
	r.n.log.Info("recovery listed", "epoch", v.Epoch, "objects", len(held), "pending", len(pending), "unfound", len(unfound), "took", time.Since(start).Round(time.Millisecond))

	if err := r.pullAll(ctx, v); err != nil {
		return err
	}
	if st := r.Stats(); st.Unfound > 0 {
		// Recording E would say this node holds the newest copy of every
		// object placed on it: not of these.
		r.n.log.Warn("recovery: objects unavailable: every node that may hold their newest copy is away; they are served when one returns",
			"epoch", v.Epoch, "unfound", st.Unfound, "may_be_on", st.UnfoundOn, "objects", st.UnfoundObjects)
		return fmt.Errorf("%w: %d objects, which may be on %v", errRunUnfound, st.Unfound, st.UnfoundOn)
	}
	if err := r.n.mc.SetRecovered(ctx, r.n.id, v.Epoch); err != nil {
		return err
	}
	r.done.Store(v.Epoch)
	st := r.Stats()
	r.n.log.Info("recovery done", "epoch", v.Epoch, "recovered", st.Recovered, "bytes", st.Bytes, "took", time.Since(start).Round(time.Millisecond))
	return r.dropMoved(ctx, v)
}

// unfoundObjects lists every object the run found unfound, sorted.
func (r *recoverer) unfoundObjects() []UnfoundObject {
	r.mu.Lock()
	defer r.mu.Unlock()
	objs, away := r.objs.Unavailable()
	out := make([]UnfoundObject, 0, len(objs))
	for _, obj := range objs {
		out = append(out, UnfoundObject{Object: obj.String(), On: away[obj]})
	}
	return out // Unavailable sorts by ID, which String keeps (fixed-width hex)
}

// errRunUnfound ends a run that found objects unavailable: it is not
// recorded. unfoundRetry is how long the node waits before it runs again
// in the same epoch (a holder's return makes a new epoch at once).
var errRunUnfound = errors.New("recovery: the run is incomplete: objects are unfound")

const (
	unfoundRetry    = 5 * time.Second
	maxUnfoundRetry = time.Minute
)

// kick makes a run that waits (after finding objects unfound) run again
// now: objects were given up (mark-lost).
func (r *recoverer) kick() {
	r.mu.Lock()
	close(r.kicked)
	r.kicked = make(chan struct{})
	r.mu.Unlock()
}

// unfoundError refuses a request on an object whose newest copy may be on
// nodes that are away.
type unfoundError struct {
	obj  object.ID
	away []string
}

func (e *unfoundError) Error() string {
	return fmt.Sprintf("object %s is unavailable: every node that may hold its newest copy is away (%s)", e.obj, strings.Join(e.away, ", "))
}

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
	vdis, err := r.n.mc.ListVDIs(ctx)
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
			written, err := r.n.mc.Allocated(ctx, vd.ID)
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
			mine, err := r.placedOn(ctx, v, obj, r.n.id)
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
	own, err := r.n.st.List(0)
	if err != nil {
		return nil, fmt.Errorf("recovery: listing the local store: %w", err)
	}
	for _, in := range own {
		placed, err := r.placedOn(ctx, v, in.ID, r.n.id)
		if err != nil {
			return nil, err
		}
		if placed {
			held[in.ID] = append(held[in.ID], recovery.Copy{Node: r.n.id, Version: in.Version, Suspect: in.Suspect, Tombstone: in.Tombstone})
		}
	}
	ids := make([]string, 0, len(v.Addr))
	for id := range v.Addr {
		if id != r.n.id {
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
		req := &protocol.Request{Op: protocol.OpListFor, Epoch: v.Epoch, Offset: cursor, Payload: []byte(r.n.id)}
		err := r.n.net.Call(ctx, v.Addr[id], req, &resp)
		if err != nil {
			if ctx.Err() != nil {
				return nil, fmt.Errorf("listing node %s: %w", id, ctx.Err())
			}
			r.n.dead.report(id)
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
	infos, err := r.n.st.List(0)
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

// pullAll carries out the pending steps with a few workers, until none
// is left or ctx ends. A step that fails is tried again after a pause.
func (r *recoverer) pullAll(ctx context.Context, v *view.View) error {
	for {
		r.mu.Lock()
		var todo []object.ID
		for _, obj := range r.objs.Pending() {
			if r.busy[obj] == nil {
				todo = append(todo, obj)
			}
		}
		left := r.objs.PendingCount()
		r.mu.Unlock()
		if left == 0 {
			return nil
		}
		work := make(chan object.ID)
		var wg sync.WaitGroup
		var failed atomic.Int64
		for range 4 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for obj := range work {
					if err := r.recoverPending(ctx, v, obj); err != nil {
						failed.Add(1)
						if ctx.Err() == nil {
							r.n.log.Warn("recovery: object", "object", obj.String(), "err", err)
						}
					}
				}
			}()
		}
	feed:
		for _, obj := range todo {
			select {
			case work <- obj:
			case <-ctx.Done():
				break feed
			}
		}
		close(work)
		wg.Wait()
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if failed.Load() > 0 || len(todo) == 0 {
			// Failures wait before another pass; with nothing to take,
			// on-demand recoveries hold the rest.
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(200 * time.Millisecond):
			}
		}
	}
}

// recoverPending carries out obj's pending step, unless a request got to
// it first.
func (r *recoverer) recoverPending(ctx context.Context, v *view.View, obj object.ID) error {
	r.mu.Lock()
	st, ok := r.objs.Step(obj, v.Epoch)
	if !ok || r.busy[obj] != nil {
		r.mu.Unlock()
		return nil
	}
	r.mu.Unlock()
	// The throttle counts whole objects: what a pull may move.
	size := int64(4 << 20)
	if vd, err := r.a.vdi(ctx, obj.VDI()); err == nil {
		size = 1 << vd.ObjectShift
	}
	if err := r.throttle(ctx, size); err != nil {
		return err
	}
	r.mu.Lock()
	st, ok = r.objs.Step(obj, v.Epoch)
	if !ok || r.busy[obj] != nil {
		r.mu.Unlock()
		return nil // recovered on demand meanwhile
	}
	ch := make(chan struct{})
	r.busy[obj] = ch
	r.mu.Unlock()
	err := r.settle(ctx, obj, v.Epoch)
	if err == nil {
		if live, lerr := r.liveHere(obj, v.Epoch); lerr != nil {
			err = lerr
		} else if !live {
			err = r.apply(ctx, v, obj, st)
		}
		// A copy that took writes of the epoch since the listing is
		// kept (recovery invariant 6): the step was decided without
		// them.
	}
	r.mu.Lock()
	delete(r.busy, obj)
	if err == nil {
		r.objs.Pulled(obj, v.Epoch)
	}
	r.mu.Unlock()
	close(ch)
	return err
}

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
			v := r.n.views.View()
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
	if err := r.n.h.drainOlder(ctx, e); err != nil {
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
	st := recovery.Decide(r.n.id, copies)
	if st.Hide {
		r.n.log.Info("recovery: on demand, pulling a copy to withhold", "object", obj.String(), "epoch", v.Epoch, "copies", copiesString(copies))
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
	in, err := r.n.st.Stat(obj)
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
	v := r.n.views.View()
	if v.Epoch != e {
		return fmt.Errorf("object %s: the node moved from epoch %d to %d", obj, e, v.Epoch)
	}
	return r.now(ctx, v, obj, true)
}

// statAll asks every node of v for its copy of obj.
func (r *recoverer) statAll(ctx context.Context, v *view.View, obj object.ID) ([]recovery.Copy, error) {
	var copies []recovery.Copy
	if in, err := r.n.st.Stat(obj); err == nil {
		copies = append(copies, recovery.Copy{Node: r.n.id, Version: in.Version, Suspect: in.Suspect, Tombstone: in.Tombstone})
	} else if !errors.Is(err, store.ErrNotFound) {
		return nil, fmt.Errorf("object %s: %w", obj, err)
	}
	var (
		mu   sync.Mutex
		errs []error
		wg   sync.WaitGroup
	)
	for id, addr := range v.Addr {
		if id == r.n.id {
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			var resp protocol.Response
			req := &protocol.Request{Op: protocol.OpStat, Flags: protocol.FlagRecovery, Epoch: v.Epoch, Object: obj}
			err := r.n.net.Call(ctx, addr, req, &resp)
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
				r.n.dead.report(id)
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
	end, err := r.placedRun(ctx, obj, vd, r.n.id, max(vd.Epoch, r.done.Load()), e, map[uint64][]string{})
	return end == e, err
}

// apply carries out one step for obj.
func (r *recoverer) apply(ctx context.Context, v *view.View, obj object.ID, st recovery.Step) error {
	switch st.Action {
	case recovery.Keep:
		return nil
	case recovery.Trust:
		// Every copy is suspect (every holder crashed with writes to it
		// not yet durable): this one was chosen, and the others copy it.
		r.n.log.Warn("recovery: every copy is suspect; keeping this node's", "object", obj.String(), "version", st.Version)
		return r.n.st.ClearSuspect(obj)
	case recovery.Drop:
		// Nodes of a higher rank hold nothing: this copy holds only
		// writes never acknowledged (a cut-off writer's).
		r.n.log.Info("recovery: dropping a copy the nodes that went on never had", "object", obj.String(), "version", st.Version)
		if err := r.n.st.Drop(obj, st.Version); err != nil {
			return err
		}
		r.count(0)
		return nil
	case recovery.PullTombstone:
		unhide := r.hide(obj, v.Epoch, st)
		var err error
		if st.Replace {
			err = r.n.st.ReplaceTombstone(obj, st.Version)
		} else {
			err = putTombstone(r.n.st, obj, st.Version)
		}
		if err == nil {
			r.count(0)
		} else {
			unhide()
		}
		return err
	case recovery.Pull:
		if st.Verify {
			same, err := r.sameBytes(ctx, v, obj, st)
			if err != nil {
				return err
			}
			if same {
				return nil // this copy is the source's: kept
			}
		}
		data, ver, err := r.fetch(ctx, v, obj, st)
		if err != nil {
			return err
		}
		if err := r.n.st.CheckSpace(int64(len(data))); err != nil {
			// Recovery never fills a disk past its reserve: the object
			// stays pending (its other copies serve it) until space is
			// freed or the placement moves it.
			return fmt.Errorf("object %s: recovery: %w", obj, err)
		}
		install := func(id object.ID, ver uint64, data []byte) error { return putIfNewer(r.n.st, id, ver, data) }
		if st.Replace {
			// This node's copy, of a lower rank, holds writes never
			// acknowledged: it goes although its version is higher. The
			// object is busy or pending meanwhile, so no write races.
			r.n.log.Info("recovery: replacing a copy of a lower rank", "object", obj.String(), "source", st.Source, "version", ver)
			install = r.n.st.Replace
		}
		unhide := r.hide(obj, v.Epoch, st)
		if err := install(obj, ver, data); err != nil {
			unhide()
			return fmt.Errorf("object %s: storing the copy from %s: %w", obj, st.Source, err)
		}
		r.count(int64(len(data)))
		return nil
	}
	return fmt.Errorf("object %s: unknown recovery step %v", obj, st.Action)
}

// sameBytes reports whether this node's copy of obj and st.Source's
// hold the same bytes at st.Version (recovery.Step.Verify): each
// checksummed where it is, so that only two checksums cross the network.
// A copy that moved on meanwhile, or went, is not the same.
func (r *recoverer) sameBytes(ctx context.Context, v *view.View, obj object.ID, st recovery.Step) (bool, error) {
	crc, ver, err := r.n.st.Checksum(obj)
	switch {
	case errors.Is(err, store.ErrNotFound) || errors.Is(err, store.ErrSuspect):
		return false, nil
	case err != nil:
		return false, fmt.Errorf("object %s: checksum of this copy: %w", obj, err)
	case ver != st.Version:
		return false, nil
	}
	addr := v.Addr[st.Source]
	if addr == "" {
		return false, fmt.Errorf("object %s: source %s left the epoch", obj, st.Source)
	}
	var resp protocol.Response
	req := &protocol.Request{Op: protocol.OpChecksum, Flags: protocol.FlagRecovery, Epoch: v.Epoch, Object: obj, Length: protocol.MaxObjectSpan}
	if err := r.n.net.Call(ctx, addr, req, &resp); err != nil {
		if protocol.StatusOf(err) == protocol.StatusNoEnt {
			return false, nil
		}
		return false, fmt.Errorf("object %s: checksum on %s: %w", obj, st.Source, err)
	}
	scrc, sver, err := protocol.ParseChecksumReply(resp.Payload)
	if err != nil {
		return false, fmt.Errorf("object %s: checksum on %s: %w", obj, st.Source, err)
	}
	return scrc == crc && sver == ver, nil
}

// hide withholds obj from readers before a pull of st stores it, when
// st says the copy holds a write that another copy served as current
// lacks (recovery.Step.Hide); the gate table releases it once the
// copies agree. It returns what undoes it when the pull stores nothing.
func (r *recoverer) hide(obj object.ID, e uint64, st recovery.Step) (unhide func()) {
	if !st.Hide || r.n.h == nil || r.noHide.Load() {
		return func() {}
	}
	r.n.log.Info("recovery: withholding a pulled copy until its peers have it: it holds a write never acknowledged", "object", obj.String(), "source", st.Source, "version", st.Version)
	r.n.h.gates.hide(obj, e, time.Now())
	return func() { r.n.h.gates.unhide(obj) }
}

func (r *recoverer) count(bytes int64) {
	r.mu.Lock()
	r.stats.Recovered++
	r.stats.Bytes += bytes
	r.mu.Unlock()
}

// fetch reads obj's copy from the step's source as it is: its extents,
// then its data ranges. The version is the one the source reported
// first; writes that land on the source meanwhile reach this node too
// (it is placed for obj, and holds them back until obj is recovered), so
// they are applied again on top.
func (r *recoverer) fetch(ctx context.Context, v *view.View, obj object.ID, st recovery.Step) ([]byte, uint64, error) {
	addr := v.Addr[st.Source]
	if addr == "" {
		return nil, 0, fmt.Errorf("object %s: source %s left the epoch", obj, st.Source)
	}
	vd, err := r.a.vdi(ctx, obj.VDI())
	if err != nil {
		return nil, 0, fmt.Errorf("object %s: its VDI: %w", obj, err)
	}
	size := uint32(1) << vd.ObjectShift
	var ver uint64
	// A suspect source cannot map its extents: read it whole (Put makes
	// holes of its zeros again).
	ext := []protocol.Extent{{Offset: 0, Length: uint64(size)}}
	if !st.FromSuspect {
		var resp protocol.Response
		req := &protocol.Request{Op: protocol.OpExtents, Flags: protocol.FlagRecovery, Epoch: v.Epoch, Object: obj, Length: size}
		if err := r.n.net.Call(ctx, addr, req, &resp); err != nil {
			return nil, 0, fmt.Errorf("object %s: extents on %s: %w", obj, st.Source, err)
		}
		ver = resp.Version
		if ext, err = protocol.ParseExtents(nil, resp.Payload); err != nil {
			return nil, 0, fmt.Errorf("object %s: extents on %s: %w", obj, st.Source, err)
		}
	}
	var end uint64
	for _, e := range ext {
		if !e.Hole {
			end = max(end, min(e.Offset+e.Length, uint64(size)))
		}
	}
	data := make([]byte, end)
	const chunk = 4 << 20
	for _, e := range ext {
		if e.Hole {
			continue
		}
		for off := e.Offset; off < min(e.Offset+e.Length, end); off += chunk {
			n := min(chunk, min(e.Offset+e.Length, end)-off)
			var rr protocol.Response
			rr.Payload = data[off : off : off+n]
			req := &protocol.Request{Op: protocol.OpRead, Flags: protocol.FlagRecovery, Epoch: v.Epoch, Object: obj, Offset: off, Length: uint32(n)}
			if err := r.n.net.Call(ctx, addr, req, &rr); err != nil {
				return nil, 0, fmt.Errorf("object %s: read %d+%d on %s: %w", obj, off, n, st.Source, err)
			}
			if uint64(len(rr.Payload)) != n {
				return nil, 0, fmt.Errorf("object %s: read %d+%d on %s: %d bytes", obj, off, n, st.Source, len(rr.Payload))
			}
			if &rr.Payload[0] != &data[off] {
				copy(data[off:], rr.Payload)
			}
			if ver == 0 {
				ver = rr.Version
			}
		}
	}
	if ver == 0 {
		ver = st.Version
	}
	return data, ver, nil
}

// dropMoved deletes the copies this node holds but is no longer placed
// for in v, once every node placed for each has recorded v's epoch as
// recovered. Copies whose new holders are not there yet are left for a
// later pass (the next run, or this one's retries).
func (r *recoverer) dropMoved(ctx context.Context, v *view.View) error {
	clean := false
	for backoff := 100 * time.Millisecond; ; backoff = min(2*backoff, 10*time.Second) {
		infos, err := r.n.st.List(0)
		if err != nil {
			return err
		}
		rec, err := r.n.mc.Recovered(ctx)
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
				if err := r.n.st.RemoveVDI(in.ID.VDI(), r.n.st.Token(in.ID.VDI())); err != nil {
					return fmt.Errorf("removing the objects of deleted vdi %08x: %w", uint32(in.ID.VDI()), err)
				}
				r.n.log.Info("removed the objects of a deleted VDI", "vdi", fmt.Sprintf("%08x", uint32(in.ID.VDI())))
				continue
			}
			if err != nil {
				return err
			}
			if slices.Contains(reps, r.n.id) {
				continue
			}
			through, err := r.recoveredThrough(ctx, in.ID, reps, v.Epoch, rec)
			if err != nil {
				return err
			}
			if !recovery.MayDrop(r.n.id, reps, v.Epoch, through) {
				left++
				continue
			}
			if err := dropCopy(r.n.st, in.ID); err != nil {
				return fmt.Errorf("object %s: dropping the moved copy: %w", in.ID, err)
			}
			r.mu.Lock()
			r.stats.Dropped++
			r.mu.Unlock()
		}
		if left == 0 {
			if !clean {
				if err := r.n.mc.SetClean(ctx, r.n.id, v.Epoch); err != nil {
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
	rec, err := r.n.mc.Recovered(ctx)
	if err != nil {
		return 0, err
	}
	clean, err := r.n.mc.Clean(ctx)
	if err != nil {
		return 0, err
	}
	floor := recovery.TombstoneFloor(rec, clean)
	infos, err := r.n.st.List(0)
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
		if err := r.n.st.Forget(in.ID, in.Version); err != nil {
			return kept, fmt.Errorf("object %s: forgetting its tombstone: %w", in.ID, err)
		}
		forgot++
	}
	if forgot > 0 {
		r.n.log.Info("forgot tombstones every node has seen", "tombstones", forgot, "below_epoch", floor)
	}
	return kept, nil
}

// listFor is the handler's ListFor.
func (n *Node) listFor(ctx context.Context, epoch uint64, target string, cursor uint64) ([]protocol.ObjectInfo, error) {
	v, err := n.rec.a.view(ctx, epoch)
	if err != nil {
		return nil, err
	}
	return n.rec.serveListFor(ctx, v, target, cursor)
}

// copiesString describes copies for a log line: node:epoch.count, with
// the rank and marks.
func copiesString(copies []recovery.Copy) string {
	var b strings.Builder
	for i, c := range copies {
		if i > 0 {
			b.WriteString(" ")
		}
		fmt.Fprintf(&b, "%s:%d.%d/r%d", c.Node, store.VersionEpoch(c.Version), store.VersionCount(c.Version), c.Rank)
		for _, m := range []struct {
			on   bool
			name string
		}{{c.Absent, "absent"}, {c.Live, "live"}, {c.Suspect, "suspect"}, {c.Tombstone, "tombstone"}} {
			if m.on {
				b.WriteString("," + m.name)
			}
		}
	}
	return b.String()
}
