package placement

import (
	"math"
	"testing"
)

// TestZones checks failure domains: every object's copies in distinct
// zones (count fails otherwise), one copy per zone when copies equals
// the number of zones, shares inside a zone following weights, and
// minimal movement on a join into and a leave from a zone.
func TestZones(t *testing.T) {
	objects := max(simObjects(t)/10, 1000)
	for _, c := range []struct {
		name   string
		sizes  []int // nodes per zone
		copies int
		weight func(int) uint32
	}{
		{"3 zones of 2, 3, 5 nodes, copies 3", []int{2, 3, 5}, 3, nil},
		{"3 zones of 1, 4, 30 nodes, copies 3, weights 1–3", []int{1, 4, 30}, 3, func(i int) uint32 { return uint32(1 + i%3) }},
		{"5 zones of 1–20 nodes, copies 3", []int{1, 20, 3, 7, 12}, 3, nil},
		{"4 zones of 25 nodes, copies 2", []int{25, 25, 25, 25}, 2, nil},
	} {
		t.Run(c.name, func(t *testing.T) {
			var zoneOf []uint32
			for z, n := range c.sizes {
				for range n {
					zoneOf = append(zoneOf, uint32(z+1))
				}
			}
			total := len(zoneOf)
			zoneOf = append(zoneOf, 2) // the joiner, in the second zone
			all := universe(total+1, func(i int) uint32 { return zoneOf[i] }, c.weight)
			members := span(total)
			old := build(t, ovisKind, all, members)
			cnt := count(t, old, all, objects, c.copies)

			perZone := map[uint32]int64{}
			zoneWeight := map[uint32]float64{}
			for _, g := range members {
				perZone[all[g].Zone] += cnt[g]
				zoneWeight[all[g].Zone] += float64(all[g].Weight)
			}
			if c.copies == len(c.sizes) {
				for z, n := range perZone {
					if n != int64(objects) {
						t.Errorf("zone %d holds %d replicas of %d objects, want one each", z, n, objects)
					}
				}
				// Inside a zone a node wins as the top of a weighted
				// race: its share follows its weight.
				for _, g := range members {
					want := float64(perZone[all[g].Zone]) * float64(all[g].Weight) / zoneWeight[all[g].Zone]
					if e := math.Abs(float64(cnt[g])/want - 1); e > balanceBound(want)-1 {
						t.Errorf("node %s holds %d replicas, want %.0f (%.1f %% off)", all[g].ID, cnt[g], want, 100*e)
					}
				}
			}

			leaver := c.sizes[0] // the first node of the second zone
			after := append(span(leaver), span(total)[leaver+1:]...)
			mv := compare(old, objects, c.copies,
				change{build(t, ovisKind, all, span(total+1)), int32(total), true},
				change{build(t, ovisKind, all, after), int32(leaver), false})
			join, leave := mv[0], mv[1]
			if join.oldToOld != 0 || join.stray != 0 || join.moved != join.held || join.moved == 0 {
				t.Errorf("join: %+v; want moves only to the joiner, one per object it now holds", join)
			}
			if leave.stray != 0 || leave.moved != cnt[leaver] || leave.changed != cnt[leaver] {
				t.Errorf("leave: %+v; the leaver held %d; want only its objects to move, one replica each", leave, cnt[leaver])
			}
		})
	}
}

// TestZonesLastNode checks a zone with one node: when it leaves, the
// zone is gone and copies equal to the old zone count fail.
func TestZonesLastNode(t *testing.T) {
	nodes := universe(4, func(i int) uint32 { return []uint32{1, 2, 2, 3}[i] }, nil)
	m, err := New(nodes[1:])
	if err != nil {
		t.Fatal(err)
	}
	if m.Zones() != 2 {
		t.Fatalf("Zones() = %d, want 2", m.Zones())
	}
	if _, err := m.Place(simID(1), 3, nil); err == nil {
		t.Fatal("Place(copies 3) over 2 zones succeeded")
	}
	got, err := m.Place(simID(1), 2, nil)
	if err != nil || len(got) != 2 {
		t.Fatalf("Place(copies 2) = %q, %v", got, err)
	}
	zone := map[string]uint32{}
	for _, n := range nodes {
		zone[n.ID] = n.Zone
	}
	if zone[got[0]] == zone[got[1]] {
		t.Fatalf("Place = %q: both in zone %d", got, zone[got[0]])
	}
}
