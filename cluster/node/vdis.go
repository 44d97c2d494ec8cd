package node

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/ovis-storage/ovis/block"
	"github.com/ovis-storage/ovis/cluster/gateway"
	"github.com/ovis-storage/ovis/cluster/membership"
	"github.com/ovis-storage/ovis/cluster/object"
	"github.com/ovis-storage/ovis/cluster/owner"
	"github.com/ovis-storage/ovis/cluster/protocol"
	"github.com/ovis-storage/ovis/export"
	"github.com/ovis-storage/ovis/nbd"
)

// vdis is the node's gateway: the VDIs it has open, found by name when a
// client asks. It is the NBD server's Exports, and the admin commands'
// way to a VDI's bytes.
//
// Each VDI open here has an ownership machine (cluster/owner), which
// its device writes under: the node's lease and the lock's fate drive
// it (suspend, relock, drop, abandon, closeAll). A VDI open writable
// here whose lock goes to another owner is dropped (drop): its machine
// goes to Revoked or Lost, so its device refuses writes from then on,
// and it leaves open, so that the next client gets the VDI afresh,
// read-only while another node holds it. The node learns it three
// ways: a storage node refuses the device's token as stale (the
// machine revokes itself; changed), etcd shows the lock broken while
// the lease it was held under lives (watchLock), or a rejoin after a
// lost lease finds it taken (relock). Connections that had the device keep it:
// their reads go on, their writes fail at once with EPERM (never
// acknowledged); NBD cannot tell a client that an export became
// read-only, so a client must reconnect to see the read-only export.
type vdis struct {
	n *Node

	mu     sync.Mutex
	open   map[string]*openVDI // by name; writable ones replace read-only ones
	closed bool                // closeAll ran: nothing opens any more
	// retired are the devices of VDIs dropped while open writable,
	// still used by the connections that had them; closeAll closes them
	// (which ends the fencing Open left running in their background).
	// A read-only device replaced by a writable one has nothing to end.
	retired []*gateway.Device
}

// openVDI is one VDI opened on this node.
type openVDI struct {
	vdi membership.VDI
	dev *gateway.Device
	// own is the VDI's ownership machine here, the device's Owner: the
	// lease and lock events below drive it (owner.Authority.Apply).
	own    *owner.Authority
	lock   *membership.Lock // nil when read-only
	holder string           // who holds the lock when read-only
	exp    nbd.Export
	rev    int64 // etcd revision of the record dev's size comes from; vdis.mu
	// unwatch ends the watch of lock (watchLock); nil when none. vdis.mu.
	unwatch context.CancelFunc
}

func newVDIs(n *Node) *vdis { return &vdis{n: n, open: map[string]*openVDI{}} }

// recordWait bounds the wait for a VDI's record when the VDI is open
// here under its lock and the size known can serve instead (vdis.get).
// Well under nbd.DefaultHandshakeTimeout.
const recordWait = 2 * time.Second

// holder is how this node names itself as a lock holder.
func (r *vdis) holder() string { return fmt.Sprintf("%s (%s)", r.n.id, r.n.Addr()) }

