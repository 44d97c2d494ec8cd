package gateway_test

import (
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
)

// memAlloc is an allocation map in memory: it counts its calls, takes
// delay for each (so that concurrent first writes gather), and fails
// while fail is set.
type memAlloc struct {
	mu    sync.Mutex
	set   object.Set
	calls int
	delay time.Duration
	fail  error
	// fenceBelow refuses tokens below it, as the lock does a writer
	// fenced off.
	fenceBelow uint64
}

func (a *memAlloc) Allocated(ctx context.Context) (*object.Set, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	var s object.Set
	a.set.Each(func(i uint32) { s.Add(i) })
	return &s, nil
}

func (a *memAlloc) MarkAllocated(ctx context.Context, token uint64, idx []uint32) error {
	time.Sleep(a.delay)
	a.mu.Lock()
	defer a.mu.Unlock()
	a.calls++
	if a.fail != nil {
		return a.fail
	}
	if token < a.fenceBelow {
		return &protocol.Error{Status: protocol.StatusStaleToken, Op: protocol.OpWrite, Msg: fmt.Sprintf("token %d", token)}
	}
	for _, i := range idx {
		a.set.Add(i)
	}
	return nil
}

func (a *memAlloc) UnmarkAllocated(ctx context.Context, token uint64, idx []uint32) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.calls++
	if a.fail != nil {
		return a.fail
	}
	for _, i := range idx {
		a.set.Remove(i)
	}
	return nil
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
		Token: token, Views: gateway.StaticViews{V: c.view}, Net: net, Local: c.nodes[0].id, RetryTimeout: retry,
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

// TestAllocationReadOnly: a read-only device neither reads nor writes the
// map.
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
