package placement

import (
	"fmt"
	"math"
	"testing"
)

// shareError returns the largest relative difference between a node's
// replicas and its weight's share of all replicas, the node, and the
// largest such difference over the bound balanceBound gives that node's
// expected count (above 1 fails).
func shareError(c []int64, nodes []Node, members []int) (worst float64, at int, overBound float64) {
	var total, weight float64
	for _, g := range members {
		total += float64(c[g])
		weight += float64(nodes[g].Weight)
	}
	for _, g := range members {
		want := total * float64(nodes[g].Weight) / weight
		e := math.Abs(float64(c[g])/want - 1)
		if e > worst {
			worst, at = e, g
		}
		overBound = max(overBound, e/(balanceBound(want)-1))
	}
	return worst, at, overBound
}

// expected returns the replicas node at should hold for its weight.
func expected(c []int64, nodes []Node, members []int, at int) float64 {
	var total, weight float64
	for _, g := range members {
		total += float64(c[g])
		weight += float64(nodes[g].Weight)
	}
	return total * float64(nodes[at].Weight) / weight
}

// maxInclusion is the largest share of the objects that a node must
// hold for its weight: copies times its share of the weight.
func maxInclusion(nodes []Node, copies int) float64 {
	var sum, mx float64
	for _, n := range nodes {
		sum += float64(n.Weight)
		mx = max(mx, float64(n.Weight))
	}
	return float64(copies) * mx / sum
}

// TestWeights checks that shares follow weights within 5 %, at copies=3,
// for weight mixes where no node must hold more than about a tenth of
// the objects. The rows not asserted show the limit, logged: a node
// cannot hold two copies of one object, so when its weight asks for a
// large fraction of all objects it gets less and the light nodes more
// (the "multi-pick anomaly" of weighted sampling without replacement,
// which Ceph's straw2 and Sheepdog's ring share). It runs a quarter of
// the simulation's objects.
func TestWeights(t *testing.T) {
	const copies = 3
	objects := max(simObjects(t)/4, 1000)
	tab := &table{head: []string{"nodes", "weights", "heaviest node's objects", "layout", "worst share error", "at weight", "sampling σ there", "asserted"}}
	cycle := func(ws ...uint32) func(int) uint32 { return func(i int) uint32 { return ws[i%len(ws)] } }
	for _, c := range []struct {
		n      int
		name   string
		weight func(int) uint32
		assert bool
	}{
		{10, "1,2", cycle(1, 2), false},
		{100, "1,2,3,4", cycle(1, 2, 3, 4), true},
		{1000, "1,2,3,4", cycle(1, 2, 3, 4), true},
		{100, "1 and 10", cycle(1, 1, 1, 1, 10), true},
		{100, "100, 1000, 4000 (TB-like)", cycle(100, 1000, 4000), true},
		{10, "1,2,3,4", cycle(1, 2, 3, 4), false},
	} {
		all := universe(c.n, nil, c.weight)
		members := span(c.n)
		for _, k := range []kind{ovisKind, sheepKind, ring4kKind} {
			if k == ring4kKind && (raceEnabled || c.n > 100) {
				continue // 4 M vnodes: slow to build, and only compared
			}
			cnt := count(t, build(t, k, all, members), all, objects, copies)
			worst, at, over := shareError(cnt, all, members)
			incl := maxInclusion(all, copies)
			sigma := 1 / math.Sqrt(expected(cnt, all, members, at))
			tab.add(c.n, c.name, fmt.Sprintf("%.1f %%", 100*incl), k.name, fmt.Sprintf("%.1f %%", 100*worst),
				all[at].Weight, fmt.Sprintf("%.1f %%", 100*sigma), k == ovisKind && c.assert)
			if k == ovisKind && c.assert && over > 1 {
				t.Errorf("%d nodes, weights %s: node %s (weight %d) is %.2f %% off its share, %.2f× the bound",
					c.n, c.name, all[at].ID, all[at].Weight, 100*worst, over)
			}
		}
	}
	t.Log(tab)
}
