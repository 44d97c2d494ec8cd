package gateway

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ovis-storage/ovis/cluster/object"
	"github.com/ovis-storage/ovis/cluster/protocol"
)

// Allocation is a VDI's durable allocation map (membership's
// Allocated and MarkAllocated for one VDI): the objects that may hold
// data. A writable device adds an object before the first write of data
// to it goes to any replica, so that an object outside the map was never
// written and its absence from every node is no loss (invariant 10).
type Allocation interface {
	// Allocated returns the objects in the map.
	Allocated(ctx context.Context) (*object.Set, error)
	// MarkAllocated adds the objects idx; it returns once they are
	// durable. It changes nothing unless the VDI's lock is still the one
	// of token, and then fails with a stale-token refusal (an error whose
	// protocol.StatusOf is StatusStaleToken): a writer fenced off marks
	// nothing.
	MarkAllocated(ctx context.Context, token uint64, idx []uint32) error
	// UnmarkAllocated takes the objects idx out, under token as
	// MarkAllocated.
	UnmarkAllocated(ctx context.Context, token uint64, idx []uint32) error
	// Unsynced returns the objects of the map that no write was made
	// durable to yet: MarkAllocated adds each object to them too.
	Unsynced(ctx context.Context) (*object.Set, error)
	// MarkSynced takes the objects idx out of Unsynced, under token as
	// MarkAllocated: a write of each is durable on every replica.
	MarkSynced(ctx context.Context, token uint64, idx []uint32) error
	// GivenUp reports whether an operator gave object idx up (`ovis
	// cluster mark-lost`): it then reads as zeros though in the map. It
	// is asked only for an object in the map that no replica has.
	GivenUp(ctx context.Context, idx uint32) (bool, error)
}

// ErrUnfound is returned for a read of an object that the VDI's
// allocation map says was written while no replica has a copy: its
// holders are away, or it was lost. The read waits for it (it is tried
// again, as for any replica not answering) and then fails; it never
// reads as zeros. `ovis cluster mark-lost` gives the object up, after
// which it reads as zeros.
//
// An object that is also unsynced (no write of it was ever made durable:
// MarkSynced comes after a FUA write or a flush reached every replica,
// before either is acknowledged) lost only writes nobody was told were
// safe, as a power loss may: it reads as zeros. The replicas answered
// for it as current, so every node that may hold it answered.
var ErrUnfound = errors.New("no replica has a copy of an object the allocation map says was written (unfound: its holders are away, or it was lost)")

// markBatch is the objects one MarkAllocated adds for the writes that
// wait on it; done is closed when it ended, with err.
type markBatch struct {
	idx  []uint32
	done chan struct{}
	err  error
}

// loadMarks reads the allocation map at Open: a writable device keeps
// it to know which objects need marking.
func (d *Device) loadMarks(ctx context.Context) error {
	s, err := d.cfg.Allocation.Allocated(ctx)
	if err != nil {
		return fmt.Errorf("gateway: vdi %s: allocation map: %w", d.cfg.Name, err)
	}
	u, err := d.cfg.Allocation.Unsynced(ctx)
	if err != nil {
		return fmt.Errorf("gateway: vdi %s: unsynced objects: %w", d.cfg.Name, err)
	}
	d.marked, d.unsynced, d.toSync = s, u, &object.Set{}
	d.marking = map[uint32]*markBatch{}
	return nil
}

// wrote notes a write of data to object i acknowledged by every
// replica: with durable (FUA), i is synced before it returns; without,
// the next Flush syncs it.
func (d *Device) wrote(ctx context.Context, i uint32, durable bool) error {
	if d.marked == nil {
		return nil
	}
	d.amu.Lock()
	unsynced := d.unsynced.Has(i)
	if unsynced && !durable {
		d.toSync.Add(i)
	}
	d.amu.Unlock()
	if !unsynced || !durable {
		return nil
	}
	return d.sync(ctx, []uint32{i})
}

// sync marks idx synced (Allocation.MarkSynced), trying again as
// sendMarks does, and forgets them as unsynced.
func (d *Device) sync(ctx context.Context, idx []uint32) error {
	if err := d.changeMap(ctx, "marking %d objects synced", idx, d.cfg.Allocation.MarkSynced); err != nil {
		return err
	}
	d.amu.Lock()
	for _, i := range idx {
		d.unsynced.Remove(i)
		d.toSync.Remove(i)
	}
	d.amu.Unlock()
	return nil
}

