package gateway_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/ovis-storage/ovis/block"
	"github.com/ovis-storage/ovis/cluster/gateway"
	"github.com/ovis-storage/ovis/cluster/object"
	"github.com/ovis-storage/ovis/cluster/protocol"
	"github.com/ovis-storage/ovis/cluster/store"
	"github.com/ovis-storage/ovis/cluster/view"
)

// memAlloc is an allocation map in memory: it counts its calls, takes
// delay for each (so that concurrent first writes gather), and fails
// while fail is set.
type memAlloc struct {
	mu       sync.Mutex
	set      object.Set
	unsynced object.Set
	calls    int
	delay    time.Duration
	fail     error
	// fenceBelow refuses tokens below it, as the lock does a writer
	// fenced off.
	fenceBelow uint64
	// lost is the objects given up (mark-lost).
	lost map[uint32]bool
}

func (a *memAlloc) Allocated(ctx context.Context) (*object.Set, error) { return a.copyOf(&a.set), nil }
func (a *memAlloc) Unsynced(ctx context.Context) (*object.Set, error) {
	return a.copyOf(&a.unsynced), nil
}

func (a *memAlloc) copyOf(set *object.Set) *object.Set {
	a.mu.Lock()
	defer a.mu.Unlock()
	var s object.Set
	set.Each(func(i uint32) { s.Add(i) })
	return &s
}

func (a *memAlloc) MarkAllocated(ctx context.Context, token uint64, idx []uint32) error {
	time.Sleep(a.delay)
	return a.change(token, true, func(i uint32) { a.set.Add(i); a.unsynced.Add(i) }, idx)
}

func (a *memAlloc) MarkSynced(ctx context.Context, token uint64, idx []uint32) error {
	return a.change(token, false, func(i uint32) { a.unsynced.Remove(i) }, idx)
}

func (a *memAlloc) UnmarkAllocated(ctx context.Context, token uint64, idx []uint32) error {
	return a.change(token, true, func(i uint32) { a.set.Remove(i); a.unsynced.Remove(i) }, idx)
}

// change applies f to idx under token, failing while fail is set, and
// counting the call when counted.
func (a *memAlloc) change(token uint64, counted bool, f func(uint32), idx []uint32) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if counted {
		a.calls++
	}
	if a.fail != nil {
		return a.fail
	}
	if token < a.fenceBelow {
		return &protocol.Error{Status: protocol.StatusStaleToken, Op: protocol.OpWrite, Msg: fmt.Sprintf("token %d", token)}
	}
	for _, i := range idx {
		f(i)
	}
	return nil
}

func (a *memAlloc) isUnsynced(i uint32) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.unsynced.Has(i)
}

func (a *memAlloc) GivenUp(ctx context.Context, idx uint32) (bool, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.lost[idx], nil
}

func (a *memAlloc) has(i uint32) bool { a.mu.Lock(); defer a.mu.Unlock(); return a.set.Has(i) }

// markCheck records every write of data a replica is sent for an object
// not in the map yet (invariant 10), and counts the writes.
type markCheck struct {
	next   gateway.Caller
	a      *memAlloc
	mu     sync.Mutex
	bad    []string
	writes int
}

func (m *markCheck) Call(ctx context.Context, addr string, req *protocol.Request, resp *protocol.Response) error {
	if req.Op == protocol.OpWrite {
		m.mu.Lock()
		m.writes++
		if !m.a.has(req.Object.Index()) {
			m.bad = append(m.bad, fmt.Sprintf("%s to %s", req.Object, addr))
		}
		m.mu.Unlock()
	}
	return m.next.Call(ctx, addr, req, resp)
}

func openMapped(t *testing.T, c *cluster, a *memAlloc, net gateway.Caller, token uint64, retry time.Duration) *gateway.Device {
	t.Helper()
	d, err := gateway.Open(ctx, gateway.Config{
		VDI: 7, Name: "test", Size: 16 << 20, Copies: 3, ObjectShift: object.MinSizeShift,
		Token: token, Views: view.Static{V: c.view}, Net: net, Local: c.nodes[0].id, RetryTimeout: retry,
		Allocation: a,
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Close() })
	return d
}

