package node

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/ovis-storage/ovis/cluster/object"
	"github.com/ovis-storage/ovis/cluster/protocol"
	"github.com/ovis-storage/ovis/cluster/store"
)

// Epochs is the node's own knowledge of the membership epoch.
type Epochs interface {
	// Epoch is the newest epoch the node knows.
	Epoch() uint64
	// AwaitEpoch returns once the node knows epoch e or a newer one, or
	// with ctx's error.
	AwaitEpoch(ctx context.Context, e uint64) error
}

// Handler serves the node-to-node protocol from a local store. It checks
// every request's epoch against the node's and leaves fencing tokens to
// the store, which keeps the highest one per VDI durably. It withholds
// the ranges of gated writes from readers until they are settled
// (gate.go).
type Handler struct {
	Store  *store.Store
	Epochs Epochs
	// CatchUp bounds how long a request from a newer epoch waits for
	// this node to learn that epoch before it is refused with
	// StatusNewEpoch. Zero means 2 s.
	CatchUp time.Duration
	// Metrics, when not nil, counts requests.
	Metrics *Metrics
	// Admin, when not nil, serves OpAdmin.
	Admin func(ctx context.Context, req *protocol.Request, resp *protocol.Response)
	// Ready, when not nil, is asked before a request on an object is
	// served from the local copy (and is not asked for recovery's own
	// requests, which carry protocol.FlagRecovery): it returns once the
	// copy is current in epoch, recovering it first when it may not be
	// (see recoverer). An error refuses the request with StatusSuspect,
	// which the gateway retries. A write (write set) holds the object
	// against recovery until the handler calls done.
	Ready func(ctx context.Context, obj object.ID, epoch uint64, write bool) (done func(), err error)
	// Current, when not nil, says without waiting whether obj's copy is
	// known current in epoch (FlagCurrent).
	Current func(obj object.ID, epoch uint64) bool
	// Agreed, when not nil, says whether obj's copies agree in epoch:
	// this one is current and every replica's holds the same bytes. Gate
	// release rule 2 asks it (gate.go), at most every agreePause per
	// object; nil means Current.
	Agreed func(obj object.ID, epoch uint64) bool
	// Repair, when not nil, recovers a copy the store found suspect
	// while serving a request; the request is then served again.
	Repair func(ctx context.Context, obj object.ID, epoch uint64) error
	// ListFor serves OpListFor: the objects held here of which node
	// target is a replica in epoch, from ID cursor on.
	ListFor func(ctx context.Context, epoch uint64, target string, cursor uint64) ([]protocol.ObjectInfo, error)
	// Live, when not nil, says whether the node's membership lease still
	// holds by its own clock; a node whose lease may have expired serves
	// nothing but HELLO and admin requests.
	Live func(now time.Time) bool
	// Resync, when not nil, is called right before a mutating request
	// reaches the store. It returns at once unless this process may have
	// been paused since it last knew the VDIs' locks, and then raises
	// the store's tokens to the locks' first (pauseGuard), so that a
	// write of an owner whose lock was taken meanwhile is refused even
	// when the new owner's fence is still waiting in a socket. An error
	// refuses the request with StatusShutdown, which gateways retry.
	Resync func(ctx context.Context) error

	// GateWait bounds how long a read waits here for an overlapping
	// gated write to be settled before it is refused with
	// StatusSuspect, which the gateway retries (on another replica,
	// then again) until its own timeout: the read of an unavailable
	// object. Zero means 1 s.
	GateWait time.Duration
	// GateHold is how long a gate of an older epoch is kept after the
	// node is first found past that epoch (gate release rule 2), so
	// that a live writer resends its write in the new epoch first. Zero
	// means 5 s.
	GateHold time.Duration
	// GateMaxAge is how long after its last installation a gate is
	// released whatever else happened (gate release rule 3): a settle
	// lost while the writer lives on must not withhold a range for
	// ever. Zero means 2 min, four times a gateway's default IO
	// timeout.
	GateMaxAge time.Duration

	// changing counts the mutating requests being served, by epoch, so
	// that recovery of an epoch sees none of an older one land after it
	// looked (drainOlder).
	changing admitted
	// gates holds the ranges of gated writes not settled yet.
	gates gateTable
}

// admitted counts requests in progress by epoch. The zero value is
// ready. Locking: mu guards n and wake only; nothing waits under it.
type admitted struct {
	mu   sync.Mutex
	n    map[uint64]int
	wake chan struct{} // closed and replaced when a count falls to 0
}