// changeMap calls change (a change of the map under the device's token)
// with idx, trying again while etcd does not answer, for at most
// RetryTimeout or until ctx ends. A refusal for the token is final unless
// the owner took its lock again meanwhile (a newer token). what names
// the change, with a %d for the count.
func (d *Device) changeMap(ctx context.Context, what string, idx []uint32, change func(ctx context.Context, token uint64, idx []uint32) error) error {
	ctx, cancel := context.WithTimeout(ctx, d.cfg.RetryTimeout)
	defer cancel()
	for backoff := 10 * time.Millisecond; ; backoff = min(2*backoff, time.Second) {
		tok := d.own.Token()
		err := change(ctx, tok, idx)
		if err == nil {
			return nil
		}
		if protocol.StatusOf(err) == protocol.StatusStaleToken && d.own.Token() == tok {
			return fmt.Errorf("gateway: vdi %s: "+what+": %w", d.cfg.Name, len(idx), err)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("gateway: vdi %s: "+what+": %w", d.cfg.Name, len(idx), err)
		case <-time.After(backoff):
		}
	}
}

// takeToSync returns the objects written since the last Flush that are
// still unsynced, and forgets them; putBack gives them back to a Flush
// that failed.
func (d *Device) takeToSync() []uint32 {
	if d.marked == nil {
		return nil
	}
	d.amu.Lock()
	defer d.amu.Unlock()
	var idx []uint32
	d.toSync.Each(func(i uint32) { idx = append(idx, i) })
	d.toSync = &object.Set{}
	return idx
}

func (d *Device) putBack(idx []uint32) {
	d.amu.Lock()
	defer d.amu.Unlock()
	for _, i := range idx {
		if d.unsynced.Has(i) {
			d.toSync.Add(i)
		}
	}
}

