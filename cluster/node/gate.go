package node

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ovis-storage/ovis/cluster/object"
	"github.com/ovis-storage/ovis/cluster/protocol"
	"github.com/ovis-storage/ovis/cluster/store"
)

// gateTable holds the gated ranges of this node's copies: the ranges of
// gateway writes (protocol.FlagGated) that some replica may not have
// yet. A read overlapping one waits until it is released, so that no
// reader sees a write here that a reader of another replica could then
// miss (docs/protocol.md, "The read model").
//
// A gate is released when:
//
//  1. an OpSettle names it: every replica acknowledged the write, or
//     its gateway gave up on it;
//  2. the node has been in a newer epoch than every attempt of the
//     write it saw for at least the hold (Handler.GateHold), and the
//     object's copies agree in that epoch (Handler.Agreed: this one is
//     current and every replica's holds the same bytes): a live writer
//     would have resent the write in the new epoch by then (which
//     renews the gate) or settled it, so its gateway is gone, and no
//     reader of another replica can miss what this one shows
//     (releaseOld);
//     A hide (recovery's: a pulled copy holding a write never
//     acknowledged, recovery.Step.Hide) has no writer to wait for: rule
//     2 releases it once the copies agree, without the hold;
//  3. it was last installed longer ago than the age limit
//     (Handler.GateMaxAge): no live writer keeps a write in flight that
//     long, so its settle was lost (a Close during a network fault) or
//     its gateway is gone without an epoch change; the node must not
//     withhold the range for ever.
//
// Invariants:
//
//  1. A gate is installed before its write reaches the store, and
//     removed only by one of the three rules above. (A write that
//     reaches the handler after its settle, delayed there while its
//     gateway had given up on that attempt, installs a gate that only
//     rules 2 and 3 release. A hide also goes when the pull it was
//     for stored nothing.)
//  2. count is the number of gates installed, installs the number of
//     installations ever; both change only under mu, and installs
//     grows before a gated write reaches the store. A read that took
//     its ticket (begin) before an installation sees installs move
//     (valid), so a read that raced a gated write is never served from
//     what it read: it goes again.
//  3. Per object, last is the installs count of the object's newest
//     installation; an object with neither gates nor draining ones has
//     no entry.
//
// Locking: mu guards objs and ids; it is held for map operations only,
// never across I/O or while waiting.
type gateTable struct {
	count    atomic.Int64
	installs atomic.Uint64
	// draining counts the released gates whose waiting reads have not
	// all ended, on any object.
	draining atomic.Int64
	// swept is when sweep last ran (unix nanoseconds).
	swept atomic.Int64

	mu   sync.Mutex
	objs map[object.ID]*objGates
	ids  map[gateKey][]*gate
}

// gateKey names a gate: a gate id is unique per writer of one VDI.
type gateKey struct {
	vdi object.VDI
	id  uint64
}

// objGates is the gates of one object, and the reads that waited for
// one of them and have not ended yet.
type objGates struct {
	last  uint64 // installs after this object's newest installation
	gates []*gate
	// draining is the released gates that reads waited for and that
	// have not all ended: a new gate over their range waits for them
	// (admit), so that a block written back to back is still read.
	draining []*gate
	// asked is when release rule 2 last asked whether the object's
	// copies agree (at most every agreePause: it costs a checksum on every
	// replica).
	asked time.Time
}

// agreePause is how often at most rule 2 asks about one object.
const agreePause = 250 * time.Millisecond

// gate is one gated write on one object: [off, end), the newest epoch
// it was received in, and done, closed when it is released.
type gate struct {
	key gateKey // zero for a hide
	// hide: recovery withholds the whole object (hide), not a writer.
	hide     bool
	obj      object.ID
	off, end int64
	epoch    uint64
	// staleSince is when a release of rule 2 first found the node in
	// an epoch past epoch; zero until then, and again once the write
	// is resent in a newer epoch.
	staleSince time.Time
	// at is when the gate was last installed (rule 3).
	at   time.Time
	done chan struct{}
	// waiters counts the reads waiting for the gate, or woken by its
	// release and not ended yet; drained is closed when that falls to 0
	// after the release (nil until admit needs it).
	waiters int
	drained chan struct{}
}