// TestAllocationMarkedFirst: eight writers write data, zeros, partial
// discards and discards of whole objects at random over sixteen objects.
// No replica is sent data for an object before the map has it; at the
// end every object that reads other than zeros is in the map, every
// object in the map is held by its replicas (not removed), and an
// object only ever zeroed is not in it.
func TestAllocationMarkedFirst(t *testing.T) {
	c := newCluster(t, 3, 1)
	a := &memAlloc{delay: 20 * time.Millisecond}
	mc := &markCheck{next: c.net, a: a}
	d := openMapped(t, c, a, mc, 1, 5*time.Second)
	const objs = 16
	var mu sync.Mutex
	data := map[uint32]bool{}
	var wg sync.WaitGroup
	for w := range 8 {
		wg.Go(func() {
			r := rand.New(rand.NewPCG(uint64(w), 7))
			for range 40 {
				obj := uint32(r.IntN(objs))
				off := int64(obj)<<object.MinSizeShift + int64(r.IntN(256))*4096
				var err error
				switch r.IntN(5) {
				case 0:
					err = d.WriteZeroes(ctx, off, 4096, 0)
				case 1:
					err = d.Discard(ctx, off, 4096, 0)
				case 2:
					err = d.Discard(ctx, int64(obj)<<object.MinSizeShift, 1<<object.MinSizeShift, 0)
				default:
					_, err = d.WriteAt(ctx, fill(r.Uint64(), 4096), off, block.FUA)
					mu.Lock()
					data[obj] = true
					mu.Unlock()
				}
				if err != nil {
					t.Error(err)
					return
				}
			}
		})
	}
	wg.Wait()
	if len(mc.bad) > 0 {
		t.Fatalf("%d writes of data reached a replica before the map had their object: %v", len(mc.bad), mc.bad[:min(5, len(mc.bad))])
	}
	p := make([]byte, 1<<object.MinSizeShift)
	for i := range uint32(objs) {
		if _, err := d.ReadAt(ctx, p, int64(i)<<object.MinSizeShift); err != nil {
			t.Fatal(err)
		}
		nonzero := slices.ContainsFunc(p, func(b byte) bool { return b != 0 })
		held := false
		for _, n := range c.nodes {
			if in, err := n.st.Stat(object.Make(7, i)); err == nil && !in.Tombstone {
				held = true
			}
		}
		switch {
		case nonzero && !a.has(i):
			t.Errorf("object %d holds data and is not in the map", i)
		case a.has(i) && !held:
			t.Errorf("object %d is in the map and every replica removed it", i)
		case !data[i] && a.has(i):
			t.Errorf("object %d, never written with data, is in the map", i)
		}
	}
	t.Logf("%d objects marked in %d calls; %d writes checked", len(data), a.calls, mc.writes)

	// A second device (after a handoff) knows what the first marked and
	// marks nothing again.
	calls := a.calls
	d2 := openMapped(t, c, a, mc, 2, 5*time.Second)
	for i := range data {
		if !a.has(i) {
			continue // removed since
		}
		if _, err := d2.WriteAt(ctx, fill(uint64(i), 4096), int64(i)<<object.MinSizeShift, 0); err != nil {
			t.Fatal(err)
		}
	}
	if a.calls != calls {
		t.Fatalf("writes to marked objects made %d more MarkAllocated calls", a.calls-calls)
	}
}

