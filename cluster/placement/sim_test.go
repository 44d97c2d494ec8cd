package placement

import (
	"fmt"
	"math"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/ovis-storage/ovis/cluster/object"
)

// The simulation: objects placed on 10, 100 and 1,000 nodes by this
// package and by Sheepdog's ring, counted per node, and compared
// between the maps before and after a join or a leave. simObjects is
// set per build (sim_full_test.go, sim_race_test.go) and can be raised
// with OVIS_PLACEMENT_OBJECTS.

// layout places objects on nodes named by their index in a universe of
// nodes, so that two maps over different node sets can be compared.
type layout interface {
	place(id object.ID, copies int, dst []int32) []int32
}

type ovisLayout struct {
	m      *Map
	global []int32 // global[i] is the universe index of m.nodes[i]
}

func (l ovisLayout) place(id object.ID, copies int, dst []int32) []int32 {
	var top [MaxCopies]cand
	n := l.m.rank(id, copies, &top)
	for _, c := range top[:n] {
		dst = append(dst, l.global[c.node])
	}
	return dst
}

type ringLayout struct {
	r      *ring
	global []int32
}

func (l ringLayout) place(id object.ID, copies int, dst []int32) []int32 {
	start := len(dst)
	dst = l.r.place(id, copies, dst)
	for i := start; i < len(dst); i++ {
		dst[i] = l.global[dst[i]]
	}
	return dst
}

// universe returns n nodes named node-0000…, in zones zone(i) with
// weights weight(i); nil functions mean no zones and weight 1.
func universe(n int, zone func(int) uint32, weight func(int) uint32) []Node {
	nodes := make([]Node, n)
	for i := range nodes {
		nodes[i] = Node{ID: fmt.Sprintf("node-%04d", i), Weight: 1}
		if zone != nil {
			nodes[i].Zone = zone(i)
		}
		if weight != nil {
			nodes[i].Weight = weight(i)
		}
	}
	return nodes
}

// kind names a layout to build over a subset of a universe.
type kind struct {
	name   string
	vnodes int // 0: this package; otherwise a Sheepdog ring with this many vnodes per node
}

var (
	ovisKind  = kind{"ovis (HRW)", 0}
	sheepKind = kind{"Sheepdog ring, 128 vnodes", sdDefaultVnodes}
	// A ring with more vnodes, the other design considered.
	ring4kKind = kind{"ring, 4096 vnodes", 4096}
)

// build makes the layout of kind k over the universe nodes whose
// indexes are members.
func build(tb testing.TB, k kind, all []Node, members []int) layout {
	tb.Helper()
	nodes := make([]Node, len(members))
	for i, g := range members {
		nodes[i] = all[g]
	}
	byID := map[string]int32{}
	for _, g := range members {
		byID[all[g].ID] = int32(g)
	}
	if k.vnodes != 0 {
		global := make([]int32, len(nodes))
		for i, n := range nodes {
			global[i] = byID[n.ID]
		}
		return ringLayout{newRing(nodes, k.vnodes), global}
	}
	m, err := New(nodes)
	if err != nil {
		tb.Fatal(err)
	}
	global := make([]int32, len(m.nodes))
	for i, n := range m.nodes {
		global[i] = byID[n.ID]
	}
	return ovisLayout{m, global}
}

func span(n int) []int {
	s := make([]int, n)
	for i := range s {
		s[i] = i
	}
	return s
}

// simID is the i-th object of the simulation: VDIs of 2^20 objects
// (4 TiB at 4 MiB), indexes from 0, as a cluster fills.
func simID(i int) object.ID { return object.Make(object.VDI(1+i>>20), uint32(i&(1<<20-1))) }

// parallel runs f over [0, objects) in one chunk per CPU and waits.
func parallel(objects int, f func(w, lo, hi int)) int {
	workers := runtime.GOMAXPROCS(0)
	var wg sync.WaitGroup
	for w := range workers {
		lo, hi := objects*w/workers, objects*(w+1)/workers
		wg.Go(func() { f(w, lo, hi) })
	}
	wg.Wait()
	return workers
}

