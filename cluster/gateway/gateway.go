// Package gateway is a VDI as a block.Device: every request is split by
// object and sent to the object's replicas over the node-to-node protocol.
//
// Any node is a gateway; so is a tool that opens a VDI. The gateway holds
// no data and no metadata beyond the VDI's shape, the fencing token its
// owner was given, and the set of nodes written to since the last flush.
//
// Invariants:
//
//  1. A write (data, zeroes, discard) is acknowledged only once every
//     replica of every object it touches has acknowledged it: no write
//     is acknowledged with a copy missing. A replica that cannot be
//     reached makes the request wait for the epoch that drops it, and go
//     again to that epoch's placement (see retry); a refusal no epoch can
//     change (a stale token, a full disk) fails it.
//  2. A write with block.FUA goes to each replica as one request with
//     protocol.FlagSync, and marks nothing dirty: each replica makes just
//     that range durable before it answers. It never becomes a flush.
//  3. A plain write marks each replica that acknowledged it dirty before
//     WriteAt returns, so a Flush called after it returns covers it.
//     Flush sends one flush of the VDI to each dirty node, and only to
//     those.
//  4. Every request carries the epoch of the view it was placed with.
//     A replica of a newer epoch refuses it (StatusOldEpoch); the gateway
//     waits for that epoch's view, places the request again and resends
//     it, so the client never sees the refusal. Writes are idempotent
//     (the same bytes at the same offsets), so resending one that some
//     replicas applied is safe.
//  5. A writable device carries its owner's fencing token on every
//     mutating request, and Open sends it to every node of the epoch
//     first: a node refuses tokens lower than the highest it has seen
//     for the VDI, so an owner that lost its lock cannot change a byte.
//     Open waits for the nodes' answers at most Config.FenceWait: a node
//     that does not answer (stopped, cut off) is sent the token in the
//     background until it answers or leaves the epoch, and the new
//     owner's requests do not wait for it. That is as safe as waiting:
//     a write raises the token on the node it reaches before it changes
//     anything (store invariant 5), so no write of the old owner lands
//     after one of the new owner's on any node; and a node that leaves
//     the epoch raises every token to its lock's before it serves again.
//  6. A read goes to one replica, the local one when there is one, and
//     falls back to the others in placement order on error. An object no
//     replica holds (StatusNoEnt from one, with no data from any) reads
//     as zeros (objects are created on first write, on every replica),
//     unless the VDI's allocation map has it synced (invariant 10): then
//     no copy answering is a loss or holders away, never zeros, and the
//     read is tried again and then fails with ErrUnfound, until an
//     operator gives the object up (mark-lost). A device that keeps the
//     map knows it; any other reads it from etcd after the replicas
//     answered, so every write acknowledged before is in what it reads.
//  7. A request placed by a view of epoch E uses the VDI's copies in E
//     (View.Copies, else the record's for E): a change of copies comes
//     with a new epoch, so a gateway still on the old one is refused
//     and places the request again, and never skips a replica that
//     recovery made for the new copies.
//  8. A writable device refused for a stale token (a higher one exists:
//     its lock was broken and taken by another owner) tells its Owner,
//     which revokes itself unless it moved to a newer token meanwhile
//     (cluster/owner, invariant 3): every later write fails at once with
//     ErrRevoked (EPERM over NBD), never reaching a node, and reads go
//     on. The token never becomes good again, so writes under it can
//     never succeed.
//  9. Every write is gated (protocol.FlagGated) with a gate id unique to
//     the device: a random base drawn at Open plus a counter. Once the
//     write has ended on every replica it was sent to, in any attempt,
//     acknowledged or failed, each of those nodes is sent an OpSettle of
//     the id, from a settler goroutine per node that batches what is
//     owed, off the write's acknowledgement; a replica shows no reader
//     the write's range until then (docs/protocol.md, "The read model").
//  10. With an allocation map (Config.Allocation), a writable device
//     sends no write of data to an object before the object is durably
//     in the map, and takes an object out only once every replica
//     removed it (a discard of the whole object), before any other
//     write of it starts (both under the object's order). So an object
//     outside the map holds no data anywhere, and `cluster check` can
//     tell a lost object from one never written. Writes of zeros mark
//     nothing: such an object reads as zeros whether or not a copy
//     survives. A crash, or etcd away, between a removal and its unmark
//     leaves the object in the map: a false alarm of check, and reads
//     of the object fail (invariant 6) until it is written again or
//     given up, never a loss unseen. A mark or unmark requires the
//     device's lock (its token) in the same etcd transaction: a writer
//     fenced off changes nothing, the map included, and its write fails
//     with ErrRevoked. A mark puts the object in the unsynced set too;
//     the device syncs it (Allocation.MarkSynced) after a FUA write of
//     it, or a flush after a write of it, reached every replica, and
//     before acknowledging either. An unsynced object no replica holds
//     lost only writes never acknowledged durable: it reads as zeros.
//
// Locking: mu guards dirty and closed only; smu guards the
// settle queues only; amu the allocation marks only; none is held with
// another, across a call to a node or to etcd, nor while calling the
// Owner or Config's hooks.
package gateway

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/ovis-storage/ovis/block"
	"github.com/ovis-storage/ovis/cluster/object"
	"github.com/ovis-storage/ovis/cluster/owner"
	"github.com/ovis-storage/ovis/cluster/protocol"
	"github.com/ovis-storage/ovis/cluster/view"
)

// Caller sends one request to the node at addr and waits for its answer
// (protocol.Pool). A refusal comes back as a *protocol.Error.
type Caller interface {
	Call(ctx context.Context, addr string, req *protocol.Request, resp *protocol.Response) error
}