// install gates [off, end) of obj for gate id of obj's VDI, received in
// epoch at now. The same gate again (a write resent after an epoch
// change) widens the range and moves the epoch and the time forward.
func (t *gateTable) install(obj object.ID, id uint64, off, end int64, epoch uint64, now time.Time) {
	k := gateKey{vdi: obj.VDI(), id: id}
	t.mu.Lock()
	defer t.mu.Unlock()
	o := t.objLocked(obj)
	for _, g := range t.ids[k] {
		if g.obj == obj {
			if epoch > g.epoch {
				g.staleSince = time.Time{}
			}
			g.off, g.end, g.epoch = min(g.off, off), max(g.end, end), max(g.epoch, epoch)
			g.at = now
			o.last = t.installs.Add(1)
			return
		}
	}
	g := &gate{key: k, obj: obj, off: off, end: end, epoch: epoch, at: now, done: make(chan struct{})}
	o.gates = append(o.gates, g)
	t.ids[k] = append(t.ids[k], g)
	// count before installs: a read that saw installs move without a
	// gate counted would skip the table (begin's fast path) and pass
	// valid.
	t.count.Add(1)
	o.last = t.installs.Add(1)
}

// objLocked returns obj's entry, made when it has none; t.mu is held.
func (t *gateTable) objLocked(obj object.ID) *objGates {
	if t.objs == nil {
		t.objs = map[object.ID]*objGates{}
		t.ids = map[gateKey][]*gate{}
	}
	o := t.objs[obj]
	if o == nil {
		o = &objGates{}
		t.objs[obj] = o
	}
	return o
}

// hide withholds all of obj from readers, in epoch at now, until the
// copies agree (release rule 2, without the hold) or the age limit:
// recovery is about to store a copy holding a write that another copy
// served as current lacks (recovery.Step.Hide). A hide already there is
// renewed.
func (t *gateTable) hide(obj object.ID, epoch uint64, now time.Time) {
	t.mu.Lock()
	defer t.mu.Unlock()
	o := t.objLocked(obj)
	for _, g := range o.gates {
		if g.hide {
			g.epoch, g.at = max(g.epoch, epoch), now
			o.last = t.installs.Add(1)
			return
		}
	}
	g := &gate{hide: true, obj: obj, off: 0, end: store.MaxObjectSize, epoch: epoch, at: now, done: make(chan struct{})}
	o.gates = append(o.gates, g)
	t.count.Add(1)
	o.last = t.installs.Add(1)
}

// unhide releases obj's hide, if any: the pull it was for stored
// nothing.
func (t *gateTable) unhide(obj object.ID) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if o := t.objs[obj]; o != nil {
		for _, g := range o.gates {
			if g.hide {
				t.removeLocked(g)
				return
			}
		}
	}
}

// settle releases the gates ids of vdi; unknown ids are ignored (the
// write never reached this node, or an epoch change released it). It
// returns how many it released.
func (t *gateTable) settle(vdi object.VDI, ids []uint64) int {
	t.mu.Lock()
	defer t.mu.Unlock()
	n := 0
	for _, id := range ids {
		k := gateKey{vdi: vdi, id: id}
		for _, g := range t.ids[k] {
			t.removeLocked(g)
			n++
		}
		delete(t.ids, k)
	}
	return n
}

// removeLocked takes g out of its object's list and releases it; the
// caller deletes it from ids.
func (t *gateTable) removeLocked(g *gate) {
	o := t.objs[g.obj]
	for i, x := range o.gates {
		if x == g {
			o.gates = append(o.gates[:i], o.gates[i+1:]...)
			break
		}
	}
	if g.waiters > 0 {
		o.draining = append(o.draining, g)
		t.draining.Add(1)
	}
	if len(o.gates) == 0 && len(o.draining) == 0 {
		delete(t.objs, g.obj)
	}
	t.count.Add(-1)
	close(g.done)
}

