package node

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
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
// The files: recovery.go the run loop and its state; recovery_list.go
// the listing (paged OpListFor) and the objects placed here that no
// node listed (unheld); recovery_pull.go carrying steps out (pulls,
// checksum comparisons, hides); recovery_demand.go the handler's
// questions (ready, known) and recovery on demand; recovery_drop.go
// dropping moved copies and forgetting tombstones; recovery_throttle.go
// the rate bound and pause; rank.go the ranking's inputs from etcd.
//
// Locking: mu guards the run's state; it is never held across I/O. An
// object being recovered is in busy, whose channel closes when it is
// done; requests for it wait on the channel.
type recoverer struct {
	recoveryEnv
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

// recoveryEnv is what the recoverer uses of its node, and all of it:
// its ID, log and clock, its store, the recovery records in etcd (meta), the
// epochs (views), and, set once the handler exists, the peers (net),
// the handler's gates and writes of older epochs (h), and where a peer
// that did not answer is reported (dead).
type recoveryEnv struct {
	id    string
	log   *slog.Logger
	clock func() time.Time // the time of the throttle's, the gates' and the logs' decisions; waits are real
	st    recoveryStore
	meta  recoveryMeta
	views *Views
	net   peerCaller
	h     *Handler
	dead  *deadNodes
}

// recoveryStore is what recovery does to this node's objects
// (store.Store).
type recoveryStore interface {
	List(vdi object.VDI) ([]store.Info, error)
	Stat(id object.ID) (store.Info, error)
	Checksum(id object.ID) (crc uint32, version uint64, err error)
	Token(vdi object.VDI) uint64
	CheckSpace(n int64) error
	Put(id object.ID, version uint64, data []byte) error
	PutTombstone(id object.ID, version uint64) error
	Replace(id object.ID, version uint64, data []byte) error
	ReplaceTombstone(id object.ID, version uint64) error
	ClearSuspect(id object.ID) error
	Drop(id object.ID, version uint64) error
	Forget(id object.ID, version uint64) error
	RemoveVDI(vdi object.VDI, token uint64) error
}

// recoveryMeta is what recovery reads and records in etcd
// (membership.Client).
type recoveryMeta interface {
	Recovered(ctx context.Context) (map[string]uint64, error)
	SetRecovered(ctx context.Context, id string, e uint64) error
	Clean(ctx context.Context) (map[string]uint64, error)
	SetClean(ctx context.Context, id string, e uint64) error
	Lost(ctx context.Context) (map[object.ID]uint64, error)
	ListVDIs(ctx context.Context) ([]membership.VDI, error)
	Allocated(ctx context.Context, id object.VDI) (*object.Set, error)
}

// peerCaller sends one request to a node and waits for its response
// (protocol.Pool, or localCaller, which serves this node's own
// requests in process).
type peerCaller interface {
	Call(ctx context.Context, addr string, req *protocol.Request, resp *protocol.Response) error
}

func newRecoverer(env recoveryEnv, a *authority, done uint64) *recoverer {
	r := &recoverer{recoveryEnv: env, a: a,
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

// loop runs recovery for every new epoch until ctx ends.
func (r *recoverer) loop(ctx context.Context) {
	// A run that finds objects unfound runs again after unfoundWait,
	// which doubles (to maxUnfoundRetry) while the epoch stays: each run
	// lists every node. A holder's return makes a new epoch, and a
	// mark-lost kicks the run, at once.
	var unfoundEpoch uint64
	unfoundWait := unfoundRetry
	for ctx.Err() == nil {
		v := r.views.View()
		if v.Epoch > r.done.Load() {
			rctx, cancel := context.WithCancel(ctx)
			go func() {
				// A newer epoch ends this run.
				if _, err := r.views.Await(rctx, v.Epoch); err == nil {
					cancel()
				}
			}()
			err := r.run(rctx, v)
			cancel()
			if err != nil && ctx.Err() == nil && r.views.Epoch() == v.Epoch {
				r.log.Warn("recovery", "epoch", v.Epoch, "err", err)
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
				_, _ = r.views.Await(wctx, v.Epoch)
				cancel()
				if ctx.Err() != nil {
					return
				}
			}
			continue
		}
		if _, err := r.views.Await(ctx, v.Epoch); err != nil {
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
	start := r.clock()
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
		if st := recovery.Decide(r.id, copies); st.Action != recovery.Keep {
			pending[obj] = st
			if st.Hide {
				r.log.Info("recovery: listed a pull to withhold", "object", obj.String(), "epoch", v.Epoch, "copies", copiesString(copies))
			}
		}
	}
	if err := r.unheld(ctx, v, rk, held, unfound); err != nil {
		return fmt.Errorf("recovery: epoch %d: %w", v.Epoch, err)
	}
	// The Table keeps the maps, and on-demand recoveries change them
	// under mu from now on: their sizes are read before.
	npending, nunfound := len(pending), len(unfound)
	r.mu.Lock()
	if !r.objs.List(v.Epoch, pending, unfound) {
		r.mu.Unlock()
		return nil
	}
	r.mu.Unlock()
	r.log.Info("recovery listed", "epoch", v.Epoch, "objects", len(held), "pending", npending, "unfound", nunfound, "took", r.clock().Sub(start).Round(time.Millisecond))

	if err := r.pullAll(ctx, v); err != nil {
		return err
	}
	if st := r.Stats(); st.Unfound > 0 {
		// Recording E would say this node holds the newest copy of every
		// object placed on it: not of these.
		r.log.Warn("recovery: objects unavailable: every node that may hold their newest copy is away; they are served when one returns",
			"epoch", v.Epoch, "unfound", st.Unfound, "may_be_on", st.UnfoundOn, "objects", st.UnfoundObjects)
		return fmt.Errorf("%w: %d objects, which may be on %v", errRunUnfound, st.Unfound, st.UnfoundOn)
	}
	if err := r.meta.SetRecovered(ctx, r.id, v.Epoch); err != nil {
		return err
	}
	r.done.Store(v.Epoch)
	st := r.Stats()
	r.log.Info("recovery done", "epoch", v.Epoch, "recovered", st.Recovered, "bytes", st.Bytes, "took", r.clock().Sub(start).Round(time.Millisecond))
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
