package membership

import (
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"

	"github.com/ovis-storage/ovis/cluster/object"
)

// TestAllocationMap: concurrent writers mark objects of one VDI, some
// in several chunks at once and some the same ones; the map then holds
// exactly the union, unmarking takes objects out (an emptied chunk's key
// goes), a new VDI starts with an empty map and keeps one (Allocation),
// and deleting the VDI deletes its map.
func TestAllocationMap(t *testing.T) {
	t.Parallel()
	c, _ := formatted(t, 1, 0)
	v, err := c.CreateVDI(ctx, VDI{Name: "mapped", Size: 1 << 40})
	if err != nil {
		t.Fatal(err)
	}
	if !v.Allocation {
		t.Fatal("a new VDI keeps no allocation map")
	}
	if s, err := c.Allocated(ctx, v.ID); err != nil || s.Len() != 0 {
		t.Fatalf("a new VDI's map: %v, %v; want empty", s, err)
	}
	want := map[uint32]bool{}
	var mu sync.Mutex
	var wg sync.WaitGroup
	for w := range 4 {
		cc := newClient(t, shared.Endpoints(), c.k.prefix)
		wg.Go(func() {
			for j := range 10 {
				// Shared indices (j) and each writer's own, across two
				// chunks.
				idx := []uint32{uint32(j), uint32(object.SetChunk + 100*w + j)}
				if err := cc.MarkAllocated(ctx, v.ID, 0, idx); err != nil {
					t.Error(err)
					return
				}
				mu.Lock()
				for _, i := range idx {
					want[i] = true
				}
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	s, err := c.Allocated(ctx, v.ID)
	if err != nil {
		t.Fatal(err)
	}
	var got, exp []uint32
	s.Each(func(i uint32) { got = append(got, i) })
	for i := range want {
		exp = append(exp, i)
	}
	slices.Sort(exp)
	if !slices.Equal(got, exp) {
		t.Fatalf("map holds %v, want %v", got, exp)
	}
	// Marking what is there already writes nothing and fails nothing.
	if err := c.MarkAllocated(ctx, v.ID, 0, exp[:3]); err != nil {
		t.Fatal(err)
	}
	// Unmarking every object of the second chunk deletes its key; the
	// first chunk keeps the rest.
	var second []uint32
	for _, i := range exp {
		if i >= object.SetChunk {
			second = append(second, i)
		}
	}
	if err := c.UnmarkAllocated(ctx, v.ID, 0, append(second, 0)); err != nil {
		t.Fatal(err)
	}
	s, err = c.Allocated(ctx, v.ID)
	if err != nil {
		t.Fatal(err)
	}
	if s.Has(0) || s.Len() != len(exp)-len(second)-1 || len(s.Chunks()) != 1 {
		t.Fatalf("after unmarking: %d objects in chunks %v; want %d in chunk 0, not object 0", s.Len(), s.Chunks(), len(exp)-len(second)-1)
	}
	if resp, err := c.cli.Get(ctx, c.k.alloc(v.ID, 1)); err != nil || len(resp.Kvs) != 0 {
		t.Fatalf("the emptied chunk's key is still there (%v)", err)
	}
	if _, err := c.DeleteVDI(ctx, "mapped"); err != nil {
		t.Fatal(err)
	}
	if s, err := c.Allocated(ctx, v.ID); err != nil || s.Len() != 0 {
		t.Fatalf("after the delete the map holds %d objects (%v)", s.Len(), err)
	}
}

// TestAllocationKeyRefused: a malformed key under a VDI's map is
// refused with its name, not read as some chunk.
func TestAllocationKeyRefused(t *testing.T) {
	t.Parallel()
	c, _ := formatted(t, 1, 0)
	v, err := c.CreateVDI(ctx, VDI{Name: "bad", Size: 1 << 30})
	if err != nil {
		t.Fatal(err)
	}
	for _, suffix := range []string{"xyz", "0000000", fmt.Sprintf("%08x", 1<<32/object.SetChunk)} {
		key := c.k.allocs(v.ID) + suffix
		if _, err := c.cli.Put(ctx, key, "\x01"); err != nil {
			t.Fatal(err)
		}
		if _, err := c.Allocated(ctx, v.ID); err == nil {
			t.Errorf("key %q was read", key)
		}
		if _, err := c.cli.Delete(ctx, key); err != nil {
			t.Fatal(err)
		}
	}
}

// TestAllocationFenced: a mark or unmark under a token is refused with
// ErrNotLocked, changing nothing, once the lock is not that token's (a
// writer fenced off), and taken while it is.
func TestAllocationFenced(t *testing.T) {
	t.Parallel()
	c, regs := formatted(t, 1, 0)
	v, err := c.CreateVDI(ctx, VDI{Name: "fenced", Size: 1 << 30})
	if err != nil {
		t.Fatal(err)
	}
	l, err := c.Lock(ctx, regs[0], "fenced", "gw")
	if err != nil {
		t.Fatal(err)
	}
	if err := c.MarkAllocated(ctx, v.ID, l.Token, []uint32{1}); err != nil {
		t.Fatalf("mark under the lock's token: %v", err)
	}
	if _, err := c.BreakLock(ctx, "fenced"); err != nil {
		t.Fatal(err)
	}
	l2, err := c.Lock(ctx, regs[0], "fenced", "gw2")
	if err != nil {
		t.Fatal(err)
	}
	if err := c.MarkAllocated(ctx, v.ID, l.Token, []uint32{2}); !errors.Is(err, ErrNotLocked) {
		t.Fatalf("mark under a broken lock's token: %v, want ErrNotLocked", err)
	}
	if err := c.UnmarkAllocated(ctx, v.ID, l.Token, []uint32{1}); !errors.Is(err, ErrNotLocked) {
		t.Fatalf("unmark under a broken lock's token: %v, want ErrNotLocked", err)
	}
	s, err := c.Allocated(ctx, v.ID)
	if err != nil {
		t.Fatal(err)
	}
	if !s.Has(1) || s.Has(2) {
		t.Fatalf("a fenced writer changed the map: object 1 %v (want in), 2 %v (want out)", s.Has(1), s.Has(2))
	}
	if err := c.MarkAllocated(ctx, v.ID, l2.Token, []uint32{2}); err != nil {
		t.Fatalf("mark under the new token: %v", err)
	}
}

// TestUnsyncedSet: a mark puts objects in the allocation map and the
// unsynced set at once; MarkSynced takes them out of the set alone,
// under the lock's token (a fenced writer's is refused, changing
// nothing); unmarking takes an object out of both; deleting the VDI
// deletes the set.
func TestUnsyncedSet(t *testing.T) {
	t.Parallel()
	c, regs := formatted(t, 1, 0)
	v, err := c.CreateVDI(ctx, VDI{Name: "synced", Size: 1 << 40})
	if err != nil {
		t.Fatal(err)
	}
	l, err := c.Lock(ctx, regs[0], "synced", "gw")
	if err != nil {
		t.Fatal(err)
	}
	both := func(what string, alloc, unsynced []uint32) {
		t.Helper()
		a, err := c.Allocated(ctx, v.ID)
		if err != nil {
			t.Fatal(err)
		}
		u, err := c.Unsynced(ctx, v.ID)
		if err != nil {
			t.Fatal(err)
		}
		var ga, gu []uint32
		a.Each(func(i uint32) { ga = append(ga, i) })
		u.Each(func(i uint32) { gu = append(gu, i) })
		if !slices.Equal(ga, alloc) || !slices.Equal(gu, unsynced) {
			t.Fatalf("%s: map %v and unsynced %v, want %v and %v", what, ga, gu, alloc, unsynced)
		}
	}
	far := uint32(object.SetChunk + 5)
	if err := c.MarkAllocated(ctx, v.ID, l.Token, []uint32{1, 2, far}); err != nil {
		t.Fatal(err)
	}
	both("after the mark", []uint32{1, 2, far}, []uint32{1, 2, far})
	if err := c.MarkSynced(ctx, v.ID, l.Token, []uint32{2, far}); err != nil {
		t.Fatal(err)
	}
	both("after a sync", []uint32{1, 2, far}, []uint32{1})
	if resp, err := c.cli.Get(ctx, c.k.unsynced(v.ID, 1)); err != nil || len(resp.Kvs) != 0 {
		t.Fatalf("the emptied unsynced chunk's key is still there (%v)", err)
	}
	// Unmarking takes an unsynced object (3) and a synced one (2) out of
	// both.
	if err := c.MarkAllocated(ctx, v.ID, l.Token, []uint32{3}); err != nil {
		t.Fatal(err)
	}
	if err := c.UnmarkAllocated(ctx, v.ID, l.Token, []uint32{3, 2}); err != nil {
		t.Fatal(err)
	}
	both("after unmarking a synced and an unsynced object", []uint32{1, far}, []uint32{1})
	if _, err := c.BreakLock(ctx, "synced"); err != nil {
		t.Fatal(err)
	}
	if err := c.MarkSynced(ctx, v.ID, l.Token, []uint32{1}); !errors.Is(err, ErrNotLocked) {
		t.Fatalf("sync under a broken lock's token: %v, want ErrNotLocked", err)
	}
	both("after a fenced sync", []uint32{1, far}, []uint32{1})
	if _, err := c.DeleteVDI(ctx, "synced"); err != nil {
		t.Fatal(err)
	}
	both("after the delete", nil, nil)
}