// wait records a read waiting for g until unwait: once g is released,
// a gate installed over g's range waits for the read (admit). It
// returns false, recording nothing, when g was released since begin
// returned it: a gate released with no waiter neither drains nor keeps
// its object's entry, so a wait on it could not be ended (invariant 3).
func (t *gateTable) wait(g *gate) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	select {
	case <-g.done:
		return false
	default:
	}
	g.waiters++
	return true
}

// unwait ends a wait for g: the read was served or gave up, or waits
// for another gate now.
func (t *gateTable) unwait(g *gate) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if g.waiters--; g.waiters > 0 {
		return
	}
	select {
	case <-g.done:
	default:
		return // still installed: not draining
	}
	o := t.objs[g.obj]
	if i := slices.Index(o.draining, g); i >= 0 {
		o.draining = slices.Delete(o.draining, i, i+1)
		t.draining.Add(-1)
	}
	if g.drained != nil {
		close(g.drained)
	}
	if len(o.gates) == 0 && len(o.draining) == 0 {
		delete(t.objs, g.obj)
	}
}

// admit waits, until ctx ends, while reads woken by the release of a
// gate over [off, end) of obj are still under way: a gated write about
// to be installed lets the reads that waited for the one before it go
// first, else a block written back to back would keep its readers
// waiting for ever (each release finding the next gate installed).
// Reads that came after the release do not hold it up. It returns at
// once, without a lock, when no released gate is draining.
func (t *gateTable) admit(ctx context.Context, obj object.ID, off, end int64) {
	if t.draining.Load() == 0 {
		return
	}
	for {
		t.mu.Lock()
		var ch chan struct{}
		if o := t.objs[obj]; o != nil {
			for _, g := range o.draining {
				if g.off < end && off < g.end {
					if g.drained == nil {
						g.drained = make(chan struct{})
					}
					ch = g.drained
					break
				}
			}
		}
		t.mu.Unlock()
		if ch == nil {
			return
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return
		}
	}
}

// epochRule is what release rules 2 and 3 need: the node's epoch, the
// time, the hold, the age limit (0: none), and whether an object is
// current here in an epoch (nil: it always is).
type epochRule struct {
	cur     uint64
	now     time.Time
	hold    time.Duration
	maxAge  time.Duration
	current func(object.ID, uint64) bool
}

// ripeLocked says whether rule 2 (byEpoch, when the object is current)
// or rule 3 (byAge) releases g, and notes when g was first seen stale.
func (r epochRule) ripeLocked(g *gate) (byEpoch, byAge bool) {
	byAge = r.maxAge > 0 && r.now.Sub(g.at) >= r.maxAge
	if g.hide {
		return true, byAge
	}
	if g.epoch >= r.cur {
		return false, byAge
	}
	if g.staleSince.IsZero() {
		g.staleSince = r.now
	}
	return r.now.Sub(g.staleSince) >= r.hold, byAge
}