// Config describes the VDI a Device serves and how to reach its objects.
type Config struct {
	VDI  object.VDI
	Name string // for errors and logs
	Size int64
	// Copies of each object, for the views that do not give the VDI's
	// (View.Copies); CopiesAt, when not nil, gives them per epoch
	// instead. A request placed by a view uses that view's epoch's
	// copies.
	Copies      int
	ObjectShift uint8
	// CopiesAt, when not nil, returns the copies the VDI had in an epoch
	// its view does not list it for: those of the record the device was
	// opened with (membership.VDI.CopiesAt). Nil means Copies.
	CopiesAt func(epoch uint64) int

	// Owner is who the device writes for: the token writes carry, and
	// when requests may go (the node's cluster/owner.Authority). Nil:
	// a fixed owner of Token.
	Owner Owner
	// Token is a fixed owner's fencing token (the lock's revision), when
	// Owner is nil; zero opens the device read-only. Must be 0 when Owner
	// is set.
	Token uint64

	Views view.Source
	Net   Caller

	// Local is the ID of the node this gateway runs on, whose copies are
	// read first; empty when there is none.
	Local string

	// Strict refuses writes while the view has fewer failure domains than
	// Copies (they wait, as for any membership change, then fail),
	// instead of writing fewer copies until recovery makes the rest.
	Strict bool

	// Dead, when not nil, is told of a node whose port refused a
	// connection: nothing listens there, so the node died or stopped
	// serving, and the membership may drop it without waiting for its
	// lease to expire. It must not block.
	Dead func(id string)

	// RetryTimeout bounds how long one request waits for the membership
	// to settle (new epochs, nodes catching up) before it fails. Zero
	// means 30 s.
	RetryTimeout time.Duration

	// FenceWait bounds how long Open waits for the nodes of the epoch to
	// take a writable device's token. A node that has not answered by
	// then (suspended, cut off) goes on being sent it in the background
	// until it answers, leaves the epoch or the device closes; requests
	// do not wait for it (invariant 5). Zero means 500 ms.
	FenceWait time.Duration

	// Allocation, when not nil, is the VDI's allocation map, which a
	// writable device keeps (invariant 10). Nil keeps none.
	Allocation Allocation
}

// Owner is the authority a device writes under: cluster/owner.Authority
// is the node's, driven by its lease and its lock.
type Owner interface {
	// Admit waits while new requests are held (the node is taking the
	// lock again), then returns why a write may not start, or nil; a
	// read is refused only once the owner is closed.
	Admit(ctx context.Context, write bool) error
	// Live waits while the node's lease does not hold (an attempt goes
	// only under a live lease), and returns the token to send and how
	// long it waited.
	Live(ctx context.Context) (token uint64, waited time.Duration, err error)
	// Token is the token writes carry now.
	Token() uint64
	// Stale is told that a node refused token as stale. It returns nil
	// when the owner carries a newer token by now (the request goes
	// again with it), else the error writes fail with from then on.
	Stale(ctx context.Context, token uint64, refusal error) error
	// Lost is why writes are refused for good, or nil.
	Lost() error
}

// Device is one VDI. It is safe for concurrent use; several NBD
// connections share one, so that a flush on any of them covers writes
// made on all (CAN_MULTI_CONN).
type Device struct {
	cfg     Config
	objSize int64
	// size is the VDI's size now: it starts at cfg.Size and follows
	// resizes (SetSize) while requests run.
	size atomic.Int64

	// own is the owner: cfg.Owner, or a fixed one of cfg.Token.
	own Owner
	// writable: opened with a token.
	writable bool

	// bg is the background fencing's context (Open's stragglers),
	// ended by Close; fences tracks those goroutines.
	bg     context.Context
	stopBG context.CancelFunc
	fences sync.WaitGroup

	mu     sync.Mutex
	dirty  map[string]struct{} // node IDs with unflushed writes of this VDI
	closed bool
	// writing holds, per object, the ranges of the writes under way, so
	// that overlapping writes go out one after the other (order).
	writing map[object.ID][]*span

	// gateBase and gateSeq make the device's gate ids: gateBase, drawn
	// at random at Open, plus 1, 2, 3, … (invariant 9).
	gateBase uint64
	gateSeq  atomic.Uint64
	// ungated sends writes without FlagGated and settles nothing: the
	// behaviour before gates, for tests that show what gates prevent.
	ungated bool

	// smu guards settles and settleClosed; it is never held across a
	// call.
	smu sync.Mutex
	// settles is, per node ID, the gate ids that node is owed an
	// OpSettle for and whether a settler goroutine drains them.
	settles map[string]*settleQueue
	// settleClosed is set once Close began: no settler starts after it.
	settleClosed bool
	settlers     sync.WaitGroup

	// amu guards marked, marking, gather and markBusy; it is never held
	// across a call. marked is the objects known to be in the allocation
	// map (nil: the device keeps none), marking the batch each object
	// being added is in, gather the batch waiting for the one in flight
	// (markBusy) to end. markers tracks the goroutine sending a batch.
	amu    sync.Mutex
	marked *object.Set
	// unsynced is the objects of marked that no write was made durable
	// to yet (Allocation.Unsynced); toSync those of them written since
	// the last Flush, which that Flush syncs.
	unsynced *object.Set
	toSync   *object.Set
	marking  map[uint32]*markBatch
	gather   *markBatch
	markBusy bool
	markers  sync.WaitGroup
	// mapLoad is the newest read of the allocation map by a device
	// that does not keep it (unwritten); guarded by amu.
	mapLoad *mapLoad
}

// settleQueue is the settles owed to one node.
type settleQueue struct {
	ids     []uint64
	running bool // a settler goroutine drains ids
}

// span is a write under way on one object: [off, end), and done, closed
// when it has ended on every replica (or failed).
type span struct {
	off, end int64
	done     chan struct{}
}

