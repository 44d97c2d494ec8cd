package placement

import (
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/ovis-storage/ovis/cluster/object"
)

func TestNewValidates(t *testing.T) {
	many := make([]Node, MaxNodes+1)
	for i := range many {
		many[i] = Node{ID: fmt.Sprint(i), Weight: 1}
	}
	for _, c := range []struct {
		name  string
		nodes []Node
		want  string // substring of the error; "" means success
	}{
		{"none", nil, "no nodes"},
		{"empty ID", []Node{{ID: "a", Weight: 1}, {Zone: 3, Weight: 1}}, "empty ID"},
		{"duplicate", []Node{{ID: "a", Weight: 1}, {ID: "b", Weight: 1}, {ID: "a", Weight: 2}}, `"a": duplicate ID`},
		{"weight 0", []Node{{ID: "a", Weight: 1}, {ID: "b"}}, `"b": weight 0`},
		{"too many", many, "at most 65536"},
		{"one", []Node{{ID: "a", Weight: 1}}, ""},
		{"max weight", []Node{{ID: "a", Weight: 1}, {ID: "b", Weight: 1<<32 - 1}}, ""},
		{"zones", []Node{{ID: "a", Weight: 1, Zone: 7}, {ID: "b", Weight: 1}}, ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			m, err := New(c.nodes)
			switch {
			case c.want == "" && err != nil:
				t.Fatalf("New: %v", err)
			case c.want != "" && err == nil:
				t.Fatalf("New succeeded, want error containing %q", c.want)
			case c.want != "" && !strings.Contains(err.Error(), c.want):
				t.Fatalf("New: %v, want error containing %q", err, c.want)
			case c.want == "" && len(m.Nodes()) != len(c.nodes):
				t.Fatalf("Nodes() has %d nodes, want %d", len(m.Nodes()), len(c.nodes))
			}
		})
	}
}

func TestZonesCount(t *testing.T) {
	for _, c := range []struct {
		zones []uint32
		want  int
	}{
		{[]uint32{0}, 1},
		{[]uint32{0, 0, 0, 0}, 4}, // no zones: every node its own domain
		{[]uint32{1, 1, 1, 1}, 1},
		{[]uint32{0, 1, 1, 2}, 3}, // once zones are used, 0 is a zone
		{[]uint32{5, 9, 5, 9, 1<<32 - 1}, 3},
	} {
		nodes := universe(len(c.zones), func(i int) uint32 { return c.zones[i] }, nil)
		m, err := New(nodes)
		if err != nil {
			t.Fatal(err)
		}
		if got := m.Zones(); got != c.want {
			t.Errorf("zones %v: Zones() = %d, want %d", c.zones, got, c.want)
		}
	}
}

func TestPlaceErrors(t *testing.T) {
	flat, _ := New(universe(4, nil, nil))
	zoned, _ := New(universe(6, func(i int) uint32 { return uint32(i % 2) }, nil))
	id := object.Make(3, 9)
	for _, c := range []struct {
		m      *Map
		copies int
		want   string
	}{
		{flat, 0, "copies 0: want 1 to 31"},
		{flat, -1, "copies -1"},
		{flat, MaxCopies + 1, "copies 32"},
		{flat, 5, "copies 5: only 4 nodes"},
		{zoned, 3, "copies 3: only 2 zones"},
	} {
		dst := []string{"keep"}
		got, err := c.m.Place(id, c.copies, dst)
		if err == nil || !strings.Contains(err.Error(), c.want) || !strings.Contains(err.Error(), id.String()) {
			t.Errorf("Place(copies %d) error %v, want one naming %s and %q", c.copies, err, id, c.want)
		}
		if !slices.Equal(got, dst) {
			t.Errorf("Place(copies %d) failed but returned %q", c.copies, got)
		}
	}
	for copies := 1; copies <= 4; copies++ {
		if got, err := flat.Place(id, copies, nil); err != nil || len(got) != copies {
			t.Errorf("Place(copies %d) = %q, %v", copies, got, err)
		}
	}
}