func (a *admitted) enter(e uint64) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.n == nil {
		a.n = map[uint64]int{}
	}
	a.n[e]++
}

func (a *admitted) leave(e uint64) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.n[e]--; a.n[e] > 0 {
		return
	}
	delete(a.n, e)
	if a.wake != nil {
		close(a.wake)
		a.wake = nil
	}
}

// drain returns once no request of an epoch below e is in progress, or
// with ctx's error.
func (a *admitted) drain(ctx context.Context, e uint64) error {
	for {
		a.mu.Lock()
		busy := false
		for ep := range a.n {
			busy = busy || ep < e
		}
		if !busy {
			a.mu.Unlock()
			return nil
		}
		if a.wake == nil {
			a.wake = make(chan struct{})
		}
		wake := a.wake
		a.mu.Unlock()
		select {
		case <-wake:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// Serve answers one request.
func (h *Handler) Serve(ctx context.Context, req *protocol.Request, resp *protocol.Response) {
	start := time.Now()
	h.serve(ctx, req, resp)
	if h.Metrics != nil {
		h.Metrics.observe(req, resp, time.Since(start))
	}
}

func (h *Handler) serve(ctx context.Context, req *protocol.Request, resp *protocol.Response) {
	// The op table's rules, as protocol.Server applies them on the wire:
	// a request served in process goes through the same ones.
	if err := protocol.Validate(req); err != nil {
		var pe *protocol.Error
		errors.As(err, &pe)
		fail(resp, pe.Status, pe.Msg)
		return
	}
	if req.Op.NamesVDI() && req.Object.VDI() == 0 {
		fail(resp, protocol.StatusEINVAL, fmt.Sprintf("%s %s: VDI id 0", req.Op, req.Object))
		return
	}
	if req.Op.EpochChecked() && req.Op.Writes() {
		// Counted before the epoch check: a recovery of a newer epoch
		// either waits for this request, or comes before it, and then
		// this node knows the newer epoch and refuses it (drainOlder).
		h.changing.enter(req.Epoch)
		defer h.changing.leave(req.Epoch)
	}
	cur := h.Epochs.Epoch()
	resp.Epoch = cur
	if req.Op.EpochChecked() && h.Live != nil && !h.Live(time.Now()) {
		fail(resp, protocol.StatusShutdown, "this node's membership lease may have expired: it serves no object until it rejoins")
		return
	}
	if req.Op.EpochChecked() {
		if req.Epoch < cur {
			fail(resp, protocol.StatusOldEpoch, fmt.Sprintf("request of epoch %d, node is at %d", req.Epoch, cur))
			return
		}
		if req.Epoch > cur {
			wait := h.CatchUp
			if wait == 0 {
				wait = 2 * time.Second
			}
			wctx, cancel := context.WithTimeout(ctx, wait)
			err := h.Epochs.AwaitEpoch(wctx, req.Epoch)
			cancel()
			if err != nil {
				fail(resp, protocol.StatusNewEpoch, fmt.Sprintf("request of epoch %d, node is still at %d", req.Epoch, h.Epochs.Epoch()))
				return
			}
			resp.Epoch = h.Epochs.Epoch()
		}
	}
	if req.Op.EpochChecked() && req.Recovers() {
		if err := h.drainOlder(ctx, req.Epoch); err != nil {
			fail(resp, protocol.StatusNewEpoch, fmt.Sprintf("request of epoch %d: writes of an older epoch are still being applied here: %v", req.Epoch, err))
			return
		}
	}
	if req.Op == protocol.OpSettle {
		h.settle(req, resp)
		return
	}
	if req.Flags&protocol.FlagCurrent != 0 && h.Current != nil && !h.Current(req.Object, req.Epoch) {
		fail(resp, protocol.StatusSuspect, fmt.Sprintf("object %s is not recovered here yet", req.Object))
		return
	}
	release, ok := h.ready(ctx, req, resp)
	if !ok {
		return
	}
	defer func() { release() }()
	if req.Op.Writes() && h.Resync != nil {
		if err := h.Resync(ctx); err != nil {
			fail(resp, protocol.StatusShutdown, err.Error())
			return
		}
	}
	if req.Flags&protocol.FlagGated != 0 {
		// Reads that waited for an earlier gate go first, at most
		// GateWait; then the gate, before the store sees the write
		// (gate invariant 1).
		off, end := gatedRange(req)
		actx, cancel := context.WithTimeout(ctx, h.gateWait())
		h.gates.admit(actx, req.Object, off, end)
		cancel()
		h.gates.install(req.Object, req.Gate, off, end, req.Epoch, time.Now())
	}
	if gatedRead(req) {
		if !h.readGated(ctx, req, resp) {
			return // refused while gated: no repair, the copy is fine
		}
	} else {
		h.apply(ctx, req, resp)
	}
	if resp.Status == protocol.StatusSuspect && req.Op.OnObject() && req.Flags&protocol.FlagRecovery == 0 && h.Repair != nil {
		// The copy was found torn (a crash left it so): recover it from
		// its peers, then serve the request from the repaired copy. The
		// repair waits for the writes that hold the object: this one
		// lets go first, and takes it again after.
		release()
		release = func() {}
		if err := h.Repair(ctx, req.Object, req.Epoch); err != nil {
			fail(resp, protocol.StatusSuspect, fmt.Sprintf("object %s: the copy here is suspect and its repair failed: %v", req.Object, err))
			return
		}
		if release, ok = h.ready(ctx, req, resp); !ok {
			return
		}
		resp.Payload = resp.Payload[:0]
		if gatedRead(req) {
			h.readGated(ctx, req, resp)
		} else {
			h.apply(ctx, req, resp)
		}
	}
}

// ready asks Ready for a request on an object that is not recovery's
// own, and returns what ends the request's hold on the object; false
// when it refused the request (resp says why).
func (h *Handler) ready(ctx context.Context, req *protocol.Request, resp *protocol.Response) (release func(), ok bool) {
	if !req.Op.OnObject() || req.Flags&protocol.FlagRecovery != 0 || h.Ready == nil {
		return func() {}, true
	}
	done, err := h.Ready(ctx, req.Object, req.Epoch, req.Op.Writes())
	if err != nil {
		fail(resp, protocol.StatusSuspect, fmt.Sprintf("object %s is being recovered here: %v", req.Object, err))
		return nil, false
	}
	return done, true
}

// drainOlder waits, at most CatchUp, until no write admitted in an epoch
// before e is still being applied here. Recovery of epoch e decides from
// what this node's copies hold (listings, stats) and copies them (reads):
// a write of the older epoch admitted before this node learned e, but
// applied after recovery looked, would reach this copy and the older
// epoch's other replicas and never the new replica, which would keep a
// copy without it, of the same version or newer. Writes of e itself
// reach the new replica too, so they need no wait.
func (h *Handler) drainOlder(ctx context.Context, e uint64) error {
	wait := h.CatchUp
	if wait == 0 {
		wait = 2 * time.Second
	}
	wctx, cancel := context.WithTimeout(ctx, wait)
	defer cancel()
	return h.changing.drain(wctx, e)
}

// apply serves a request that passed the epoch and readiness checks.
func (h *Handler) apply(ctx context.Context, req *protocol.Request, resp *protocol.Response) {
	st := h.Store
	sync := req.Flags&protocol.FlagSync != 0
	var (
		ver uint64
		err error
	)
	switch req.Op {
	case protocol.OpHello:
	case protocol.OpAdmin:
		if h.Admin == nil {
			fail(resp, protocol.StatusUnsupported, "this node takes no admin requests")
			return
		}
		h.Admin(ctx, req, resp)
		return
	case protocol.OpRead:
		buf := resp.Payload[:0]
		if cap(buf) < int(req.Length) {
			buf = make([]byte, req.Length)
		}
		buf = buf[:req.Length]
		if req.Flags&protocol.FlagRecovery != 0 {
			// Recovery reads its chosen source as it is, suspect or not.
			ver, err = st.ReadSuspect(req.Object, buf, int64(req.Offset))
		} else {
			ver, err = st.ReadAt(req.Object, buf, int64(req.Offset))
		}
		resp.Payload = buf
	case protocol.OpWrite:
		ver, err = st.WriteAt(req.Object, store.Stamp{Token: req.Token, Epoch: req.Epoch}, req.Payload, int64(req.Offset), sync)
	case protocol.OpWriteZeroes:
		ver, err = st.WriteZeroes(req.Object, store.Stamp{Token: req.Token, Epoch: req.Epoch}, int64(req.Offset), int64(req.Length), req.Flags&protocol.FlagNoUnmap != 0, sync)
	case protocol.OpDiscard:
		ver, err = st.Discard(req.Object, store.Stamp{Token: req.Token, Epoch: req.Epoch}, int64(req.Offset), int64(req.Length), sync)
	case protocol.OpRemove:
		err = st.Remove(req.Object, store.Stamp{Token: req.Token, Epoch: req.Epoch})
	case protocol.OpFlush:
		err = st.Flush(req.Object.VDI())
	case protocol.OpFence:
		err = st.Fence(req.Object.VDI(), req.Token)
	case protocol.OpStat:
		var info store.Info
		info, err = st.Stat(req.Object)
		if err == nil {
			ver = info.Version
			resp.Payload = protocol.AppendObjectInfos(resp.Payload[:0], []protocol.ObjectInfo{infoOf(info)})
		}
	case protocol.OpList:
		var infos []store.Info
		infos, err = st.List(req.Object.VDI())
		if err == nil {
			// Offset is a cursor (the first ID to list), Length the most
			// entries (0: as many as a reply holds); List is sorted.
			limit := int(req.Length)
			if limit == 0 {
				limit = protocol.MaxListEntries
			}
			var out []protocol.ObjectInfo
			for _, in := range infos {
				// Check and a deleted VDI's clean-up take a removed object
				// as missing; recovery lists through OpListFor and OpStat.
				if uint64(in.ID) >= req.Offset && len(out) < limit && !in.Tombstone {
					out = append(out, infoOf(in))
				}
			}
			resp.Payload = protocol.AppendObjectInfos(resp.Payload[:0], out)
		}
	case protocol.OpListFor:
		if h.ListFor == nil {
			fail(resp, protocol.StatusUnsupported, "this node does not serve recovery listings")
			return
		}
		var out []protocol.ObjectInfo
		out, err = h.ListFor(ctx, req.Epoch, string(req.Payload), req.Offset)
		if err == nil {
			resp.Payload = protocol.AppendObjectInfos(resp.Payload[:0], out)
		}
	case protocol.OpChecksum:
		var crc uint32
		crc, ver, err = st.Checksum(req.Object)
		if err == nil {
			resp.Payload = protocol.AppendChecksumReply(resp.Payload[:0], crc, ver)
		}
	case protocol.OpExtents:
		var ext []store.Extent
		ext, err = st.Extents(req.Object, int64(req.Offset), int64(req.Length), nil)
		if err == nil {
			out := make([]protocol.Extent, len(ext))
			for i, e := range ext {
				out[i] = protocol.Extent{Offset: uint64(e.Offset), Length: uint64(e.Length), Hole: e.Hole}
			}
			resp.Payload = protocol.AppendExtents(resp.Payload[:0], out)
		}
	default:
		fail(resp, protocol.StatusUnsupported, fmt.Sprintf("op %s", req.Op))
		return
	}
	if err != nil {
		fail(resp, statusOf(err), err.Error())
		return
	}
	resp.Status = protocol.StatusOK
	resp.Version = ver
}

func infoOf(in store.Info) protocol.ObjectInfo {
	return protocol.ObjectInfo{ID: in.ID, Version: in.Version, Allocated: in.Allocated, Suspect: in.Suspect, Tombstone: in.Tombstone}
}

// statusOf maps a store error onto the protocol's status.
func statusOf(err error) protocol.Status {
	switch {
	case errors.Is(err, store.ErrNotFound):
		return protocol.StatusNoEnt
	case errors.Is(err, store.ErrSuspect):
		return protocol.StatusSuspect
	case errors.Is(err, store.ErrStaleToken):
		return protocol.StatusStaleToken
	case errors.Is(err, store.ErrNoSpace):
		return protocol.StatusENOSPC
	case errors.Is(err, store.ErrRange):
		return protocol.StatusEINVAL
	case errors.Is(err, store.ErrClosed):
		return protocol.StatusShutdown
	}
	return protocol.StatusEIO
}

func fail(resp *protocol.Response, s protocol.Status, msg string) {
	resp.Status = s
	if len(msg) > 1024 {
		msg = msg[:1024]
	}
	resp.Payload = append(resp.Payload[:0], msg...)
}

// vdiOf is the VDI a request about a whole VDI names.
func vdiOf(req *protocol.Request) object.VDI { return req.Object.VDI() }
