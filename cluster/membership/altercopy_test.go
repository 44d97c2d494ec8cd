package membership

import (
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// TestCopiesAt: the copies of an epoch come from the history of
// changes, and a history cut at MaxCopiesHistory says which epochs it no
// longer knows.
func TestCopiesAt(t *testing.T) {
	v := VDI{Copies: 2}
	v = alterCopies(v, 3, 10) // 2 below epoch 10, 3 from it
	v = alterCopies(v, 1, 12) // 3 in 10 and 11, 1 from 12
	for _, tc := range []struct {
		e    uint64
		want int
	}{{1, 2}, {9, 2}, {10, 3}, {11, 3}, {12, 1}, {100, 1}} {
		if got, known := v.CopiesAt(tc.e); got != tc.want || !known {
			t.Errorf("CopiesAt(%d) = %d, %v; want %d, true", tc.e, got, known, tc.want)
		}
	}
	if len(v.CopiesBefore) != 2 || v.CopiesKnownFrom != 0 {
		t.Fatalf("history %+v, known from %d", v.CopiesBefore, v.CopiesKnownFrom)
	}

	// One change per epoch from 1 on, past the bound: copies alternate
	// 1, 2, 1, ... and epoch e has e%2+1 of them (epoch 0: 1).
	h := VDI{Copies: 1}
	const changes = MaxCopiesHistory + 5
	for e := uint64(1); e <= changes; e++ {
		h = alterCopies(h, int(e%2)+1, e)
	}
	if len(h.CopiesBefore) != MaxCopiesHistory {
		t.Fatalf("history of %d changes kept %d, want %d", changes, len(h.CopiesBefore), MaxCopiesHistory)
	}
	from := uint64(changes - MaxCopiesHistory)
	if h.CopiesKnownFrom != from {
		t.Fatalf("known from %d, want %d", h.CopiesKnownFrom, from)
	}
	for e := uint64(0); e <= changes+1; e++ {
		got, known := h.CopiesAt(e)
		if known != (e >= from) {
			t.Fatalf("CopiesAt(%d): known %v with the history from %d", e, known, from)
		}
		if want := int(min(e, changes)%2) + 1; known && got != want {
			t.Fatalf("CopiesAt(%d) = %d, want %d", e, got, want)
		}
	}
}

// TestAlterCopies: the record and a new epoch with the same nodes are
// written in one txn (one revision); every epoch keeps its copies; a
// value the cluster cannot hold is refused and changes nothing; asking
// for the copies a VDI has writes nothing.
func TestAlterCopies(t *testing.T) {
	t.Parallel()
	c, _ := formatted(t, 2, 0, 0, 0)
	settle(t, c, 3, "n0", "n1", "n2")
	v, err := c.CreateVDI(ctx, VDI{Name: "disk", Size: 1 << 30})
	if err != nil {
		t.Fatal(err)
	}
	v0, err := c.View(ctx)
	if err != nil {
		t.Fatal(err)
	}

	nv, err := c.AlterCopies(ctx, "disk", 3)
	if err != nil {
		t.Fatal(err)
	}
	if nv.Copies != 3 || nv.ID != v.ID || nv.Size != v.Size {
		t.Fatalf("altered record %+v", nv)
	}
	// The epoch key, the new epoch's record and the VDI's were written
	// at one revision.
	resp, err := c.cli.Txn(ctx).Then(
		clientv3.OpGet(c.k.epoch()), clientv3.OpGet(c.k.epochAt(v0.Epoch+1)), clientv3.OpGet(c.k.vdiName("disk")),
	).Commit()
	if err != nil {
		t.Fatal(err)
	}
	var revs []int64
	for _, r := range resp.Responses {
		kvs := r.GetResponseRange().Kvs
		if len(kvs) != 1 {
			t.Fatalf("a key of the change is missing: %v", r)
		}
		revs = append(revs, kvs[0].ModRevision)
	}
	if revs[0] != revs[1] || revs[1] != revs[2] {
		t.Fatalf("epoch, epoch record and vdi record written at revisions %v, want one", revs)
	}
	v1, err := c.View(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if v1.Epoch != v0.Epoch+1 || !slices.Equal(v1.Nodes, v0.Nodes) {
		t.Fatalf("epoch after alter-copy: %d %v, want %d with the nodes of %d: %v", v1.Epoch, ids(v1), v0.Epoch+1, v0.Epoch, ids(v0))
	}
	got, err := c.GetVDI(ctx, "disk")
	if err != nil {
		t.Fatal(err)
	}
	for e, want := range map[uint64]int{v.Epoch: 2, v0.Epoch: 2, v1.Epoch: 3, v1.Epoch + 5: 3} {
		if n, _ := got.CopiesAt(e); n != want {
			t.Errorf("copies in epoch %d: %d, want %d", e, n, want)
		}
	}

	// Refusals change nothing.
	for _, tc := range []struct {
		name string
		n    int
		want error
	}{
		{"disk", 4, ErrInvalid}, // 3 zones
		{"disk", 0, ErrInvalid},
		{"disk", MaxCopies + 1, ErrInvalid},
		{"nothere", 2, ErrNoVDI},
		{"bad/name", 2, ErrInvalid},
	} {
		if _, err := c.AlterCopies(ctx, tc.name, tc.n); !errors.Is(err, tc.want) {
			t.Errorf("AlterCopies(%q, %d): %v, want %v", tc.name, tc.n, err, tc.want)
		}
	}
	if same, err := c.AlterCopies(ctx, "disk", 3); err != nil || same.Copies != 3 || len(same.CopiesBefore) != 1 {
		t.Fatalf("AlterCopies to the same copies: %+v, %v", same, err)
	}
	// No epoch came of the refusals and the no-op, and the bumpers did
	// not write one for an epoch with the same nodes.
	settle(t, c, 4, "n0", "n1", "n2")

	if _, err := c.AlterCopies(ctx, "disk", 1); err != nil {
		t.Fatal(err)
	}
	got, err = c.GetVDI(ctx, "disk")
	if err != nil {
		t.Fatal(err)
	}
	for e, want := range map[uint64]int{v0.Epoch: 2, v1.Epoch: 3, v1.Epoch + 1: 1} {
		if n, _ := got.CopiesAt(e); n != want {
			t.Errorf("after the second change: copies in epoch %d: %d, want %d", e, n, want)
		}
	}
	settle(t, c, 5, "n0", "n1", "n2")
}

// TestAlterCopiesRacesJoins: alter-copies racing joins and one another
// keep the history rules (no epoch skipped or written twice), and each
// change's epoch is one the history holds with the copies set from it.
func TestAlterCopiesRacesJoins(t *testing.T) {
	t.Parallel()
	c, _ := formatted(t, 1, 0, 0)
	settle(t, c, 2, "n0", "n1")
	for i := range 3 {
		if _, err := c.CreateVDI(ctx, VDI{Name: fmt.Sprintf("d%d", i), Size: 1 << 20}); err != nil {
			t.Fatal(err)
		}
	}
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for i := range 3 {
		ac, jc := newClient(t, shared.Endpoints(), c.k.prefix), newClient(t, shared.Endpoints(), c.k.prefix)
		wg.Add(2)
		go func() {
			defer wg.Done()
			for _, n := range []int{2, 1, 2} {
				if _, err := ac.AlterCopies(ctx, fmt.Sprintf("d%d", i), n); err != nil {
					errs <- err
					return
				}
			}
		}()
		go func() {
			defer wg.Done()
			r, err := jc.Join(ctx, NodeInfo{ID: fmt.Sprintf("m%d", i), Addr: fmt.Sprintf("127.0.0.1:%d", 100+i), Weight: 1}, testTTL)
			if err != nil {
				errs <- err
				return
			}
			t.Cleanup(func() { r.Leave(ctx) })
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	eventually(t, 5*time.Second, func() error {
		v, err := c.View(ctx)
		if err != nil || len(v.Nodes) != 5 {
			return fmt.Errorf("view %v (%v), want 5 nodes", ids(v), err)
		}
		return nil
	})
	time.Sleep(300 * time.Millisecond)
	hist := epochHistory(t, c) // fails on a gap or a record out of place
	// 2 epochs before, 3 joins (some may share one), 9 changes.
	if len(hist) < 2+9+1 || len(hist) > 2+9+3 {
		t.Fatalf("%d epochs after 3 joins and 9 changes of copies", len(hist))
	}
	for i := range 3 {
		v, err := c.GetVDI(ctx, fmt.Sprintf("d%d", i))
		if err != nil {
			t.Fatal(err)
		}
		if v.Copies != 2 || len(v.CopiesBefore) != 3 {
			t.Fatalf("d%d: %+v, want 2 copies after 3 changes", i, v)
		}
		for j, h := range v.CopiesBefore {
			if h.Until > uint64(len(hist)) || h.Until <= v.Epoch || (j > 0 && h.Until <= v.CopiesBefore[j-1].Until) {
				t.Fatalf("d%d: change %d from epoch %d: not an epoch after its creation (%d) and the previous change, of %d", i, j, h.Until, v.Epoch, len(hist))
			}
		}
	}
}