var (
	_ block.Device = (*Device)(nil)

	// ErrNoReplica is returned when no replica of an object could be
	// reached or answered.
	ErrNoReplica = errors.New("gateway: no replica answered")

	// ErrTooFewNodes is returned for writes in strict mode while fewer
	// failure domains are live than the VDI has copies.
	ErrTooFewNodes = errors.New("strict: too few nodes for every copy; not writing")

	// ErrLeaseLost is returned for writes once the lease that the VDI's
	// lock is held under may have expired: another owner may have it.
	ErrLeaseLost = owner.ErrLeaseLost

	// ErrRevoked is returned for writes once the device's lock went to
	// another owner (it was broken, then taken with a higher token): the
	// device is read-only from then on. It wraps block.ErrReadOnly, so
	// that NBD clients get EPERM, as for any read-only export.
	ErrRevoked = owner.ErrRevoked
)

// Open returns the Device of a VDI. A writable one (Token ≠ 0) first
// sends its token to every node of the current epoch, so that the
// VDI's previous owner is fenced before this one writes; it waits at
// most FenceWait for the answers (invariant 5). A refusal it sees in
// that time fails Open: with a stale token, the error wraps ErrRevoked
// and the protocol's refusal. Release with Close.
func Open(ctx context.Context, cfg Config) (*Device, error) {
	switch {
	case cfg.VDI == 0:
		return nil, errors.New("gateway: VDI id 0")
	case cfg.Views == nil || cfg.Net == nil:
		return nil, errors.New("gateway: no views or no network")
	case cfg.Copies < 1:
		return nil, fmt.Errorf("gateway: vdi %s: %d copies", cfg.Name, cfg.Copies)
	case cfg.ObjectShift < object.MinSizeShift || cfg.ObjectShift > object.MaxSizeShift:
		return nil, fmt.Errorf("gateway: vdi %s: object size 2^%d out of range", cfg.Name, cfg.ObjectShift)
	case cfg.Size < 0 || cfg.Size > object.MaxVDISize(1<<cfg.ObjectShift):
		return nil, fmt.Errorf("gateway: vdi %s: size %d out of range", cfg.Name, cfg.Size)
	case cfg.Owner != nil && cfg.Token != 0:
		return nil, fmt.Errorf("gateway: vdi %s: both an owner and a fixed token %d", cfg.Name, cfg.Token)
	}
	if cfg.Owner == nil {
		cfg.Owner = owner.New(owner.Config{Token: cfg.Token})
	}
	if cfg.RetryTimeout == 0 {
		cfg.RetryTimeout = 30 * time.Second
	}
	if cfg.FenceWait == 0 {
		cfg.FenceWait = 500 * time.Millisecond
	}
	token := cfg.Owner.Token()
	d := &Device{cfg: cfg, objSize: 1 << cfg.ObjectShift, dirty: map[string]struct{}{}, own: cfg.Owner, writable: token != 0,
		gateBase: rand.Uint64(), settles: map[string]*settleQueue{}}
	d.bg, d.stopBG = context.WithCancel(context.Background())
	d.size.Store(cfg.Size)
	if token != 0 && cfg.Allocation != nil {
		if err := d.loadMarks(ctx); err != nil {
			d.Close()
			return nil, err
		}
	}
	if token != 0 {
		if err := d.fenceOpen(ctx, token); err != nil {
			d.Close()
			return nil, err
		}
	}
	return d, nil
}

// fenceOpen sends token to every node of the current epoch, each in a
// goroutine of its own that goes on in the background (until the node
// answers, leaves the epoch, or Close), and waits for the answers at
// most FenceWait or until ctx ends. It returns the first final refusal
// seen meanwhile.
func (d *Device) fenceOpen(ctx context.Context, token uint64) error {
	nodes := d.cfg.Views.View().IDs()
	results := make(chan error, len(nodes)) // never blocks a sender
	for _, id := range nodes {
		d.fences.Add(1)
		go func() {
			defer d.fences.Done()
			results <- d.fenceNode(d.bg, id, token, d.staleToken)
		}()
	}
	timer := time.NewTimer(d.cfg.FenceWait)
	defer timer.Stop()
	for range nodes {
		select {
		case err := <-results:
			if err != nil {
				return err
			}
		case <-timer.C:
			return nil // the others go on in the background
		case <-ctx.Done():
			return fmt.Errorf("gateway: vdi %s: fencing token %d: %w", d.cfg.Name, token, ctx.Err())
		}
	}
	return nil
}

// fenceNode sends token to node id until it takes it, or refuses it for
// good, or leaves the epoch (it raises every token to its lock's before
// it serves again), or ctx ends. Each try is abandoned when its view is
// superseded. A stale-token refusal is stale's to judge.
func (d *Device) fenceNode(ctx context.Context, id string, token uint64, stale func(ctx context.Context, token uint64, refusal error) error) error {
	v := d.cfg.Views.View()
	for backoff := time.Millisecond; ; backoff = min(2*backoff, time.Second) {
		addr, ok := v.Addr[id]
		if !ok {
			return nil
		}
		req := protocol.Request{Op: protocol.OpFence, Epoch: v.Epoch, Token: token, Object: object.Make(d.cfg.VDI, 0)}
		var resp protocol.Response
		actx, stop := v.Attempt(ctx)
		err := d.cfg.Net.Call(actx, addr, &req, &resp)
		stop()
		switch {
		case err == nil:
			return nil
		case ctx.Err() != nil:
			return nil // closed: nothing will write with token any more
		case protocol.StatusOf(err) == protocol.StatusStaleToken:
			return stale(ctx, token, fmt.Errorf("gateway: vdi %s: fence of token %d on node %s: %w", d.cfg.Name, token, id, err))
		case !retryable(err):
			return fmt.Errorf("gateway: vdi %s: fence of token %d on node %s: %w", d.cfg.Name, token, id, err)
		}
		d.refused(id, err)
		wctx, cancel := context.WithTimeout(ctx, backoff)
		nv, werr := d.cfg.Views.Await(wctx, v.Epoch)
		cancel()
		if werr == nil {
			v = nv
		}
	}
}