// releaseOld releases obj's gates that rules 2 and 3 release (r). It
// returns how many it released.
func (t *gateTable) releaseOld(obj object.ID, r epochRule) int {
	if t.count.Load() == 0 {
		return 0
	}
	t.mu.Lock()
	anyEpoch, anyAge := false, false
	if o := t.objs[obj]; o != nil {
		for _, g := range o.gates {
			e, a := r.ripeLocked(g)
			anyEpoch, anyAge = anyEpoch || e, anyAge || a
		}
		if anyEpoch && r.current != nil {
			if r.now.Sub(o.asked) < agreePause {
				anyEpoch = false // asked a moment ago
			} else {
				o.asked = r.now
			}
		}
	}
	t.mu.Unlock()
	agreed := anyEpoch && (r.current == nil || r.current(obj, r.cur))
	if !agreed && !anyAge {
		return 0
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	o := t.objs[obj]
	if o == nil {
		return 0
	}
	n := 0
	for _, g := range append([]*gate(nil), o.gates...) {
		if e, a := r.ripeLocked(g); !a && !(e && agreed) {
			continue
		}
		t.removeLocked(g)
		n++
		if g.hide {
			continue
		}
		l := t.ids[g.key]
		for i, x := range l {
			if x == g {
				l = append(l[:i], l[i+1:]...)
				break
			}
		}
		if len(l) == 0 {
			delete(t.ids, g.key)
		} else {
			t.ids[g.key] = l
		}
	}
	return n
}

// sweepEvery is how often at most sweep looks at every gated object.
const sweepEvery = time.Second

// sweep releases, on every object, the gates that releaseOld would,
// at most once per sweepEvery (now): gates of writers that died are
// otherwise released only when their object is read, and until then
// every read of the node takes begin's slow path.
func (t *gateTable) sweep(r epochRule) {
	last := t.swept.Load()
	if t.count.Load() == 0 || r.now.UnixNano()-last < int64(sweepEvery) || !t.swept.CompareAndSwap(last, r.now.UnixNano()) {
		return
	}
	var old []object.ID
	t.mu.Lock()
	for obj, o := range t.objs {
		for _, g := range o.gates {
			if g.hide || g.epoch < r.cur || r.maxAge > 0 && r.now.Sub(g.at) >= r.maxAge {
				old = append(old, obj)
				break
			}
		}
	}
	t.mu.Unlock()
	for _, obj := range old {
		t.releaseOld(obj, r)
	}
}

// begin starts a read of [off, end) of obj. It returns the gate the read
// must wait for, when one overlaps the range; else a ticket for valid.
// Without any gate on the node it takes no lock.
func (t *gateTable) begin(obj object.ID, off, end int64) (ticket uint64, busy *gate) {
	ticket = t.installs.Load()
	if t.count.Load() == 0 {
		return ticket, nil
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if o := t.objs[obj]; o != nil {
		for _, g := range o.gates {
			if g.off < end && off < g.end {
				return 0, g
			}
		}
	}
	return t.installs.Load(), nil
}

// valid reports whether a read of obj that began with ticket may be
// served: no gate was installed on obj since. A gate installed and
// released meanwhile does not matter: its write may be seen.
func (t *gateTable) valid(obj object.ID, ticket uint64) bool {
	if t.installs.Load() == ticket {
		return true
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	o := t.objs[obj]
	return o == nil || o.last <= ticket
}

// len is the number of gates installed.
func (t *gateTable) len() int { return int(t.count.Load()) }

// gatedRange is the range of the object a gated write covers: the whole
// object for OpRemove.
func gatedRange(req *protocol.Request) (off, end int64) {
	if req.Op == protocol.OpRemove {
		return 0, store.MaxObjectSize
	}
	return int64(req.Offset), int64(req.Offset) + int64(req.Length)
}

// gatedRead says whether req answers a gateway with what the object's
// bytes hold, and so waits for the gates over them: reads, extents and
// checksums, but not recovery's own requests, which copy the copy as it
// is (gated writes included) to make replicas agree.
func gatedRead(req *protocol.Request) bool {
	switch req.Op {
	case protocol.OpRead, protocol.OpExtents, protocol.OpChecksum:
		return req.Flags&protocol.FlagRecovery == 0
	}
	return false
}

// readRange is the range of the object a gated read looks at: the whole
// object for OpChecksum.
func readRange(req *protocol.Request) (off, end int64) {
	if req.Op == protocol.OpChecksum {
		return 0, store.MaxObjectSize
	}
	return int64(req.Offset), int64(req.Offset) + int64(req.Length)
}

// gatePoll is how often a read waiting for a gate looks whether an epoch
// change released it (release rule 2).
const gatePoll = 50 * time.Millisecond

// readGated serves a read through the gates: it waits, at most
// GateWait, while a gated write overlaps its range, and serves it again
// when a gate was installed on the object while it read. It returns
// false when it refused the read without serving it (a gate outlived
// GateWait, or ctx ended).
func (h *Handler) readGated(ctx context.Context, req *protocol.Request, resp *protocol.Response) bool {
	off, end := readRange(req)
	var deadline time.Time
	buf := resp.Payload[:0]
	var waitingFor *gate
	defer func() {
		if waitingFor != nil {
			h.gates.unwait(waitingFor)
		}
	}()
	for {
		if h.gates.len() > 0 {
			agreed := h.Agreed
			if agreed == nil {
				agreed = h.Current
			}
			r := epochRule{cur: h.Epochs.Epoch(), now: time.Now(), hold: h.gateHold(), maxAge: h.gateMaxAge(), current: agreed}
			h.gates.sweep(r)
			h.gates.releaseOld(req.Object, r)
		}
		ticket, busy := h.gates.begin(req.Object, off, end)
		if busy == nil {
			resp.Payload = buf
			h.apply(ctx, req, resp)
			if h.gates.valid(req.Object, ticket) {
				return true
			}
			continue
		}
		if busy.hide {
			// Nothing to wait for: a hide goes when the copies agree,
			// which the release rule above asked (at most every
			// agreePause); the gateway reads another replica now.
			fail(resp, protocol.StatusSuspect, fmt.Sprintf("object %s: withheld until its copies agree (recovery pulled a write its peers lack)", req.Object))
			return false
		}
		if waitingFor != busy {
			first := waitingFor == nil
			if waitingFor != nil {
				h.gates.unwait(waitingFor)
				waitingFor = nil
			}
			if !h.gates.wait(busy) {
				continue // released since begin: look again
			}
			if first && h.Metrics != nil {
				h.Metrics.gateWaits.Inc()
			}
			waitingFor = busy
		}
		if deadline.IsZero() {
			deadline = time.Now().Add(h.gateWait())
		}
		left := time.Until(deadline)
		if left <= 0 {
			fail(resp, protocol.StatusSuspect, fmt.Sprintf("object %s: a write over %d+%d is not settled on every replica yet", req.Object, off, end-off))
			return false
		}
		timer := time.NewTimer(min(left, gatePoll))
		select {
		case <-busy.done:
		case <-timer.C:
		case <-ctx.Done():
			timer.Stop()
			fail(resp, protocol.StatusShutdown, fmt.Sprintf("object %s: waiting for a gated write: %v", req.Object, ctx.Err()))
			return false
		}
		timer.Stop()
	}
}

// settle serves OpSettle: it releases the gates its payload names.
func (h *Handler) settle(req *protocol.Request, resp *protocol.Response) {
	ids, err := protocol.ParseSettleIDs(nil, req.Payload)
	if err != nil {
		fail(resp, protocol.StatusEINVAL, err.Error())
		return
	}
	if req.Object.VDI() == 0 {
		fail(resp, protocol.StatusEINVAL, "settle: VDI id 0")
		return
	}
	h.gates.settle(req.Object.VDI(), ids)
	resp.Status = protocol.StatusOK
	resp.Payload = resp.Payload[:0]
}

// gateHold is GateHold or its default.
func (h *Handler) gateHold() time.Duration {
	if h.GateHold == 0 {
		return 5 * time.Second
	}
	return h.GateHold
}

// gateMaxAge is GateMaxAge or its default.
func (h *Handler) gateMaxAge() time.Duration {
	if h.GateMaxAge == 0 {
		return 2 * time.Minute
	}
	return h.GateMaxAge
}

// gateWait is GateWait or its default.
func (h *Handler) gateWait() time.Duration {
	if h.GateWait == 0 {
		return time.Second
	}
	return h.GateWait
}