// get returns the VDI called name, opening it on first use: writable when
// its lock is free (this node takes it), read-only when another holds it.
//
// The VDI's record is read from etcd on every call, also for a VDI open
// here, and its size given to the open device: so the connection (or
// admin command) that comes after `ovis vdi resize` returns sees the new
// size, through any node. A connected NBD client keeps the size of its
// handshake (NBD has no way to tell it); it must reconnect, as with
// qemu-nbd.
func (r *vdis) get(ctx context.Context, name string) (*openVDI, error) {
	r.mu.Lock()
	o := r.open[name]
	r.mu.Unlock()
	rctx := ctx
	if o != nil && o.lock != nil {
		// The size known serves when etcd does not answer, so wait for
		// the record only briefly: a handshake that spent its whole
		// timeout here would be cut off after the record was given up
		// (the client sees the server hang up).
		var cancel context.CancelFunc
		rctx, cancel = context.WithTimeout(ctx, recordWait)
		defer cancel()
	}
	v, rev, err := r.n.mc.GetVDIRevision(rctx, name)
	switch {
	case errors.Is(err, membership.ErrNoVDI):
		return nil, fmt.Errorf("%w: %w", nbd.ErrUnknownExport, err)
	case err != nil && o != nil && o.lock != nil:
		// etcd did not answer: this node still holds the lock (its lease
		// fences it otherwise), so it serves the size it knows.
		r.n.log.Warn("vdi record not read; serving the size known", "vdi", name, "size", o.dev.Size(), "err", err)
		return o, nil
	case err != nil:
		return nil, err
	}
	if o != nil && o.vdi.ID == v.ID {
		if err := r.resize(o, v.Size, rev); err != nil {
			return nil, fmt.Errorf("node: vdi %q: %w", name, err)
		}
		if o.lock != nil {
			return o, nil
		}
	}
	// Open read-only before: the lock may have come free meanwhile.
	var lk *membership.Lock
	holder := ""
	l, err := r.n.mc.Lock(ctx, r.n.registration(), name, r.holder())
	var le *membership.LockedError
	switch {
	case err == nil:
		lk = &l
	case errors.As(err, &le):
		if o != nil && o.vdi.ID == v.ID {
			return o, nil
		}
		holder = le.Holder
	default:
		return nil, fmt.Errorf("node: vdi %q: %w", name, err)
	}
	f, err := r.n.mc.GetFormat(ctx)
	if err != nil {
		if lk != nil {
			r.n.mc.Unlock(context.WithoutCancel(ctx), *lk)
		}
		return nil, fmt.Errorf("node: vdi %q: %w", name, err)
	}
	var token uint64
	if lk != nil {
		token = lk.Token
	}
	var own *owner.Authority
	own = owner.New(owner.Config{Token: token, Valid: r.n.live, AwaitValid: r.n.awaitLive,
		Changed: func(_ owner.Machine, e owner.Event, to owner.Machine) { r.changed(own, e, to) }})
	cfg := gateway.Config{VDI: v.ID, Name: v.Name, Size: v.Size, Copies: v.Copies, CopiesAt: copiesAt(v), ObjectShift: v.ObjectShift,
		Views: r.n.views, Net: r.n.net, Local: r.n.id, Dead: r.n.dead.report, Strict: f.Strict,
		Owner: own, RetryTimeout: r.n.cfg.IOTimeout}
	if v.Allocation {
		cfg.Allocation = vdiAllocation{mc: r.n.mc, id: v.ID}
	}
	dev, err := gateway.Open(ctx, cfg)
	if err != nil {
		if lk != nil {
			r.n.mc.Unlock(context.WithoutCancel(ctx), *lk)
		}
		return nil, err
	}
	o = &openVDI{vdi: v, dev: dev, own: own, lock: lk, holder: holder, rev: rev}
	o.exp = nbd.Export{Name: v.Name, Device: export.WithCacheMode(dev, r.n.cfg.Cache), ReadOnly: lk == nil, MultiConn: true, NoHoleMap: true, NoFUA: r.n.cfg.NBDNoFUA}
	if lk == nil {
		o.exp.Description = "read-only: locked by " + holder
	}
	r.mu.Lock()
	if cur := r.open[name]; r.closed || cur != nil && cur.lock != nil {
		// Another handshake opened it writable first; keep that one. Or
		// the node is closing: open nothing that closeAll would miss.
		closed := r.closed
		r.mu.Unlock()
		dev.Close()
		if lk != nil {
			r.n.mc.Unlock(context.WithoutCancel(ctx), *lk)
		}
		if closed {
			return nil, fmt.Errorf("node: vdi %q: %w", name, block.ErrClosed)
		}
		return cur, nil
	}
	r.open[name] = o
	if lk != nil {
		r.n.m.Locks.Inc()
	}
	r.mu.Unlock()
	if lk != nil {
		r.watch(o, *lk)
		if own.Lost() != nil {
			// Refused as stale by a node that answered Open late, before
			// o was in open for changed to find.
			r.drop(o, owner.Event{})
		}
	}
	return o, nil
}