// staleToken hands a refusal (refusal) of token for being stale to the
// owner (invariant 8): errRetry when the owner carries a newer token by
// now, else why writes fail from now on.
func (d *Device) staleToken(ctx context.Context, token uint64, refusal error) error {
	if err := d.own.Stale(ctx, token, refusal); err != nil {
		return fmt.Errorf("gateway: vdi %s: %w", d.cfg.Name, err)
	}
	return errRetry
}

// errRetry says that a request refused for a token the device no longer
// carries may go again, with the new one.
var errRetry = errors.New("gateway: token changed; again")

// Fence sends token to every node of the current epoch and waits until
// each took it, left the epoch, or RetryTimeout passed (an error, as is
// a refusal): the lock taken again after the node rejoined. Every node
// must take it, since a node that missed it would still take the old
// owner's writes; a node that joins meanwhile takes it from etcd before
// it serves. A stale refusal here is the caller's to handle (another
// owner took the lock after it was taken again): the owner is not told.
func (d *Device) Fence(ctx context.Context, token uint64) error {
	ctx, cancel := context.WithTimeout(ctx, d.cfg.RetryTimeout)
	defer cancel()
	nodes := d.cfg.Views.View().IDs()
	errs := make([]error, len(nodes))
	var wg sync.WaitGroup
	for i, id := range nodes {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = d.fenceNode(ctx, id, token, func(_ context.Context, _ uint64, refusal error) error { return refusal })
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return err
	}
	if ctx.Err() != nil {
		return fmt.Errorf("gateway: vdi %s: fencing token %d: %w", d.cfg.Name, token, ctx.Err())
	}
	return nil
}

// Size is the VDI's size.
func (d *Device) Size() int64 { return d.size.Load() }

// SetSize follows a resize of the VDI: requests checked after it returns
// are bounded by size. Requests in flight are not waited for; growing is
// therefore always safe, and a shrink refuses only what is checked after
// it (the data past the new end is forfeit either way). An NBD client
// keeps the size it was given at its handshake: it must reconnect to see
// the new one, as with qemu-nbd. It returns an error, and changes
// nothing, for a size the VDI's object size cannot reach.
func (d *Device) SetSize(size int64) error {
	if size < 0 || size > object.MaxVDISize(d.objSize) {
		return fmt.Errorf("gateway: vdi %s: size %d out of range", d.cfg.Name, size)
	}
	d.size.Store(size)
	return nil
}

// ReadOnly reports whether the device was opened without a token.
func (d *Device) ReadOnly() bool { return !d.writable }

// Close marks the device closed, sends the settles it owes (waiting at
// most 2 s for them), and ends and waits for them and for the
// background fencing of nodes that did not answer Open. It does not
// flush: the NBD server and every other user flush before they close, and a VDI's
// replicas keep what they were sent either way. A second Close returns
// block.ErrClosed.
func (d *Device) Close() error {
	d.mu.Lock()
	if d.closed {
		d.mu.Unlock()
		return block.ErrClosed
	}
	d.closed = true
	d.mu.Unlock()
	// The settles owed go out first, for at most settleTimeout; a node
	// that does not take them by then releases the gates with its next
	// epoch, or after the node's age limit (docs/protocol.md).
	d.smu.Lock()
	d.settleClosed = true
	d.smu.Unlock()
	settled := make(chan struct{})
	go func() { d.settlers.Wait(); close(settled) }()
	select {
	case <-settled:
	case <-time.After(settleTimeout):
	}
	d.stopBG()
	<-settled
	d.fences.Wait()
	d.markers.Wait()
	return nil
}

func (d *Device) check(ctx context.Context, off, n int64, write bool) error {
	err := d.own.Admit(ctx, write)
	d.mu.Lock()
	closed := d.closed
	d.mu.Unlock()
	switch {
	case closed:
		return block.ErrClosed
	case write && !d.writable:
		return block.ErrReadOnly
	case err != nil:
		return fmt.Errorf("gateway: vdi %s: %w", d.cfg.Name, err)
	}
	return block.CheckRange(off, n, d.size.Load())
}

// piece is the part of a request that falls in one object.
type piece struct {
	obj object.ID
	off int64 // within the object
	n   int64
	pos int64 // within the request
}

// hole is the extents of a piece that holds nothing.
func (pc piece) hole() []protocol.Extent {
	return []protocol.Extent{{Offset: uint64(pc.off), Length: uint64(pc.n), Hole: true}}
}

// pieces splits [off, off+n) by object.
func (d *Device) pieces(off, n int64) []piece {
	var ps []piece
	for pos := int64(0); pos < n; {
		at := off + pos
		idx := at >> d.cfg.ObjectShift
		in := at & (d.objSize - 1)
		l := min(n-pos, d.objSize-in)
		ps = append(ps, piece{obj: object.Make(d.cfg.VDI, uint32(idx)), off: in, n: l, pos: pos})
		pos += l
	}
	return ps
}

// each runs fn on every piece, in parallel, and returns the first error.
func (d *Device) each(ps []piece, fn func(i int, pc piece) error) error {
	if len(ps) == 1 {
		return fn(0, ps[0])
	}
	errs := make([]error, len(ps))
	var wg sync.WaitGroup
	for i := range ps {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = fn(i, ps[i])
		}()
	}
	wg.Wait()
	return errors.Join(errs...)
}

// replicas returns the nodes that hold obj in v. With fewer failure
// domains than copies (a cluster that lost nodes) the object is on every
// domain there is.
func (d *Device) replicas(v *view.View, obj object.ID) ([]string, error) {
	copies := min(d.copies(v), v.Map.Zones())
	nodes, err := v.Map.Place(obj, copies, make([]string, 0, copies))
	if err != nil {
		return nil, fmt.Errorf("gateway: vdi %s object %s: %w", d.cfg.Name, obj, err)
	}
	return nodes, nil
}