// ensureMarked returns once every object of ps is in the allocation map.
// The objects not known marked join the batch being gathered, which
// goes out as one MarkAllocated when the one in flight ends (group
// commit: a burst of first writes costs one etcd transaction, not one
// each); an object already in a batch waits for that batch.
func (d *Device) ensureMarked(ctx context.Context, ps []piece) error {
	if d.marked == nil {
		return nil
	}
	var wait []*markBatch
	d.amu.Lock()
	for _, pc := range ps {
		i := pc.obj.Index()
		if d.marked.Has(i) {
			continue
		}
		b := d.marking[i]
		if b == nil {
			if d.gather == nil {
				d.gather = &markBatch{done: make(chan struct{})}
			}
			b = d.gather
			b.idx = append(b.idx, i)
			d.marking[i] = b
		}
		if len(wait) == 0 || wait[len(wait)-1] != b {
			wait = append(wait, b)
		}
	}
	if d.gather != nil && !d.markBusy {
		d.startMarkLocked()
	}
	d.amu.Unlock()
	for _, b := range wait {
		select {
		case <-b.done:
			if b.err != nil {
				return b.err
			}
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return nil
}

// startMarkLocked sends the gathered batch in a tracked goroutine; when
// it ends, the next gathered batch goes. d.amu is held.
func (d *Device) startMarkLocked() {
	b := d.gather
	d.gather = nil
	d.markBusy = true
	d.markers.Add(1)
	go func() {
		defer d.markers.Done()
		err := d.sendMarks(b.idx)
		d.amu.Lock()
		defer d.amu.Unlock()
		for _, i := range b.idx {
			if err == nil {
				d.marked.Add(i)
				d.unsynced.Add(i)
			}
			delete(d.marking, i)
		}
		b.err = err
		close(b.done)
		d.markBusy = false
		if d.gather != nil {
			d.startMarkLocked()
		}
	}()
}

// unmark takes object i out of the map after every replica removed it,
// while the removal still holds the object's order. A failure leaves it
// in: a false alarm of check, not a loss unseen; the discard itself
// succeeded.
func (d *Device) unmark(ctx context.Context, i uint32) {
	if d.marked == nil {
		return
	}
	d.amu.Lock()
	known := d.marked.Has(i)
	d.amu.Unlock()
	if !known {
		return
	}
	ctx, cancel := context.WithTimeout(ctx, d.cfg.RetryTimeout)
	defer cancel()
	if err := d.cfg.Allocation.UnmarkAllocated(ctx, d.own.Token(), []uint32{i}); err != nil {
		return
	}
	d.amu.Lock()
	d.marked.Remove(i)
	d.unsynced.Remove(i)
	d.toSync.Remove(i)
	d.amu.Unlock()
}

// sendMarks adds idx to the map, trying again while etcd does not answer,
// for at most RetryTimeout or until Close. A refusal for the token is
// final unless the owner took its lock again meanwhile (a newer token).
func (d *Device) sendMarks(idx []uint32) error {
	return d.changeMap(d.bg, "adding %d objects to the allocation map", idx, d.cfg.Allocation.MarkAllocated)
}

// mapLoad is one read of the allocation map by a device that does not
// keep it (read-only, or fenced off): began is when it was sent.
type mapLoad struct {
	began    time.Time
	done     chan struct{}
	set      *object.Set
	unsynced *object.Set
	err      error
}

// unwritten returns nil when object i may read as zeros because no
// replica has it: the VDI keeps no allocation map, or i is not in it.
// Otherwise it returns an error wrapping ErrUnfound. since is when the
// replicas were asked: a device that keeps the map knows it; any other
// reads the map from etcd, once for all the reads that asked before the
// read was sent, so that every write acknowledged before they asked is
// in what it sees.
func (d *Device) unwritten(ctx context.Context, i uint32, since time.Time) error {
	if d.cfg.Allocation == nil {
		return nil
	}
	if marked, synced, _, keeps := d.keptMark(i); keeps {
		return d.unfound(ctx, i, marked && synced)
	}
	d.amu.Lock()
	l := d.mapLoad
	if l == nil || l.began.Before(since) {
		l = &mapLoad{began: time.Now(), done: make(chan struct{})}
		d.mapLoad = l
		d.markers.Add(1)
		go func() {
			defer d.markers.Done()
			ctx, cancel := context.WithTimeout(d.bg, d.cfg.RetryTimeout)
			defer cancel()
			l.set, l.err = d.cfg.Allocation.Allocated(ctx)
			if l.err == nil {
				l.unsynced, l.err = d.cfg.Allocation.Unsynced(ctx)
			}
			close(l.done)
		}()
	}
	d.amu.Unlock()
	select {
	case <-l.done:
	case <-ctx.Done():
		return ctx.Err()
	}
	if l.err != nil {
		return fmt.Errorf("gateway: vdi %s: reading the allocation map for object %d, which no replica has: %w", d.cfg.Name, i, l.err)
	}
	return d.unfound(ctx, i, l.set.Has(i) && !l.unsynced.Has(i))
}

// unfound is unwritten's answer for object i, synced (in the map and not
// unsynced) or not.
func (d *Device) unfound(ctx context.Context, i uint32, synced bool) error {
	if !synced {
		return nil
	}
	obj := object.Make(d.cfg.VDI, i)
	lost, err := d.cfg.Allocation.GivenUp(ctx, i)
	switch {
	case err != nil:
		return fmt.Errorf("gateway: vdi %s: object %s, which no replica has: %w", d.cfg.Name, obj, err)
	case lost:
		return nil
	}
	return fmt.Errorf("gateway: vdi %s: object %s: %w", d.cfg.Name, obj, ErrUnfound)
}

// keptMark says, when the device keeps the allocation map (a writable
// device with a map, not fenced off: its own marks are all there are),
// whether object i is in it, whether it is synced (not unsynced), and
// whether a write of i is being marked.
func (d *Device) keptMark(i uint32) (marked, synced, marking, keeps bool) {
	if d.cfg.Allocation == nil || d.own.Lost() != nil {
		return false, false, false, false
	}
	d.amu.Lock()
	defer d.amu.Unlock()
	if d.marked == nil {
		return false, false, false, false
	}
	return d.marked.Has(i), !d.unsynced.Has(i), d.marking[i] != nil, true
}

// surelyHole reports whether object i is known to hold no data without
// asking a replica: the device keeps the allocation map, which lacks i,
// and no write of i is being marked.
func (d *Device) surelyHole(i uint32) bool {
	marked, _, marking, keeps := d.keptMark(i)
	return keeps && !marked && !marking
}
