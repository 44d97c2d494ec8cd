package gateway

import (
	"context"
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
}

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
	d.marked = s
	d.marking = map[uint32]*markBatch{}
	return nil
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
	if err := d.cfg.Allocation.UnmarkAllocated(ctx, d.token.Load(), []uint32{i}); err != nil {
		return
	}
	d.amu.Lock()
	d.marked.Remove(i)
	d.amu.Unlock()
}

// sendMarks adds idx to the map, trying again while etcd does not answer,
// for at most RetryTimeout or until Close. A refusal for the token is
// final unless the device took its lock again meanwhile (Retoken).
func (d *Device) sendMarks(idx []uint32) error {
	ctx, cancel := context.WithTimeout(d.bg, d.cfg.RetryTimeout)
	defer cancel()
	for backoff := 10 * time.Millisecond; ; backoff = min(2*backoff, time.Second) {
		tok := d.token.Load()
		err := d.cfg.Allocation.MarkAllocated(ctx, tok, idx)
		if err == nil {
			return nil
		}
		if protocol.StatusOf(err) == protocol.StatusStaleToken && d.token.Load() == tok {
			return fmt.Errorf("gateway: vdi %s: adding %d objects to the allocation map: %w", d.cfg.Name, len(idx), err)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("gateway: vdi %s: adding %d objects to the allocation map: %w", d.cfg.Name, len(idx), err)
		case <-time.After(backoff):
		}
	}
}