// copies returns the VDI's copies in v's epoch: the view's, when it
// lists the VDI, else the record's (Config.CopiesAt, Config.Copies). A
// VDI the view lacks was created after the node read the table for it,
// so no change of its copies can have made v's epoch, and the record's
// value for the epoch is right.
func (d *Device) copies(v *view.View) int {
	if n, ok := v.Copies[d.cfg.VDI]; ok {
		return n
	}
	if d.cfg.CopiesAt != nil {
		return d.cfg.CopiesAt(v.Epoch)
	}
	return d.cfg.Copies
}

// retry runs try with the newest view until it succeeds, fails for a
// reason no membership change can end, or RetryTimeout passes.
//
// A node that knows a newer epoch (StatusOldEpoch) makes it wait for
// that epoch's view. A node that could not be reached, is shutting down,
// is behind (StatusNewEpoch) or is still recovering the object
// (StatusSuspect) makes it try again after a short backoff, or as soon as
// a newer epoch comes: a dead node leaves the membership when its lease
// expires (or sooner, see Config.Dead), and the request then goes to the
// new placement. Each attempt is abandoned when its view is superseded,
// so a request stuck on a node cut off by a partition moves on with the
// epoch that drops it. The client sees a stall, not an error.
func (d *Device) retry(ctx context.Context, try func(ctx context.Context, v *view.View) error) error {
	deadline := time.Now().Add(d.cfg.RetryTimeout)
	v := d.cfg.Views.View()
	for backoff := time.Millisecond; ; backoff = min(2*backoff, 100*time.Millisecond) {
		// While the node rejoins the membership, the request waits; the
		// wait does not count against RetryTimeout.
		tok, waited, err := d.own.Live(ctx)
		if err != nil {
			return fmt.Errorf("gateway: vdi %s: waiting for the node to rejoin: %w", d.cfg.Name, err)
		}
		if waited > 0 {
			deadline = deadline.Add(waited)
			v = d.cfg.Views.View()
		}
		actx, stop := v.Attempt(ctx)
		err = try(actx, v)
		stop()
		if err == nil {
			return nil
		}
		if ctx.Err() != nil {
			return fmt.Errorf("%w (while retrying: %v)", ctx.Err(), err)
		}
		if errors.Is(err, &protocol.Error{Status: protocol.StatusStaleToken}) {
			// Refused for the token the lock had before this node lost
			// its lease: once the lock is taken again, the request goes
			// again with the new one. Otherwise the lock went to another
			// owner: the owner is revoked.
			serr := d.staleToken(ctx, tok, err)
			if serr == errRetry {
				continue
			}
			return serr
		}
		if !retryable(err) {
			return err
		}
		wait := backoff
		if errors.Is(err, &protocol.Error{Status: protocol.StatusOldEpoch}) {
			// A node knows a newer epoch: place the request by it.
			wait = time.Until(deadline)
		}
		if left := time.Until(deadline); left <= 0 {
			return fmt.Errorf("gateway: vdi %s: gave up after %v: %w", d.cfg.Name, d.cfg.RetryTimeout, err)
		} else if wait > left {
			wait = left
		}
		wctx, cancel := context.WithTimeout(ctx, wait)
		nv, werr := d.cfg.Views.Await(wctx, v.Epoch)
		cancel()
		switch {
		case werr == nil:
			v = nv
		case ctx.Err() != nil:
			return fmt.Errorf("%w (while retrying: %v)", ctx.Err(), err)
		default:
			v = d.cfg.Views.View()
		}
	}
}

// retryable reports whether every failure in err is one that ends once
// the membership settles: a node that could not be reached or whose call
// was abandoned (its view was superseded), one shutting down, behind or
// ahead of the request's epoch, or recovering the object. A refused
// token, a full disk, a disk error or a malformed request is final.
func retryable(err error) bool {
	switch x := err.(type) {
	case *protocol.Error:
		switch x.Status {
		case protocol.StatusOldEpoch, protocol.StatusNewEpoch, protocol.StatusShutdown, protocol.StatusSuspect:
			return true
		}
		return false
	case interface{ Unwrap() []error }:
		for _, e := range x.Unwrap() {
			if e != nil && !retryable(e) {
				return false
			}
		}
		return true
	case interface{ Unwrap() error }:
		return retryable(x.Unwrap())
	}
	return err != ErrLeaseLost && err != ErrTooFewNodes && err != block.ErrClosed && err != block.ErrReadOnly
}

// fanOut sends one request to each of n nodes in parallel and waits for
// all of them. fill completes the request (the gateway sets the epoch,
// token and handle-free fields); done, when not nil, is called with each
// node that acknowledged. An epoch refusal wins over other errors, so
// that retry sees it.
func (d *Device) fanOut(ctx context.Context, v *view.View, n int, node func(i int) string, fill func(*protocol.Request), done func(id string)) error {
	errs := make([]error, n)
	call := func(i int) {
		id := node(i)
		req := protocol.Request{Epoch: v.Epoch, Token: d.own.Token()}
		fill(&req)
		var resp protocol.Response
		if err := d.cfg.Net.Call(ctx, v.Addr[id], &req, &resp); err != nil {
			d.refused(id, err)
			errs[i] = fmt.Errorf("gateway: vdi %s: %s of object %s on node %s: %w", d.cfg.Name, req.Op, req.Object, id, err)
			return
		}
		if done != nil {
			done(id)
		}
	}
	var wg sync.WaitGroup
	for i := 1; i < n; i++ {
		wg.Add(1)
		go func() { defer wg.Done(); call(i) }()
	}
	if n > 0 {
		call(0)
	}
	wg.Wait()
	for _, err := range errs {
		if s := protocol.StatusOf(err); s == protocol.StatusOldEpoch || s == protocol.StatusNewEpoch {
			return err
		}
	}
	return errors.Join(errs...)
}

// refused tells Config.Dead of a node that refused a connection.
func (d *Device) refused(id string, err error) {
	if d.cfg.Dead != nil && errors.Is(err, syscall.ECONNREFUSED) {
		d.cfg.Dead(id)
	}
}

