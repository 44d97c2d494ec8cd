package node

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/ovis-storage/ovis/cluster/membership"
	"github.com/ovis-storage/ovis/cluster/object"
	"github.com/ovis-storage/ovis/cluster/placement"
	"github.com/ovis-storage/ovis/cluster/protocol"
	"github.com/ovis-storage/ovis/cluster/store"
	"github.com/ovis-storage/ovis/cluster/view"
)

var ctx = context.Background()

type fixedEpoch uint64

func (e fixedEpoch) Epoch() uint64                            { return uint64(e) }
func (e fixedEpoch) AwaitEpoch(context.Context, uint64) error { return nil }

// handlers is a Caller that serves each address with its own handler,
// in process.
type handlers map[string]*Handler

func (hs handlers) Call(ctx context.Context, addr string, req *protocol.Request, resp *protocol.Response) error {
	return (&localCaller{self: addr, h: hs[addr]}).Call(ctx, addr, req, resp)
}

// TestCheck writes objects of two VDIs to the replicas placement gives
// them on three nodes, and checks that Check finds them all (over pages
// of two), then each kind of damage, an object in an allocation map that
// no node holds among them.
func TestCheck(t *testing.T) {
	listPage = 2
	defer func() { listPage = 1 << 16 }()
	hs := handlers{}
	stores := map[string]*store.Store{}
	var nodes []placement.Node
	addrs := map[string]string{}
	for i := range 3 {
		id := fmt.Sprintf("n%d", i)
		st, err := store.Open(t.TempDir(), store.Options{})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { st.Close() })
		stores[id] = st
		hs[id] = &Handler{Store: st, Epochs: fixedEpoch(1)}
		nodes = append(nodes, placement.Node{ID: id, Weight: 1})
		addrs[id] = id
	}
	v, err := view.New(1, nodes, addrs)
	if err != nil {
		t.Fatal(err)
	}
	// VDI 1 keeps an allocation map of 8 objects; VDI 2, made before
	// maps, none.
	vdis := []membership.VDI{{ID: 1, Name: "a", Copies: 2, Size: 8 << 22, ObjectShift: 22, Allocation: true}, {ID: 2, Name: "b", Copies: 3}}
	var alloc object.Set
	allocated := func(_ context.Context, vd membership.VDI) (*object.Set, error) {
		if vd.ID != 1 {
			t.Errorf("the map of vdi %d, which keeps none, was read", vd.ID)
		}
		return &alloc, nil
	}
	write := func(o object.ID, copies int, b byte) {
		reps, err := v.Map.Place(o, copies, nil)
		if err != nil {
			t.Fatal(err)
		}
		for _, id := range reps {
			if _, err := stores[id].WriteAt(o, store.Stamp{Token: 1}, []byte{b, b, b}, 100, false); err != nil {
				t.Fatal(err)
			}
		}
	}
	for i := range uint32(5) {
		alloc.Add(i)
		write(object.Make(1, i), 2, byte(i))
		write(object.Make(2, i), 3, byte(i))
	}
	var calls, last int
	r, err := Check(ctx, hs, v, vdis, allocated, func(done, total int) { calls++; last = total })
	if err != nil {
		t.Fatal(err)
	}
	if r.Objects != 10 || r.Copies != 25 || len(r.Bad) != 0 || calls != 10 || last != 10 {
		t.Fatalf("clean check: %d objects, %d copies, problems %v, %d progress calls of %d; want 10, 25, none, 10 of 10", r.Objects, r.Copies, r.Bad, calls, last)
	}

	// One VDI's objects alone, over pages of two: n0 holds the objects of
	// VDI 2 (3 copies on 3 nodes) and only those of VDI 1 placed on it.
	infos, err := listAll(ctx, hs, v, "n0", 2)
	if err != nil {
		t.Fatal(err)
	}
	if len(infos) != 5 {
		t.Errorf("listAll of VDI 2 on n0: %d objects, want 5", len(infos))
	}
	for _, in := range infos {
		if in.ID.VDI() != 2 {
			t.Errorf("listAll of VDI 2 returned object %s", in.ID)
		}
	}

	// A copy that differs, a missing copy, an extra copy, an orphan.
	reps, _ := v.Map.Place(object.Make(1, 0), 2, nil)
	stores[reps[0]].WriteAt(object.Make(1, 0), store.Stamp{Token: 1}, []byte{9}, 100, false)
	reps, _ = v.Map.Place(object.Make(2, 1), 3, nil)
	stores[reps[2]].Remove(object.Make(2, 1), store.Stamp{Token: 1})
	reps, _ = v.Map.Place(object.Make(1, 2), 2, nil)
	for _, n := range nodes {
		if n.ID != reps[0] && n.ID != reps[1] {
			stores[n.ID].WriteAt(object.Make(1, 2), store.Stamp{Token: 1}, []byte{2, 2, 2}, 100, false)
		}
	}
	stores["n0"].WriteAt(object.Make(3, 0), store.Stamp{Token: 1}, []byte{1}, 0, false)
	// Object 6 of VDI 1 was written and every copy is gone; 9 is past
	// the VDI's end (shrunk).
	alloc.Add(6)
	alloc.Add(9)
	r, err = Check(ctx, hs, v, vdis, allocated, nil)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, b := range r.Bad {
		got = append(got, b.Object+": "+b.Problem)
	}
	all := strings.Join(got, "\n")
	for _, want := range []string{
		object.Make(1, 0).String() + ": copies differ",
		object.Make(2, 1).String() + ": 1 of 3 copies missing",
		object.Make(1, 2).String() + ": extra copy",
		object.Make(3, 0).String() + ": object of no VDI",
		object.Make(1, 6).String() + ": written (in the VDI's allocation map), and no node that is up holds a copy",
	} {
		if !strings.Contains(all, want) {
			t.Errorf("check did not report %q; it reported:\n%s", want, all)
		}
	}
	if len(r.Bad) != 5 {
		t.Errorf("%d problems, want 5:\n%s", len(r.Bad), all)
	}
}