// copiesAt gives a gateway the copies of v's record per epoch, for the
// views that do not list v (it was created after their table was read).
func copiesAt(v membership.VDI) func(uint64) int {
	return func(e uint64) int {
		n, _ := v.CopiesAt(e)
		return n
	}
}

// resize gives o's device the size of the record read at rev, unless a
// newer record's size was given already (two opens may read the table
// around a resize and finish in either order).
func (r *vdis) resize(o *openVDI, size, rev int64) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if rev <= o.rev {
		return nil
	}
	if err := o.dev.SetSize(size); err != nil {
		return err
	}
	o.rev = rev
	return nil
}

// Lookup is nbd.Exports': the VDI called name.
func (r *vdis) Lookup(ctx context.Context, name string) (*nbd.Export, error) {
	if name == "" {
		if name = r.n.cfg.DefaultVDI; name == "" {
			return nil, fmt.Errorf("%w: a VDI's name is needed", nbd.ErrUnknownExport)
		}
	}
	o, err := r.get(ctx, name)
	if err != nil {
		return nil, err
	}
	return &o.exp, nil
}

// List is nbd.Exports': every VDI. Listing opens none.
func (r *vdis) List(ctx context.Context) ([]*nbd.Export, error) {
	vs, err := r.n.mc.ListVDIs(ctx)
	if err != nil {
		return nil, err
	}
	out := make([]*nbd.Export, len(vs))
	for i, v := range vs {
		out[i] = &nbd.Export{Name: v.Name, Description: fmt.Sprintf("ovis VDI %d, %d bytes, %d copies", v.ID, v.Size, v.Copies)}
	}
	return out, nil
}

// closeAll flushes and closes every open VDI and releases its lock, and
// closes the devices of VDIs dropped before. With crash (Node.Kill) it
// only closes them: nothing is flushed, and the locks stay until their
// lease runs out.
func (r *vdis) closeAll(ctx context.Context, crash bool) error {
	r.mu.Lock()
	open, retired := r.open, r.retired
	r.open, r.retired, r.closed = map[string]*openVDI{}, nil, true
	for _, o := range open {
		if o.unwatch != nil {
			// Before the Unlock below, which the watch must not take
			// for a broken lock.
			o.unwatch()
			o.unwatch = nil
		}
	}
	r.mu.Unlock()
	for _, d := range retired {
		d.Close()
	}
	var errs []error
	for name, o := range open {
		held := o.lock != nil && !crash // a killed node neither flushes nor unlocks
		if held {
			if err := o.dev.Flush(ctx); err != nil {
				errs = append(errs, fmt.Errorf("node: vdi %q: last flush: %w", name, err))
			}
		}
		o.dev.Close()
		o.own.Apply(owner.Event{Kind: owner.Close})
		if held {
			if err := r.n.mc.Unlock(ctx, *o.lock); err != nil {
				errs = append(errs, fmt.Errorf("node: vdi %q: unlock: %w", name, err))
			}
			r.n.m.Locks.Dec()
		}
	}
	return errors.Join(errs...)
}

// suspend holds the new requests of every VDI open writable here, until
// relock has taken its lock again (or given it up).
func (r *vdis) suspend() {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, o := range r.open {
		o.own.Apply(owner.Event{Kind: owner.LeaseLost})
	}
}

// abandon ends the suspension of every VDI still waiting for relock:
// the node is closing.
func (r *vdis) abandon(why error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, o := range r.open {
		o.own.Apply(owner.Event{Kind: owner.Abandon, Why: why})
	}
}