func (d *Device) markDirty(id string) {
	d.mu.Lock()
	d.dirty[id] = struct{}{}
	d.mu.Unlock()
}

// order waits until no write overlapping [off, off+n) of obj is under
// way, then registers this one; release ends it. Overlapping writes in
// flight at once would otherwise reach the replicas in different orders
// (each replica applies what arrives first) and leave them different,
// though each was acknowledged. Writes that do not overlap never wait
// for each other. Two waiting for the same write may go in either order:
// the client sent them at once, and every replica sees the one order.
func (d *Device) order(ctx context.Context, obj object.ID, off, n int64) (release func(), err error) {
	for {
		d.mu.Lock()
		var busy chan struct{}
		for _, s := range d.writing[obj] {
			if s.off < off+n && off < s.end {
				busy = s.done
				break
			}
		}
		if busy == nil {
			s := &span{off: off, end: off + n, done: make(chan struct{})}
			if d.writing == nil {
				d.writing = map[object.ID][]*span{}
			}
			d.writing[obj] = append(d.writing[obj], s)
			d.mu.Unlock()
			return func() {
				d.mu.Lock()
				l := d.writing[obj]
				if i := slices.Index(l, s); i >= 0 {
					l = slices.Delete(l, i, i+1)
				}
				if len(l) == 0 {
					delete(d.writing, obj)
				} else {
					d.writing[obj] = l
				}
				d.mu.Unlock()
				close(s.done)
			}, nil
		}
		d.mu.Unlock()
		select {
		case <-busy:
		case <-ctx.Done():
			return nil, fmt.Errorf("gateway: vdi %s: waiting for an overlapping write of object %s: %w", d.cfg.Name, obj, ctx.Err())
		}
	}
}

// write sends one mutating request per piece to every replica, after
// the overlapping writes under way (order).
func (d *Device) write(ctx context.Context, off, n int64, f block.Flags, kind writeKind, fill func(req *protocol.Request, pc piece)) error {
	if err := d.check(ctx, off, n, true); err != nil {
		return err
	}
	ps := d.pieces(off, n)
	durable := f.Has(block.FUA)
	var done func(string)
	if !durable {
		done = d.markDirty
	}
	return d.each(ps, func(_ int, pc piece) error {
		release, err := d.order(ctx, pc.obj, pc.off, pc.n)
		if err != nil {
			return err
		}
		defer release()
		// The allocation map changes under the object's order, so that
		// no write of the object runs between a removal and its unmark
		// (invariant 10).
		removes := kind == writeDiscard && pc.off == 0 && pc.n == d.objSize
		if kind == writeData {
			// Before any replica has the data. A refusal for the token
			// is handled as a node's would be: go again after a relock,
			// else the owner is revoked.
			for {
				tok := d.own.Token()
				err := d.ensureMarked(ctx, []piece{pc})
				if err == nil {
					break
				}
				if protocol.StatusOf(err) != protocol.StatusStaleToken {
					return err
				}
				if serr := d.staleToken(ctx, tok, err); serr != errRetry {
					return serr
				}
			}
		}
		// Every node the write was sent to, in any attempt, is sent a
		// settle of its gate once the write ended, acknowledged or not
		// (invariant 9).
		gid := d.gateBase + d.gateSeq.Add(1)
		var (
			smu  sync.Mutex
			sent []string
		)
		defer func() {
			if !d.ungated {
				d.settle(gid, sent)
			}
		}()
		err = d.retry(ctx, func(ctx context.Context, v *view.View) error {
			if z, n := v.Map.Zones(), d.copies(v); d.cfg.Strict && z < n {
				return fmt.Errorf("gateway: vdi %s: %w: %d of %d failure domains live (epoch %d)", d.cfg.Name, ErrTooFewNodes, z, n, v.Epoch)
			}
			nodes, err := d.replicas(v, pc.obj)
			if err != nil {
				return err
			}
			return d.fanOut(ctx, v, len(nodes), func(i int) string {
				smu.Lock()
				if !slices.Contains(sent, nodes[i]) {
					sent = append(sent, nodes[i])
				}
				smu.Unlock()
				return nodes[i]
			}, func(req *protocol.Request) {
				req.Object = pc.obj
				req.Offset = uint64(pc.off)
				req.Length = uint32(pc.n)
				if durable {
					req.Flags |= protocol.FlagSync
				}
				if !d.ungated {
					req.Flags |= protocol.FlagGated
					req.Gate = gid
				}
				fill(req, pc)
			}, done)
		})
		if err == nil && removes {
			d.unmark(ctx, pc.obj.Index())
		}
		if err == nil && kind == writeData {
			err = d.wrote(ctx, pc.obj.Index(), durable)
		}
		return err
	})
}

// writeKind is what a write puts in the objects it reaches, for the
// allocation map: data (marked first), zeros (nothing), or a discard
// (whole objects it removes are unmarked after).
type writeKind int

const (
	writeData writeKind = iota
	writeZeroes
	writeDiscard
)

// settle queues an OpSettle of gate id for each of nodes, and starts a
// settler for a node that has none. It never waits for a node: the
// settles are off the write's acknowledgement. Once Close began, it
// sends them itself, each given at most settleTimeout.
func (d *Device) settle(id uint64, nodes []string) {
	var late []string
	d.smu.Lock()
	for _, n := range nodes {
		if d.settleClosed {
			late = append(late, n)
			continue
		}
		q := d.settles[n]
		if q == nil {
			q = &settleQueue{}
			d.settles[n] = q
		}
		q.ids = append(q.ids, id)
		if !q.running {
			q.running = true
			d.settlers.Add(1)
			go d.settler(n)
		}
	}
	d.smu.Unlock()
	for _, n := range late {
		ctx, cancel := context.WithTimeout(context.Background(), settleTimeout)
		d.sendSettle(ctx, n, []uint64{id})
		cancel()
	}
}

// settleTimeout bounds one try of a settle, and how long Close waits
// for the settles still owed.
const settleTimeout = 2 * time.Second

