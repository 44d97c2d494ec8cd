package recovery

import (
	"cmp"
	"slices"
)

// State is what one node knows of its copy of one object in one epoch,
// for serving it: whether a request may use the copy as it is.
type State int

const (
	// Undecided: the run of the epoch has not listed the object yet,
	// and it was not recovered on demand. The node may still know the
	// copy current another way (placed here in every epoch since it was
	// last current), else it recovers it on demand first.
	Undecided State = iota
	// Current: recovered on demand in the epoch, or listed and needing
	// nothing. Served as it is for the rest of the epoch, and never
	// decided again in it (Table.Recovered says why).
	Current
	// Pending: listed with a step to carry out (Table.Step).
	Pending
	// Unavailable: every node that may hold the newest copy is away
	// (invariant 5); neither served nor decided until a holder returns
	// (a new epoch) or an operator gives the object up.
	Unavailable
)

func (s State) String() string {
	switch s {
	case Undecided:
		return "undecided"
	case Current:
		return "current"
	case Pending:
		return "pending"
	case Unavailable:
		return "unavailable"
	}
	return "state?"
}

// Table is one node's per-object recovery state: for the epoch whose run
// is under way (or ran last), what its listing decided for each object
// placed here, and which objects were recovered on demand, in which
// epoch. Every change of an object's State is a method here; the node's
// loop (cluster/node) carries out the steps and holds the lock that
// guards the Table, which does no I/O and keeps no time.
//
// Transitions, for an object in epoch E (the Table's epoch):
//
//	Undecided   --List(E): step-->       Pending
//	Undecided   --List(E): no step-->    Current
//	Undecided   --List(E): away-->       Unavailable
//	Pending     --Pulled(E)-->           Current
//	any         --Recovered(E)-->        Current (for good in E)
//	any         --Begin(E' != E)-->      Undecided in E' (Current if
//	                                     recovered on demand in E')
//
// K is the objects' key (cluster/K in the node). The zero Table
// is empty, at epoch 0.
type Table[K cmp.Ordered] struct {
	epoch  uint64
	listed bool // the run's listing of epoch is in: pending and away are exact
	// pending is the listing's step for each object that needs one.
	pending map[K]Step
	// away is, for each object the listing found unavailable, the nodes
	// that may hold its newest copy.
	away map[K][]string
	// early is, for each object recovered on demand, the epoch it was
	// recovered in.
	early map[K]uint64
}

// Epoch is the epoch of the run under way, or of the last run.
func (t *Table[K]) Epoch() uint64 { return t.epoch }

// Listed reports whether the run of Epoch has listed its objects.
func (t *Table[K]) Listed() bool { return t.listed }

// Begin starts the run of epoch e. A new epoch forgets the old run's
// listing and the objects recovered on demand in other epochs; those
// recovered on demand in e before its run began stay current (those
// copies took e's writes since). The same epoch again (a run tried
// again) keeps everything.
func (t *Table[K]) Begin(e uint64) {
	if e == t.epoch {
		return
	}
	t.epoch, t.listed = e, false
	t.pending, t.away = nil, nil
	for obj, re := range t.early {
		if re != e {
			delete(t.early, obj)
		}
	}
}

// List installs the listing of epoch e: the step of each object that
// needs one, and the nodes that may hold the newest copy of each object
// found unavailable. It does nothing and returns false when the Table
// moved on to another epoch meanwhile. An object recovered on demand in
// e is current already and keeps out of both. The Table keeps the maps.
func (t *Table[K]) List(e uint64, pending map[K]Step, away map[K][]string) bool {
	if e != t.epoch {
		return false
	}
	for obj, re := range t.early {
		if re == e {
			delete(pending, obj)
			delete(away, obj)
		}
	}
	t.pending, t.away, t.listed = pending, away, true
	return true
}

// State is obj's state in epoch e.
func (t *Table[K]) State(obj K, e uint64) State {
	if t.early[obj] == e && e != 0 {
		return Current
	}
	if !t.listed || t.epoch != e {
		return Undecided
	}
	if _, ok := t.pending[obj]; ok {
		return Pending
	}
	if _, ok := t.away[obj]; ok {
		return Unavailable
	}
	return Current
}

// Step is obj's pending step in epoch e, if it has one.
func (t *Table[K]) Step(obj K, e uint64) (Step, bool) {
	if t.epoch != e || t.early[obj] == e {
		return Step{}, false
	}
	st, ok := t.pending[obj]
	return st, ok
}

// Away is the nodes that may hold obj's newest copy, when the listing of
// e found it unavailable.
func (t *Table[K]) Away(obj K, e uint64) ([]string, bool) {
	if t.epoch != e || t.early[obj] == e {
		return nil, false
	}
	away, ok := t.away[obj]
	return away, ok
}

// Pulled records that obj's pending step of epoch e was carried out.
func (t *Table[K]) Pulled(obj K, e uint64) {
	if t.epoch == e {
		delete(t.pending, obj)
	}
}

// Recovered records that obj was recovered on demand in epoch e: its
// copy is current for the rest of e, whatever the run lists. Deciding it
// again in e would be wrong, not only slow: while the epoch's writes are
// in flight, the copies' versions do not order them (disjoint writes
// reach the replicas in different orders, each counting its own), so a
// second decision could pull another replica's copy over this one and
// lose a write this copy took that the other has not received yet.
func (t *Table[K]) Recovered(obj K, e uint64) {
	if t.epoch == e {
		delete(t.pending, obj)
		delete(t.away, obj)
	}
	if t.early == nil {
		t.early = map[K]uint64{}
	}
	t.early[obj] = e
}

// Pending is the objects with a pending step in the Table's epoch,
// sorted.
func (t *Table[K]) Pending() []K {
	out := make([]K, 0, len(t.pending))
	for obj := range t.pending {
		out = append(out, obj)
	}
	slices.Sort(out)
	return out
}

// PendingCount is len(Pending()), without the list.
func (t *Table[K]) PendingCount() int { return len(t.pending) }

// UnavailableCount is how many objects the listing found unavailable.
func (t *Table[K]) UnavailableCount() int { return len(t.away) }

// Unavailable is the objects found unavailable in the Table's epoch,
// sorted, each with the nodes that may hold its newest copy.
func (t *Table[K]) Unavailable() (objs []K, away map[K][]string) {
	objs = make([]K, 0, len(t.away))
	for obj := range t.away {
		objs = append(objs, obj)
	}
	slices.Sort(objs)
	return objs, t.away
}