func TestNodesSortedAndOwned(t *testing.T) {
	in := []Node{{ID: "c", Weight: 3, Zone: 1}, {ID: "a", Weight: 1, Zone: 2}, {ID: "b", Weight: 2, Zone: 1}}
	m, err := New(in)
	if err != nil {
		t.Fatal(err)
	}
	in[0].ID = "changed" // New must not keep the caller's slice
	got := m.Nodes()
	want := []Node{{ID: "a", Weight: 1, Zone: 2}, {ID: "b", Weight: 2, Zone: 1}, {ID: "c", Weight: 3, Zone: 1}}
	if !slices.Equal(got, want) {
		t.Fatalf("Nodes() = %v, want %v", got, want)
	}
	got[0].ID = "mutated" // nor hand out its own
	if m.Nodes()[0].ID != "a" {
		t.Fatal("Nodes() returned the map's own slice")
	}
}

// TestPlaceAppends checks that Place appends after what dst holds and
// allocates nothing when dst has room.
func TestPlaceAppends(t *testing.T) {
	for _, nodes := range [][]Node{
		universe(100, nil, nil),
		universe(100, nil, func(i int) uint32 { return uint32(1 + i%5) }),
		universe(100, func(i int) uint32 { return uint32(i % 7) }, nil),
	} {
		m, err := New(nodes)
		if err != nil {
			t.Fatal(err)
		}
		dst := make([]string, 1, 8)
		dst[0] = "prefix"
		got, err := m.Place(object.Make(1, 2), 3, dst)
		if err != nil || len(got) != 4 || got[0] != "prefix" {
			t.Fatalf("Place = %q, %v", got, err)
		}
		allocs := testing.AllocsPerRun(100, func() {
			dst, _ = m.Place(object.Make(5, 77), 3, dst[:0])
		})
		if allocs != 0 {
			t.Errorf("Place allocates %.1f times per call with room in dst", allocs)
		}
		if allocs := testing.AllocsPerRun(100, func() { Moved(m, m, object.Make(5, 77), 3) }); allocs != 0 {
			t.Errorf("Moved allocates %.1f times per call", allocs)
		}
	}
}

// TestPlaceStable pins a few answers, so that a change of hashing
// (which would move every object of every running cluster) cannot go
// unnoticed. The values were produced by this implementation.
func TestPlaceStable(t *testing.T) {
	flat, _ := New(universe(10, nil, nil))
	weighted, _ := New(universe(10, nil, func(i int) uint32 { return uint32(1 + i) }))
	zoned, _ := New(universe(10, func(i int) uint32 { return uint32(i % 3) }, nil))
	for _, c := range []struct {
		m    *Map
		id   object.ID
		want string
	}{
		{flat, object.Make(1, 0), golden[0]},
		{flat, object.Make(0xffffffff, 0xffffffff), golden[1]},
		{weighted, object.Make(1, 0), golden[2]},
		{weighted, object.Make(42, 4242), golden[3]},
		{zoned, object.Make(1, 0), golden[4]},
		{zoned, object.Make(42, 4242), golden[5]},
	} {
		got, err := c.m.Place(c.id, 3, nil)
		if err != nil {
			t.Fatal(err)
		}
		if s := strings.Join(got, " "); s != c.want {
			t.Errorf("Place(%s) = %s, want %s", c.id, s, c.want)
		}
	}
}

var golden = []string{
	"node-0000 node-0002 node-0005",
	"node-0004 node-0000 node-0009",
	"node-0005 node-0007 node-0002",
	"node-0000 node-0008 node-0005",
	"node-0000 node-0002 node-0007",
	"node-0000 node-0001 node-0005",
}

func TestMovedErrors(t *testing.T) {
	big, _ := New(universe(5, nil, nil))
	small, _ := New(universe(3, nil, nil))
	if _, err := Moved(big, small, simID(1), 4); err == nil || !strings.Contains(err.Error(), "only 3 nodes") {
		t.Errorf("Moved(copies 4 over 5 then 3 nodes): %v", err)
	}
	if moved, err := Moved(big, big, simID(1), 3); moved || err != nil {
		t.Errorf("Moved(same map) = %v, %v", moved, err)
	}
}