// TestAllocationFailureWritesNothing: while the map cannot be written
// (etcd away), a first write of data to an object fails after the retry
// timeout and reaches no replica; writes to marked objects go on; once
// the map can be written again, so can the object.
func TestAllocationFailureWritesNothing(t *testing.T) {
	c := newCluster(t, 3, 1)
	a := &memAlloc{}
	mc := &markCheck{next: c.net, a: a}
	d := openMapped(t, c, a, mc, 1, 300*time.Millisecond)
	if _, err := d.WriteAt(ctx, fill(1, 4096), 0, 0); err != nil {
		t.Fatal(err)
	}
	down := errors.New("etcd is away")
	a.mu.Lock()
	a.fail = down
	a.mu.Unlock()
	writes := mc.writes
	start := time.Now()
	_, err := d.WriteAt(ctx, fill(2, 4096), 1<<object.MinSizeShift, 0)
	if !errors.Is(err, down) {
		t.Fatalf("first write with the map unwritable: %v, want it to say %q", err, down)
	}
	if el := time.Since(start); el < 300*time.Millisecond || el > 5*time.Second {
		t.Fatalf("failed after %v, want about the retry timeout (300 ms)", el)
	}
	if mc.writes != writes {
		t.Fatalf("%d writes reached replicas for the unmarked object", mc.writes-writes)
	}
	if _, err := d.WriteAt(ctx, fill(3, 4096), 4096, 0); err != nil {
		t.Fatalf("a write to a marked object while the map is unwritable: %v", err)
	}
	a.mu.Lock()
	a.fail = nil
	a.mu.Unlock()
	if _, err := d.WriteAt(ctx, fill(2, 4096), 1<<object.MinSizeShift, 0); err != nil {
		t.Fatal(err)
	}
	if !a.has(1) || len(mc.bad) > 0 {
		t.Fatalf("object 1 in the map %v; writes before their mark: %v", a.has(1), mc.bad)
	}
}

// TestAllocationReadOnly: a read-only device writes nothing to the map.
func TestAllocationReadOnly(t *testing.T) {
	c := newCluster(t, 3, 1)
	a := &memAlloc{fail: errors.New("must not be called")}
	d := openMapped(t, c, a, c.net, 0, time.Second)
	p := make([]byte, 4096)
	if _, err := d.ReadAt(ctx, p, 0); err != nil {
		t.Fatal(err)
	}
	if a.calls != 0 {
		t.Fatalf("%d calls to the map from a read-only device", a.calls)
	}
}

// TestAllocationGathers: sixteen first writes to sixteen objects at once,
// while a MarkAllocated takes 100 ms, share a few calls (group commit),
// not one each.
func TestAllocationGathers(t *testing.T) {
	c := newCluster(t, 3, 1)
	a := &memAlloc{delay: 100 * time.Millisecond}
	d := openMapped(t, c, a, c.net, 1, 5*time.Second)
	start := make(chan struct{})
	var wg sync.WaitGroup
	for i := range 16 {
		wg.Go(func() {
			<-start
			if _, err := d.WriteAt(ctx, fill(uint64(i), 4096), int64(i)<<object.MinSizeShift, 0); err != nil {
				t.Error(err)
			}
		})
	}
	close(start)
	wg.Wait()
	for i := range uint32(16) {
		if !a.has(i) {
			t.Fatalf("object %d written and not in the map", i)
		}
	}
	// The first write's call goes alone; the others gather behind it.
	if a.calls > 4 {
		t.Fatalf("%d MarkAllocated calls for 16 first writes at once; want them gathered (at most 4)", a.calls)
	}
	t.Logf("16 first writes, %d calls", a.calls)
}

// TestAllocationFencedWriter: a writer whose lock went elsewhere marks
// nothing: its first write of a new object fails at once with
// ErrRevoked (EPERM), not after the retry timeout, and no replica gets
// its data.
func TestAllocationFencedWriter(t *testing.T) {
	c := newCluster(t, 3, 1)
	a := &memAlloc{}
	mc := &markCheck{next: c.net, a: a}
	d := openMapped(t, c, a, mc, 1, 5*time.Second)
	a.mu.Lock()
	a.fenceBelow = 2
	a.mu.Unlock()
	start := time.Now()
	_, err := d.WriteAt(ctx, fill(1, 4096), 3<<object.MinSizeShift, 0)
	if !errors.Is(err, gateway.ErrRevoked) {
		t.Fatalf("first write of a fenced writer: %v, want ErrRevoked", err)
	}
	if el := time.Since(start); el > 2*time.Second {
		t.Fatalf("refused after %v: the refusal was retried", el)
	}
	if mc.writes != 0 || a.has(3) {
		t.Fatalf("%d writes reached replicas; object in the map %v", mc.writes, a.has(3))
	}
}