// relock takes again, under reg, the locks of the VDIs open writable
// here, after the lease they were held under was lost. Each is taken only
// when nobody else took it meanwhile (membership.Relock), the new token
// sent to every node (gateway.Device.Fence), and the machine moved to it
// (owner.Retaken); otherwise it is
// lost for good (its clients' writes fail: they must reconnect, and then
// get the VDI read-only), since its client knows nothing of the other
// owner's writes. An error that may pass (etcd, a node not answering) is
// returned, and the rejoin tried again.
func (r *vdis) relock(ctx context.Context, reg *membership.Registration) error {
	r.mu.Lock()
	var held []*openVDI
	for _, o := range r.open {
		if o.lock != nil {
			held = append(held, o)
		}
	}
	r.mu.Unlock()
	for _, o := range held {
		r.mu.Lock()
		old, still := *o.lock, r.open[o.vdi.Name] == o
		r.mu.Unlock()
		if !still {
			continue // dropped meanwhile (its token was refused as stale)
		}
		o.own.Apply(owner.Event{Kind: owner.Rejoined})
		l, err := r.n.mc.Relock(ctx, reg, o.vdi.Name, old)
		var le *membership.LockedError
		switch {
		case errors.As(err, &le), errors.Is(err, membership.ErrNoVDI), errors.Is(err, membership.ErrTakenOver):
			r.drop(o, owner.Event{Kind: owner.Refused, Why: fmt.Errorf("node: vdi %q: its lock was lost with the lease: %w", o.vdi.Name, err)})
			continue
		case err != nil:
			return fmt.Errorf("node: vdi %q: taking its lock again: %w", o.vdi.Name, err)
		}
		// Ours now, under reg: should the fencing fail, the next try's
		// Relock gives this lock back and fences again.
		r.mu.Lock()
		still = r.open[o.vdi.Name] == o
		if still {
			o.lock = &l
		}
		r.mu.Unlock()
		if !still {
			// Dropped while Relock ran: nothing here writes under l.
			if err := r.n.mc.Unlock(ctx, l); err != nil {
				r.n.log.Warn("vdi dropped while its lock was taken again; releasing the lock failed", "vdi", o.vdi.Name, "err", err)
			}
			continue
		}
		if err := o.dev.Fence(ctx, l.Token); err != nil {
			return err
		}
		if !o.own.Apply(owner.Event{Kind: owner.Retaken, Token: l.Token}) {
			// The lease went again meanwhile: the next rejoin's.
			return nil
		}
		r.watch(o, l)
		r.n.log.Info("vdi lock taken again after the lease was lost", "vdi", o.vdi.Name, "token", l.Token)
	}
	return nil
}

// drop applies e (the lock went to another owner: Refused, Broken, or
// a Stale applied already) to o's machine and takes o out of the VDIs
// open here: its device refuses writes from then on, the watch of its
// lock ends, and the next client opens the VDI afresh (read-only while
// another node holds it). Connections that have the device keep it:
// reads go on, writes fail at once. Dropping a dropped VDI again does
// nothing.
func (r *vdis) drop(o *openVDI, e owner.Event) {
	o.own.Apply(e)
	m := o.own.Machine()
	if m.State != owner.Lost && m.State != owner.Revoked {
		return // e did not apply: o keeps its lock
	}
	r.mu.Lock()
	mine := r.open[o.vdi.Name] == o
	if mine {
		delete(r.open, o.vdi.Name)
		r.retired = append(r.retired, o.dev)
		r.n.m.Locks.Dec()
	}
	if o.unwatch != nil {
		o.unwatch()
		o.unwatch = nil
	}
	r.mu.Unlock()
	if !mine {
		return
	}
	if m.State == owner.Revoked {
		r.n.log.Error("vdi lock taken by another owner: serving it read-only from now on; its clients' writes fail", "vdi", o.vdi.Name, "err", m.Why)
	} else {
		r.n.log.Error("vdi lost while this node was away: its clients' writes fail from now on", "vdi", o.vdi.Name, "err", m.Why)
	}
}