// settler sends node id the settles it is owed, as many in one request
// as there are (at most protocol.MaxSettleIDs), until none is left.
func (d *Device) settler(id string) {
	defer d.settlers.Done()
	for {
		d.smu.Lock()
		q := d.settles[id]
		if len(q.ids) == 0 {
			delete(d.settles, id)
			d.smu.Unlock()
			return
		}
		k := min(len(q.ids), protocol.MaxSettleIDs)
		batch := slices.Clone(q.ids[:k])
		q.ids = q.ids[k:]
		d.smu.Unlock()
		d.sendSettle(d.bg, id, batch)
	}
}

// sendSettle sends one OpSettle of ids to node id until it is answered,
// the node leaves the view (an epoch change then releases its gates:
// docs/protocol.md, "The read model"), or ctx ends.
func (d *Device) sendSettle(ctx context.Context, id string, ids []uint64) {
	payload := protocol.AppendSettleIDs(nil, ids)
	for backoff := time.Millisecond; ; backoff = min(2*backoff, time.Second) {
		v := d.cfg.Views.View()
		addr, ok := v.Addr[id]
		if !ok {
			return
		}
		req := protocol.Request{Op: protocol.OpSettle, Epoch: v.Epoch, Object: object.Make(d.cfg.VDI, 0), Payload: payload}
		var resp protocol.Response
		actx, cancel := context.WithTimeout(ctx, settleTimeout)
		err := d.cfg.Net.Call(actx, addr, &req, &resp)
		cancel()
		if err == nil || ctx.Err() != nil {
			return
		}
		if s := protocol.StatusOf(err); s == protocol.StatusEINVAL || s == protocol.StatusUnsupported {
			return // a node that knows no gates holds none
		}
		d.refused(id, err)
		select {
		case <-time.After(backoff):
		case <-ctx.Done():
			return
		}
	}
}

// WriteAt writes p at off on every replica; with FUA as one sync request
// each.
func (d *Device) WriteAt(ctx context.Context, p []byte, off int64, f block.Flags) (int, error) {
	err := d.write(ctx, off, int64(len(p)), f, writeData, func(req *protocol.Request, pc piece) {
		req.Op = protocol.OpWrite
		req.Payload = p[pc.pos : pc.pos+pc.n]
	})
	if err != nil {
		return 0, err
	}
	return len(p), nil
}

// WriteZeroes zeroes the range on every replica. The nodes zero without
// writing zeros (a punched or zero-allocated range), so NoFallback is
// always honoured.
func (d *Device) WriteZeroes(ctx context.Context, off, n int64, f block.Flags) error {
	return d.write(ctx, off, n, f, writeZeroes, func(req *protocol.Request, pc piece) {
		req.Op = protocol.OpWriteZeroes
		if f.Has(block.NoUnmap) {
			req.Flags |= protocol.FlagNoUnmap
		}
	})
}

// Discard frees whole objects on every replica and punches partial
// ranges; the range reads as zeros afterwards.
func (d *Device) Discard(ctx context.Context, off, n int64, f block.Flags) error {
	return d.write(ctx, off, n, f, writeDiscard, func(req *protocol.Request, pc piece) {
		req.Op = protocol.OpDiscard
		if pc.off == 0 && pc.n == d.objSize {
			req.Op = protocol.OpRemove
			req.Offset, req.Length = 0, 0
		}
	})
}

