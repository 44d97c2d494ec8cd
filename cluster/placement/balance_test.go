package placement

import (
	"math"
	"os"
	"strconv"
	"testing"
)

// simObjects is how many objects the simulation places:
// OVIS_PLACEMENT_OBJECTS if set, else defaultSimObjects (10^7 outside
// the race detector, the scale), but at most 10^6 with -short.
func simObjects(tb testing.TB) int {
	if s := os.Getenv("OVIS_PLACEMENT_OBJECTS"); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil || n < 1000 {
			tb.Fatalf("OVIS_PLACEMENT_OBJECTS=%q: want a count of at least 1000", s)
		}
		return n
	}
	if testing.Short() {
		return min(defaultSimObjects, 1_000_000)
	}
	return defaultSimObjects
}

// balanceBound is the fullest node over the mean that the test accepts:
// the 1.05, or five standard deviations of pure sampling noise
// when there are too few objects per node for 1.05 to mean anything
// (under the race detector at 1,000 nodes).
func balanceBound(meanPerNode float64) float64 {
	return max(1.05, 1+5/math.Sqrt(meanPerNode))
}

// TestSimulation is the simulation: at 10, 100 and 1,000 nodes
// with copies=3, the fullest and emptiest node, and what a join and a
// leave move, for this package and for Sheepdog's ring. It asserts the
// targets for this package and logs the table of docs/placement.md (run
// with -v).
func TestSimulation(t *testing.T) {
	const copies = 3
	objects := simObjects(t)
	tab := &table{head: []string{"nodes", "objects", "layout", "fullest/mean", "emptiest/mean",
		"join: moved/fair share", "join: old→old", "leave: moved/held", "leave: other objects changed"}}
	for _, n := range []int{10, 100, 1000} {
		all := universe(n+1, nil, nil) // node n is the joiner
		members := span(n)
		leaver := n / 2
		after := append(span(leaver), span(n)[leaver+1:]...)
		for _, k := range []kind{ovisKind, sheepKind, ring4kKind} {
			if k == ring4kKind && raceEnabled {
				continue
			}
			old := build(t, k, all, members)
			c := count(t, old, all, objects, copies)
			hi, lo := spread(c, members)

			mv := compare(old, objects, copies,
				change{build(t, k, all, span(n+1)), int32(n), true},
				change{build(t, k, all, after), int32(leaver), false})
			join, leave := mv[0], mv[1]
			fair := float64(copies*objects) / float64(n+1)
			joinRatio := float64(join.moved) / fair
			leaveRatio := float64(leave.moved) / float64(c[leaver])

			tab.add(n, objects, k.name, hi, lo, joinRatio, join.oldToOld, leaveRatio, leave.stray)
			if k != ovisKind {
				continue
			}
			mean := float64(copies*objects) / float64(n)
			if b := balanceBound(mean); hi > b {
				t.Errorf("%d nodes: fullest node holds %.4f× the mean, want ≤ %.4f", n, hi, b)
			}
			if joinRatio > 1.1 || join.oldToOld != 0 || join.stray != 0 || join.moved != join.held {
				t.Errorf("%d nodes: join moved %d replicas (%.4f× fair share %.0f; joiner holds %d), %d between old nodes, %d objects without the joiner changed",
					n, join.moved, joinRatio, fair, join.held, join.oldToOld, join.stray)
			}
			if leave.moved != c[leaver] || leave.held != c[leaver] || leave.changed != c[leaver] || leave.stray != 0 {
				t.Errorf("%d nodes: leave moved %d replicas of %d objects; the leaver held %d; %d objects without it changed",
					n, leave.moved, leave.changed, c[leaver], leave.stray)
			}
		}
	}
	t.Log(tab)
}

// TestSimulationOneCopy repeats the balance columns with copies=1, the
// setting of the quick simulation of Sheepdog's ring (1.07× at
// 10 nodes, 1.29× at 1,000), which checks the baseline against it.
func TestSimulationOneCopy(t *testing.T) {
	objects := simObjects(t)
	tab := &table{head: []string{"nodes", "objects", "layout", "fullest/mean", "emptiest/mean"}}
	for _, n := range []int{10, 100, 1000} {
		all := universe(n, nil, nil)
		for _, k := range []kind{ovisKind, sheepKind} {
			c := count(t, build(t, k, all, span(n)), all, objects, 1)
			hi, lo := spread(c, span(n))
			tab.add(n, objects, k.name, hi, lo)
			if b := balanceBound(float64(objects) / float64(n)); k == ovisKind && hi > b {
				t.Errorf("%d nodes, copies 1: fullest node holds %.4f× the mean, want ≤ %.4f", n, hi, b)
			}
		}
	}
	t.Log(tab)
}