// TestAllocationUnfoundNotZeros: an object the map says was written, of
// which no replica has a copy (lost here: removed behind the gateway's
// back from every node), never reads as zeros, through the writer's
// device or a read-only one, nor shows as a hole: the read waits and
// fails with ErrUnfound. An object never written reads as zeros, and
// once an operator gives the object up (mark-lost) it does too. Without
// a map the loss reads as zeros: the map is what tells.
func TestAllocationUnfoundNotZeros(t *testing.T) {
	c := newCluster(t, 3, 1)
	a := &memAlloc{}
	w := openMapped(t, c, a, c.net, 9, 300*time.Millisecond)
	ro := openMapped(t, c, a, c.net, 0, 300*time.Millisecond)
	bare := c.open(t, nil, 0, 16<<20, 3)
	objSize := int64(1) << object.MinSizeShift
	data := fill(3, 4096)
	if _, err := w.WriteAt(ctx, data, objSize, block.FUA); err != nil {
		t.Fatal(err)
	}
	for _, n := range c.nodes {
		if err := n.st.Remove(object.Make(7, 1), store.Stamp{Token: 9, Epoch: 1}); err != nil {
			t.Fatal(err)
		}
	}
	p := make([]byte, 4096)
	for name, d := range map[string]*gateway.Device{"writer": w, "read-only": ro} {
		start := time.Now()
		if _, err := d.ReadAt(ctx, p, objSize); !errors.Is(err, gateway.ErrUnfound) {
			t.Errorf("%s: read of the lost object: %v, want ErrUnfound", name, err)
		} else if waited := time.Since(start); waited < 250*time.Millisecond {
			t.Errorf("%s: the read failed after %v, before its retry timeout", name, waited)
		}
		if _, err := d.Extents(ctx, objSize, 4096, nil); !errors.Is(err, gateway.ErrUnfound) {
			t.Errorf("%s: extents of the lost object: %v, want ErrUnfound", name, err)
		}
		if _, err := d.ReadAt(ctx, p, 2*objSize); err != nil || !bytes.Equal(p, make([]byte, 4096)) {
			t.Errorf("%s: read of an object never written: %v", name, err)
		}
	}
	if _, err := bare.ReadAt(ctx, p, objSize); err != nil || !bytes.Equal(p, make([]byte, 4096)) {
		t.Errorf("without a map the lost object reads %v (%v); the test relies on zeros", p[:8], err)
	}
	a.mu.Lock()
	a.lost = map[uint32]bool{1: true}
	a.mu.Unlock()
	for name, d := range map[string]*gateway.Device{"writer": w, "read-only": ro} {
		if _, err := d.ReadAt(ctx, p, objSize); err != nil || !bytes.Equal(p, make([]byte, 4096)) {
			t.Errorf("%s: read of the object given up: %v", name, err)
		}
	}
}

// flushProbe records, for each flush a node is sent, whether the
// objects watched were still unsynced then: they must be, since a
// flush is what makes their writes durable.
type flushProbe struct {
	next  gateway.Caller
	a     *memAlloc
	watch []uint32
	mu    sync.Mutex
	early []uint32 // synced before a flush was sent
}

func (f *flushProbe) Call(ctx context.Context, addr string, req *protocol.Request, resp *protocol.Response) error {
	if req.Op == protocol.OpFlush {
		for _, i := range f.watch {
			if !f.a.isUnsynced(i) {
				f.mu.Lock()
				f.early = append(f.early, i)
				f.mu.Unlock()
			}
		}
	}
	return f.next.Call(ctx, addr, req, resp)
}