// Flush sends a flush of the VDI to every node written to since the last
// flush.
func (d *Device) Flush(ctx context.Context) error {
	if err := d.own.Admit(ctx, false); err != nil {
		return fmt.Errorf("gateway: vdi %s: %w", d.cfg.Name, err)
	}
	d.mu.Lock()
	if d.closed {
		d.mu.Unlock()
		return block.ErrClosed
	}
	set := d.dirty
	d.dirty = map[string]struct{}{}
	d.mu.Unlock()
	// The objects written since the last flush that are still unsynced:
	// synced once every node flushed, before the flush is acknowledged.
	toSync := d.takeToSync()
	if len(set) == 0 {
		if len(toSync) > 0 {
			return d.syncOrPutBack(ctx, toSync)
		}
		return nil
	}
	ids := make([]string, 0, len(set))
	for id := range set {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	flushed := map[string]bool{}
	var fmu sync.Mutex
	err := d.retry(ctx, func(ctx context.Context, v *view.View) error {
		var todo []string
		fmu.Lock()
		for _, id := range ids {
			// A node that left the view cannot be flushed; the copies
			// on the nodes that remain are.
			if !flushed[id] && v.Addr[id] != "" {
				todo = append(todo, id)
			}
		}
		fmu.Unlock()
		return d.fanOut(ctx, v, len(todo), func(i int) string { return todo[i] }, func(req *protocol.Request) {
			req.Op = protocol.OpFlush
			req.Object = object.Make(d.cfg.VDI, 0)
		}, func(id string) {
			fmu.Lock()
			flushed[id] = true
			fmu.Unlock()
		})
	})
	if err != nil {
		// What was not flushed stays dirty for the next Flush.
		d.mu.Lock()
		for _, id := range ids {
			if !flushed[id] {
				d.dirty[id] = struct{}{}
			}
		}
		d.mu.Unlock()
		d.putBack(toSync)
		return err
	}
	return d.syncOrPutBack(ctx, toSync)
}

// syncOrPutBack syncs idx after a flush made their writes durable; on
// failure the next Flush tries again.
func (d *Device) syncOrPutBack(ctx context.Context, idx []uint32) error {
	if len(idx) == 0 {
		return nil
	}
	if err := d.sync(ctx, idx); err != nil {
		d.putBack(idx)
		return err
	}
	return nil
}

// readOrder is the order in which a read asks the replicas: the local
// node first, then placement order.
func (d *Device) readOrder(v *view.View, obj object.ID) ([]string, error) {
	nodes, err := d.replicas(v, obj)
	if err != nil {
		return nil, err
	}
	if i := slices.Index(nodes, d.cfg.Local); i > 0 {
		nodes[0], nodes[i] = nodes[i], nodes[0]
	}
	return nodes, nil
}

// askOne sends req to the replicas of its object in read order until one
// answers. It reports noent when no replica answered with the object but
// at least one said it has none, which means the object was never
// written.
func (d *Device) askOne(ctx context.Context, v *view.View, obj object.ID, fill func(req *protocol.Request), resp *protocol.Response) (noent bool, err error) {
	nodes, err := d.readOrder(v, obj)
	if err != nil {
		return false, err
	}
	// First only replicas whose copy is known current answer (a replica
	// still recovering the object refuses at once, FlagCurrent); when
	// none could, the replicas are asked again to recover it first.
	var errs []error
	for pass := 0; pass < 2; pass++ {
		recovering := false
		for _, id := range nodes {
			req := protocol.Request{Epoch: v.Epoch, Object: obj}
			fill(&req)
			if pass == 0 {
				req.Flags |= protocol.FlagCurrent
			}
			err := d.cfg.Net.Call(ctx, v.Addr[id], &req, resp)
			if err == nil {
				return false, nil
			}
			switch protocol.StatusOf(err) {
			case protocol.StatusNoEnt:
				noent = true
				continue
			case protocol.StatusOldEpoch, protocol.StatusNewEpoch:
				return false, err
			case protocol.StatusSuspect:
				if pass == 0 {
					recovering = true
					continue
				}
			}
			if ctx.Err() != nil {
				return false, fmt.Errorf("gateway: vdi %s: object %s: %w", d.cfg.Name, obj, ctx.Err())
			}
			d.refused(id, err)
			errs = append(errs, fmt.Errorf("node %s: %w", id, err))
		}
		if noent && !recovering {
			// A current replica has no such object: never written.
			return true, nil
		}
		if !recovering {
			break
		}
		noent = false
	}
	if noent {
		return true, nil
	}
	return false, fmt.Errorf("gateway: vdi %s: %s of object %s: %w: %w", d.cfg.Name, "read", obj, ErrNoReplica, errors.Join(errs...))
}

// ReadAt reads from one replica of each object.
func (d *Device) ReadAt(ctx context.Context, p []byte, off int64) (int, error) {
	if err := d.check(ctx, off, int64(len(p)), false); err != nil {
		return 0, err
	}
	err := d.each(d.pieces(off, int64(len(p))), func(_ int, pc piece) error {
		buf := p[pc.pos : pc.pos+pc.n]
		return d.retry(ctx, func(ctx context.Context, v *view.View) error {
			resp := protocol.Response{Payload: buf[:0]}
			since := time.Now()
			noent, err := d.askOne(ctx, v, pc.obj, func(req *protocol.Request) {
				req.Op = protocol.OpRead
				req.Offset = uint64(pc.off)
				req.Length = uint32(pc.n)
			}, &resp)
			switch {
			case err != nil:
				return err
			case noent:
				if err := d.unwritten(ctx, pc.obj.Index(), since); err != nil {
					return err
				}
				clear(buf)
			case len(resp.Payload) != len(buf):
				return fmt.Errorf("gateway: vdi %s: read of object %s returned %d bytes, want %d", d.cfg.Name, pc.obj, len(resp.Payload), len(buf))
			case &resp.Payload[0] != &buf[0]:
				copy(buf, resp.Payload)
			}
			return nil
		})
	})
	if err != nil {
		return 0, err
	}
	return len(p), nil
}

// Extents asks one replica of each object for its allocation. An object
// that was never written is a hole: one outside the allocation map of a
// device that keeps it is not asked about.
func (d *Device) Extents(ctx context.Context, off, n int64, dst []block.Extent) ([]block.Extent, error) {
	if err := d.check(ctx, off, n, false); err != nil {
		return dst, err
	}
	ps := d.pieces(off, n)
	runs := make([][]protocol.Extent, len(ps))
	err := d.each(ps, func(i int, pc piece) error {
		if d.surelyHole(pc.obj.Index()) {
			runs[i] = pc.hole()
			return nil
		}
		return d.retry(ctx, func(ctx context.Context, v *view.View) error {
			var resp protocol.Response
			since := time.Now()
			noent, err := d.askOne(ctx, v, pc.obj, func(req *protocol.Request) {
				req.Op = protocol.OpExtents
				req.Offset = uint64(pc.off)
				req.Length = uint32(pc.n)
			}, &resp)
			if err != nil {
				return err
			}
			if noent {
				if err := d.unwritten(ctx, pc.obj.Index(), since); err != nil {
					return err
				}
				runs[i] = pc.hole()
				return nil
			}
			ext, err := protocol.ParseExtents(nil, resp.Payload)
			if err != nil {
				return fmt.Errorf("gateway: vdi %s: extents of object %s: %w", d.cfg.Name, pc.obj, err)
			}
			runs[i] = ext
			return nil
		})
	})
	if err != nil {
		return dst, err
	}
	for i, pc := range ps {
		at := pc.off
		for _, e := range runs[i] {
			// Trust nothing outside the piece, and fill gaps as data.
			s, end := max(int64(e.Offset), at), min(int64(e.Offset+e.Length), pc.off+pc.n)
			if end <= s {
				continue
			}
			if s > at {
				dst = block.AppendExtent(dst, block.Extent{Length: s - at, Status: block.StatusData, Depth: 1})
			}
			x := block.Extent{Length: end - s, Status: block.StatusData, Depth: 1}
			if e.Hole {
				x = block.Extent{Length: end - s, Status: block.StatusHole | block.StatusZero}
			}
			dst = block.AppendExtent(dst, x)
			at = end
		}
		if at < pc.off+pc.n {
			dst = block.AppendExtent(dst, block.Extent{Length: pc.off + pc.n - at, Status: block.StatusData, Depth: 1})
		}
	}
	return dst, nil
}