// changed is every open VDI's owner.Config.Changed. A storage node that
// refused own's token as stale (the gateway told own, which revoked
// itself) means another owner has the VDI's lock: the VDI is dropped.
// Called with no lock held; it does not block.
func (r *vdis) changed(own *owner.Authority, e owner.Event, to owner.Machine) {
	r.n.log.Debug("vdi ownership", "event", e.Kind, "state", to.State, "token", to.Token)
	if e.Kind != owner.Stale {
		return
	}
	r.mu.Lock()
	var o *openVDI
	for _, x := range r.open {
		if x.own == own {
			o = x
			break
		}
	}
	r.mu.Unlock()
	if o != nil {
		r.drop(o, e)
	}
}

// watch starts watching l, o's lock, in etcd (watchLock), ending the
// watch of an earlier lock of o. Nothing is started when o was dropped
// or holds another lock meanwhile.
func (r *vdis) watch(o *openVDI, l membership.Lock) {
	ctx, cancel := context.WithCancel(context.Background())
	r.mu.Lock()
	if r.open[o.vdi.Name] != o || o.lock == nil || o.lock.Token != l.Token {
		r.mu.Unlock()
		cancel()
		return
	}
	if o.unwatch != nil {
		o.unwatch()
	}
	o.unwatch = cancel
	r.mu.Unlock()
	r.n.spawn(func() { r.watchLock(ctx, o, l) })
}

// watchLock waits until l is no longer the VDI's lock, or ctx ends.
// A lock broken while the lease it was held under lives (ovis vdi lock
// break; membership.Client.Broken) drops o at once, before any of its
// writes is refused. A lock gone with the lease is left to the rejoin
// (relock), which takes it again when nobody else did.
func (r *vdis) watchLock(ctx context.Context, o *openVDI, l membership.Lock) {
	select {
	case <-r.n.mc.LockLost(ctx, l):
	case <-ctx.Done():
		return
	}
	broken := false
	if !untilDone(ctx, "reading why a vdi's lock went", r.n.log, func(ctx context.Context) error {
		b, err := r.n.mc.Broken(ctx, l)
		broken = b
		return err
	}) || !broken {
		return
	}
	r.drop(o, owner.Event{Kind: owner.Broken, Why: fmt.Errorf("node: vdi %q: its lock (token %d) was broken while this node held it: %w", o.vdi.Name, l.Token, membership.ErrNotLocked)})
}

// vdiAllocation is one VDI's allocation map in etcd, for its gateway.
type vdiAllocation struct {
	mc *membership.Client
	id object.VDI
}

func (a vdiAllocation) Allocated(ctx context.Context) (*object.Set, error) {
	return a.mc.Allocated(ctx, a.id)
}

func (a vdiAllocation) MarkAllocated(ctx context.Context, token uint64, idx []uint32) error {
	return revokedIfUnlocked(a.mc.MarkAllocated(ctx, a.id, token, idx))
}

func (a vdiAllocation) UnmarkAllocated(ctx context.Context, token uint64, idx []uint32) error {
	return revokedIfUnlocked(a.mc.UnmarkAllocated(ctx, a.id, token, idx))
}

func (a vdiAllocation) Unsynced(ctx context.Context) (*object.Set, error) {
	return a.mc.Unsynced(ctx, a.id)
}

func (a vdiAllocation) MarkSynced(ctx context.Context, token uint64, idx []uint32) error {
	return revokedIfUnlocked(a.mc.MarkSynced(ctx, a.id, token, idx))
}

func (a vdiAllocation) GivenUp(ctx context.Context, idx uint32) (bool, error) {
	lost, err := a.mc.Lost(ctx)
	if err != nil {
		return false, err
	}
	_, ok := lost[object.Make(a.id, idx)]
	return ok, nil
}

// revokedIfUnlocked says a refusal for a lock that is no longer the
// token's as the gateway knows a node's: a stale token.
func revokedIfUnlocked(err error) error {
	if errors.Is(err, membership.ErrNotLocked) {
		return fmt.Errorf("%w: %w", &protocol.Error{Status: protocol.StatusStaleToken, Op: protocol.OpWrite, Msg: "the allocation map: the VDI's lock is another's"}, err)
	}
	return err
}