// count places objects and returns the replicas per universe node. It
// fails the test when an object's nodes or zones repeat.
func count(tb testing.TB, l layout, all []Node, objects, copies int) []int64 {
	tb.Helper()
	workers := runtime.GOMAXPROCS(0)
	per := make([][]int64, workers)
	bad := make([]string, workers)
	zoned := zonedNodes(all)
	parallel(objects, func(w, lo, hi int) {
		c := make([]int64, len(all))
		dst := make([]int32, 0, copies)
		seen := make([]uint32, 0, copies)
		for i := lo; i < hi; i++ {
			dst = l.place(simID(i), copies, dst[:0])
			seen = seen[:0]
			for _, n := range dst {
				c[n]++
				key := uint32(n)
				if zoned {
					key = all[n].Zone
				}
				if slices.Contains(seen, key) && bad[w] == "" {
					bad[w] = fmt.Sprintf("object %s: nodes %v share a failure domain", simID(i), dst)
				}
				seen = append(seen, key)
			}
			if len(dst) != copies && bad[w] == "" {
				bad[w] = fmt.Sprintf("object %s: %d nodes, want %d", simID(i), len(dst), copies)
			}
		}
		per[w] = c
	})
	for _, b := range bad {
		if b != "" {
			tb.Fatal(b)
		}
	}
	total := make([]int64, len(all))
	for _, c := range per {
		for i, v := range c {
			total[i] += v
		}
	}
	return total
}

func zonedNodes(all []Node) bool {
	for _, n := range all {
		if n.Zone != 0 {
			return true
		}
	}
	return false
}

// spread returns the fullest and emptiest node's count over the mean,
// among the members.
func spread(c []int64, members []int) (hi, lo float64) {
	var sum, mx int64
	mn := int64(math.MaxInt64)
	for _, g := range members {
		sum += c[g]
		mx = max(mx, c[g])
		mn = min(mn, c[g])
	}
	mean := float64(sum) / float64(len(members))
	return float64(mx) / mean, float64(mn) / mean
}

// moves compares the placement of objects under two layouts.
type moves struct {
	moved    int64 // replicas on a node in new that were not on it in old
	oldToOld int64 // of those, replicas that landed on a node present in both
	changed  int64 // objects whose node set changed
	held     int64 // replicas the joiner holds (join) or the leaver held (leave)
	stray    int64 // objects that changed without involving the joiner or leaver
}

func (m *moves) add(o moves) {
	m.moved += o.moved
	m.oldToOld += o.oldToOld
	m.changed += o.changed
	m.held += o.held
	m.stray += o.stray
}

// change is a membership change to simulate: the layout after it, and
// the node (universe index) that joins or leaves.
type change struct {
	after layout
	node  int32
	join  bool
}

// compare places objects under old and under each change's layout, in
// one pass, and returns what each change moves.
func compare(old layout, objects, copies int, changes ...change) []moves {
	workers := runtime.GOMAXPROCS(0)
	per := make([][]moves, workers)
	parallel(objects, func(w, lo, hi int) {
		mv := make([]moves, len(changes))
		a := make([]int32, 0, copies)
		b := make([]int32, 0, copies)
		for i := lo; i < hi; i++ {
			a = old.place(simID(i), copies, a[:0])
			for c, ch := range changes {
				b = ch.after.place(simID(i), copies, b[:0])
				mv[c].add(diff(a, b, ch.node, ch.join))
			}
		}
		per[w] = mv
	})
	total := make([]moves, len(changes))
	for _, mv := range per {
		for c := range mv {
			total[c].add(mv[c])
		}
	}
	return total
}

// diff compares one object's node sets before (a) and after (b) the
// join or leave of node.
func diff(a, b []int32, node int32, join bool) moves {
	var mv moves
	inOld, inNew := slices.Contains(a, node), slices.Contains(b, node)
	if join && inNew || !join && inOld {
		mv.held++
	}
	for _, n := range b {
		if !slices.Contains(a, n) {
			mv.moved++
			if n != node {
				mv.oldToOld++
			}
		}
	}
	if mv.moved > 0 {
		mv.changed++
		if join && !inNew || !join && !inOld {
			mv.stray++
		}
	}
	return mv
}

// table collects rows of a markdown table that the test logs.
type table struct {
	head []string
	rows [][]string
}

func (t *table) add(cells ...any) {
	row := make([]string, len(cells))
	for i, c := range cells {
		switch v := c.(type) {
		case float64:
			row[i] = fmt.Sprintf("%.3f", v)
		default:
			row[i] = fmt.Sprint(v)
		}
	}
	t.rows = append(t.rows, row)
}

func (t *table) String() string {
	var b strings.Builder
	b.WriteString("\n| " + strings.Join(t.head, " | ") + " |\n|")
	for range t.head {
		b.WriteString("---|")
	}
	b.WriteString("\n")
	for _, r := range t.rows {
		b.WriteString("| " + strings.Join(r, " | ") + " |\n")
	}
	return b.String()
}
