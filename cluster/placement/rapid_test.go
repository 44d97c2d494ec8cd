package placement

import (
	"fmt"
	"math"
	"slices"
	"testing"

	"github.com/ovis-storage/ovis/cluster/object"
	"pgregory.net/rapid"
)

// genNodes draws a valid node list: unique IDs, zones from a few values
// (often all 0), weights from 1 to 5 or one large weight.
func genNodes(t *rapid.T, label string) []Node {
	ids := rapid.SliceOfNDistinct(rapid.StringMatching(`[a-z0-9.:-]{1,12}`), 1, 40, rapid.ID).Draw(t, label+" ids")
	zoned := rapid.Bool().Draw(t, label+" zoned")
	weighted := rapid.Bool().Draw(t, label+" weighted")
	nodes := make([]Node, len(ids))
	for i, id := range ids {
		nodes[i] = Node{ID: id, Weight: 1}
		if zoned {
			nodes[i].Zone = rapid.Uint32Range(0, 4).Draw(t, "zone")
		}
		if weighted {
			nodes[i].Weight = rapid.SampledFrom([]uint32{1, 2, 3, 4, 5, 1000, math.MaxUint32}).Draw(t, "weight")
		}
	}
	return nodes
}

// modelPlace is the plain definition that rank computes in one pass:
// score every node, sort by score (ties to the node that sorts first by
// ID), and walk down taking the first node of each zone not yet taken.
func modelPlace(m *Map, id object.ID, copies int) []string {
	type scored struct {
		key uint64
		i   int
	}
	oh := objectHash(id)
	all := make([]scored, len(m.nodes))
	for i := range m.nodes {
		h := mix(oh ^ nodeSeed(m.nodes[i].ID))
		k := h
		if m.weighted {
			k = ^math.Float64bits(float64(negLog2(h)) / float64(m.nodes[i].Weight))
		}
		all[i] = scored{k, i}
	}
	slices.SortStableFunc(all, func(a, b scored) int {
		switch {
		case a.key > b.key:
			return -1
		case a.key < b.key:
			return 1
		}
		return 0
	})
	zoned := false
	for _, n := range m.nodes {
		zoned = zoned || n.Zone != 0
	}
	var out []string
	taken := map[string]bool{}
	for _, s := range all {
		n := m.nodes[s.i]
		dom := n.ID
		if zoned {
			dom = fmt.Sprint(n.Zone)
		}
		if !taken[dom] && len(out) < copies {
			taken[dom] = true
			out = append(out, n.ID)
		}
	}
	return out
}

func TestRapidPlace(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		nodes := genNodes(t, "nodes")
		m, err := New(nodes)
		if err != nil {
			t.Fatalf("New: %v", err)
		}
		domains := map[string]bool{}
		zoned := false
		for _, n := range nodes {
			zoned = zoned || n.Zone != 0
		}
		for _, n := range nodes {
			if zoned {
				domains[fmt.Sprint(n.Zone)] = true
			} else {
				domains[n.ID] = true
			}
		}
		if m.Zones() != len(domains) {
			t.Fatalf("Zones() = %d, want %d", m.Zones(), len(domains))
		}
		shuffled := rapid.Permutation(nodes).Draw(t, "shuffled")
		m2, err := New(shuffled)
		if err != nil {
			t.Fatalf("New(shuffled): %v", err)
		}
		zoneOf := map[string]uint32{}
		for _, n := range nodes {
			zoneOf[n.ID] = n.Zone
		}
		for range 20 {
			id := object.ID(rapid.Uint64().Draw(t, "id"))
			copies := rapid.IntRange(-1, MaxCopies+2).Draw(t, "copies")
			got, err := m.Place(id, copies, nil)
			if copies < 1 || copies > m.Zones() || copies > MaxCopies {
				if err == nil {
					t.Fatalf("Place(copies %d) over %d domains succeeded", copies, m.Zones())
				}
				continue
			}
			if err != nil {
				t.Fatalf("Place(%s, %d): %v", id, copies, err)
			}
			if want := modelPlace(m, id, copies); !slices.Equal(got, want) {
				t.Fatalf("Place(%s, %d) = %q, model says %q", id, copies, got, want)
			}
			again, _ := m.Place(id, copies, nil)
			other, _ := m2.Place(id, copies, nil)
			if !slices.Equal(got, again) || !slices.Equal(got, other) {
				t.Fatalf("Place(%s, %d) = %q, then %q, and %q from shuffled nodes", id, copies, got, again, other)
			}
			seen := map[string]bool{}
			for _, n := range got {
				dom := n
				if zoned {
					dom = fmt.Sprint(zoneOf[n])
				}
				if seen[dom] {
					t.Fatalf("Place(%s, %d) = %q: domain %s twice", id, copies, got, dom)
				}
				seen[dom] = true
			}
		}
	})
}

// TestRapidMovement checks invariant 4 on random maps: a join replaces
// at most one node of an object's set, by the joiner; a leave changes
// only sets that held the leaver, replacing it by one node.
func TestRapidMovement(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		nodes := genNodes(t, "nodes")
		if len(nodes) < 2 {
			return
		}
		joiner := nodes[len(nodes)-1]
		before, err := New(nodes[:len(nodes)-1])
		if err != nil {
			t.Fatal(err)
		}
		after, err := New(nodes)
		if err != nil {
			t.Fatal(err)
		}
		// Zones must mean the same in both maps: a join that turns
		// zones on is a change of every node's domain.
		if before.zoned != after.zoned {
			return
		}
		copies := rapid.IntRange(1, min(before.Zones(), MaxCopies)).Draw(t, "copies")
		for range 50 {
			id := object.ID(rapid.Uint64().Draw(t, "id"))
			a, err1 := before.Place(id, copies, nil)
			b, err2 := after.Place(id, copies, nil)
			if err1 != nil || err2 != nil {
				t.Fatal(err1, err2)
			}
			var added, removed []string
			for _, n := range b {
				if !slices.Contains(a, n) {
					added = append(added, n)
				}
			}
			for _, n := range a {
				if !slices.Contains(b, n) {
					removed = append(removed, n)
				}
			}
			moved, err := Moved(before, after, id, copies)
			if err != nil || moved != (len(added) > 0) {
				t.Fatalf("object %s: Moved = %v, %v; sets %q → %q", id, moved, err, a, b)
			}
			if back, _ := Moved(after, before, id, copies); back != moved {
				t.Fatalf("object %s: Moved is not symmetric", id)
			}
			// Read as a join (before → after) and as a leave (after →
			// before) of the same node.
			if len(added) > 1 || len(added) != len(removed) || len(added) == 1 && added[0] != joiner.ID {
				t.Fatalf("object %s: join of %s: %q → %q", id, joiner.ID, a, b)
			}
		}
	})
}