// TestAllocationUnsyncedLossReadsZeros: an object in the map whose only
// writes were never made durable (plain writes, no flush), gone from
// every replica as after a power loss, reads as zeros through the
// writer and a read-only device, at once: nobody was told those writes
// were safe. A FUA write syncs its object before it returns; a flush
// syncs the objects written since the last one after every node
// flushed, before it returns, and tries again after a failure; a synced
// object gone from every replica is unfound, never zeros.
func TestAllocationUnsyncedLossReadsZeros(t *testing.T) {
	c := newCluster(t, 3, 1)
	a := &memAlloc{}
	probe := &flushProbe{next: c.net, a: a, watch: []uint32{2}}
	w := openMapped(t, c, a, probe, 9, 300*time.Millisecond)
	ro := openMapped(t, c, a, c.net, 0, 300*time.Millisecond)
	objSize := int64(1) << object.MinSizeShift
	for i := int64(1); i <= 2; i++ {
		if _, err := w.WriteAt(ctx, fill(uint64(i), 4096), i*objSize, 0); err != nil {
			t.Fatal(err)
		}
	}
	if !a.isUnsynced(1) || !a.isUnsynced(2) {
		t.Fatal("plain writes synced their objects")
	}
	if _, err := w.WriteAt(ctx, fill(3, 4096), 3*objSize, block.FUA); err != nil {
		t.Fatal(err)
	}
	if a.isUnsynced(3) {
		t.Fatal("a FUA write returned with its object unsynced")
	}
	// A flush that cannot sync fails, and the next one syncs.
	a.mu.Lock()
	a.fail = errors.New("etcd away")
	a.mu.Unlock()
	if err := w.Flush(ctx); err == nil {
		t.Fatal("a flush that could not sync its objects succeeded")
	}
	a.mu.Lock()
	a.fail = nil
	a.mu.Unlock()
	if err := w.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	if a.isUnsynced(1) || a.isUnsynced(2) {
		t.Fatal("a flush returned with objects written before it unsynced")
	}
	if len(probe.early) > 0 {
		t.Fatalf("objects %v synced before a node was sent the flush", probe.early)
	}
	remove := func(i uint32) {
		for _, n := range c.nodes {
			if err := n.st.Remove(object.Make(7, i), store.Stamp{Token: 9, Epoch: 1}); err != nil {
				t.Fatal(err)
			}
		}
	}
	remove(1)
	remove(2)
	// Object 4 is written plain and lost before any flush.
	p := make([]byte, 4096)
	if _, err := w.WriteAt(ctx, fill(4, 4096), 4*objSize, 0); err != nil {
		t.Fatal(err)
	}
	remove(4)
	for name, d := range map[string]*gateway.Device{"writer": w, "read-only": ro} {
		start := time.Now()
		if _, err := d.ReadAt(ctx, p, 4*objSize); err != nil || !bytes.Equal(p, make([]byte, 4096)) {
			t.Errorf("%s: read of an unsynced object no replica has: %v, want zeros", name, err)
		} else if took := time.Since(start); took > 250*time.Millisecond {
			t.Errorf("%s: the read of an unsynced object took %v, as if it waited", name, took)
		}
		for _, i := range []int64{1, 2} {
			if _, err := d.ReadAt(ctx, p, i*objSize); !errors.Is(err, gateway.ErrUnfound) {
				t.Errorf("%s: read of synced object %d that no replica has: %v, want ErrUnfound", name, i, err)
			}
		}
	}
}

// TestAllocationHolesUnasked: a writer's device answers BLOCK_STATUS for
// objects outside the map without asking a replica, and asks for those
// in it.
func TestAllocationHolesUnasked(t *testing.T) {
	c := newCluster(t, 3, 1)
	a := &memAlloc{}
	w := openMapped(t, c, a, c.net, 9, time.Second)
	objSize := int64(1) << object.MinSizeShift
	if _, err := w.WriteAt(ctx, fill(4, 4096), 3*objSize, 0); err != nil {
		t.Fatal(err)
	}
	c.net.reset()
	ext, err := w.Extents(ctx, 0, 4*objSize, nil)
	if err != nil {
		t.Fatal(err)
	}
	if got := c.net.get(protocol.OpExtents.String()); got != 1 {
		t.Errorf("%d extents requests for 4 objects of which 1 is in the map, want 1", got)
	}
	if len(ext) == 0 || ext[0].Status&block.StatusHole == 0 || ext[0].Length != 3*objSize {
		t.Fatalf("extents %+v: want a hole over the first 3 objects", ext)
	}
	var data int64
	for _, e := range ext {
		if e.Status&block.StatusHole == 0 {
			data += e.Length
		}
	}
	if data < 4096 {
		t.Errorf("extents %+v: the write at object 3 is not data", ext)
	}
}
