package placement

import (
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"

	"github.com/ovis-storage/ovis/cluster/object"
)

// Limits of a Map.
const (
	// MaxCopies is the most replicas Place gives one object, as
	// Sheepdog's SD_MAX_COPIES.
	MaxCopies = 31
	// MaxNodes is the most nodes a Map holds. Place costs O(nodes).
	MaxNodes = 1 << 16
)

// Node is one storage node as placement sees it.
type Node struct {
	// ID names the node; it must be non-empty and unique in a Map. The
	// node's hash seed derives from it, so renaming a node moves its
	// data.
	ID string
	// Zone is the node's failure domain. When every node has zone 0 the
	// map has no zones and each node is its own failure domain; as soon
	// as one node has a non-zero zone, every value, 0 included, names a
	// zone.
	Zone uint32
	// Weight is the node's relative share of the replicas, typically its
	// capacity in some unit. It must be at least 1: 0 is rejected rather
	// than read as a default, so that a missing value is noticed.
	Weight uint32
}

// Map gives each object its replica nodes. Build it with New.
//
// A Map is immutable and safe for concurrent use.
type Map struct {
	nodes    []Node    // sorted by ID
	seeds    []uint64  // seeds[i] is node i's hash seed
	invW     []float64 // invW[i] is 1/weight of node i
	maxW     float64   // the largest weight, for the weighted pre-test
	zoneOf   []int32   // dense zone index of node i; i itself without zones
	zones    int       // failure domains: distinct zones, or len(nodes)
	zoned    bool      // some node has a non-zero zone
	weighted bool      // weights differ: scores need the logarithm
}

// New builds the Map of nodes. The order of nodes does not matter. It
// fails, naming the node and what is wrong, when nodes is empty or
// longer than MaxNodes, an ID is empty or repeated, a weight is 0, or
// two IDs hash to the same seed. New does not keep nodes.
func New(nodes []Node) (*Map, error) {
	if len(nodes) == 0 {
		return nil, errors.New("placement: no nodes")
	}
	if len(nodes) > MaxNodes {
		return nil, fmt.Errorf("placement: %d nodes: at most %d", len(nodes), MaxNodes)
	}
	m := &Map{nodes: slices.Clone(nodes)}
	slices.SortFunc(m.nodes, func(a, b Node) int { return strings.Compare(a.ID, b.ID) })
	for i, n := range m.nodes {
		if n.ID == "" {
			return nil, fmt.Errorf("placement: node %d (zone %d): empty ID", i, n.Zone)
		}
		if i > 0 && m.nodes[i-1].ID == n.ID {
			return nil, fmt.Errorf("placement: node %q: duplicate ID", n.ID)
		}
		if n.Weight == 0 {
			return nil, fmt.Errorf("placement: node %q: weight 0: want at least 1", n.ID)
		}
		if n.Zone != 0 {
			m.zoned = true
		}
		if n.Weight != m.nodes[0].Weight {
			m.weighted = true
		}
	}

	m.seeds = make([]uint64, len(m.nodes))
	m.invW = make([]float64, len(m.nodes))
	for i, n := range m.nodes {
		m.seeds[i] = nodeSeed(n.ID)
		m.invW[i] = 1 / float64(n.Weight)
		m.maxW = max(m.maxW, float64(n.Weight))
	}
	// Equal seeds would give two nodes equal scores for every object,
	// and the one sorting later would never win.
	sorted := slices.Clone(m.seeds)
	slices.Sort(sorted)
	for i := 1; i < len(sorted); i++ {
		if sorted[i] == sorted[i-1] {
			j := slices.Index(m.seeds, sorted[i])
			k := j + 1 + slices.Index(m.seeds[j+1:], sorted[i])
			return nil, fmt.Errorf("placement: nodes %q and %q: IDs hash to the same seed %#x", m.nodes[j].ID, m.nodes[k].ID, sorted[i])
		}
	}

	m.zoneOf = make([]int32, len(m.nodes))
	if !m.zoned {
		for i := range m.zoneOf {
			m.zoneOf[i] = int32(i)
		}
		m.zones = len(m.nodes)
		return m, nil
	}
	index := make(map[uint32]int32)
	for i, n := range m.nodes {
		z, ok := index[n.Zone]
		if !ok {
			z = int32(len(index))
			index[n.Zone] = z
		}
		m.zoneOf[i] = z
	}
	m.zones = len(index)
	return m, nil
}

// Nodes returns the map's nodes sorted by ID. The caller owns the slice.
func (m *Map) Nodes() []Node { return slices.Clone(m.nodes) }

// Zones returns the number of failure domains: the number of distinct
// zones, or the number of nodes when the map has no zones. Place gives
// at most this many copies.
func (m *Map) Zones() int { return m.zones }

// cand is one of the best zones seen so far while scoring an object.
type cand struct {
	key  uint64 // larger is better
	node int32
	zone int32
}

// Place appends to dst the IDs of the copies nodes that hold object id,
// primary first, and returns the extended slice. The nodes are distinct
// and, when the map has zones, in distinct zones. It fails, changing
// nothing, when copies is below 1, above MaxCopies or above Zones(). It
// allocates nothing when dst has room for copies more IDs; the strings
// are the map's own and stay valid.
func (m *Map) Place(id object.ID, copies int, dst []string) ([]string, error) {
	if err := m.check(id, copies); err != nil {
		return dst, err
	}
	var top [MaxCopies]cand
	n := m.rank(id, copies, &top)
	for _, c := range top[:n] {
		dst = append(dst, m.nodes[c.node].ID)
	}
	return dst, nil
}

// check returns the error of Place for copies, or nil.
func (m *Map) check(id object.ID, copies int) error {
	if copies < 1 || copies > MaxCopies {
		return fmt.Errorf("placement: object %s: copies %d: want 1 to %d", id, copies, MaxCopies)
	}
	if copies > m.zones {
		if m.zoned {
			return fmt.Errorf("placement: object %s: copies %d: only %d zones", id, copies, m.zones)
		}
		return fmt.Errorf("placement: object %s: copies %d: only %d nodes", id, copies, m.zones)
	}
	return nil
}

// rank fills top with the best node of each of the copies best zones,
// best first, and returns how many it found (copies, when copies ≤
// Zones()). Ties go to the node that sorts first by ID, so the answer
// does not depend on floating-point ties either.
func (m *Map) rank(id object.ID, copies int, top *[MaxCopies]cand) int {
	oh := objectHash(id)
	t := 0
	if !m.weighted {
		for i, seed := range m.seeds {
			k := mix(oh ^ seed)
			if t == copies && k <= top[t-1].key {
				continue // the common case: not among the best
			}
			t = m.insert(top, t, copies, k, i)
		}
		return t
	}
	// Weighted: the score is -log2(u)/w, smallest best, stored as the
	// complemented bits of the positive float64, which order the same
	// way as larger-is-better keys. Most nodes are ruled out before the
	// logarithm: -log2(u) ≥ 1-u, and 1-u is the complement of h.
	// The first test is integer-only, against the heaviest weight; the
	// second is the node's own.
	thr := math.Inf(1)              // the worst score in a full top
	thrLB := uint64(math.MaxUint64) // rule out lb ≥ thrLB: then lb/maxW > thr
	for i, seed := range m.seeds {
		h := mix(oh ^ seed)
		lb := ^h >> (64 - logFrac) // ≤ -log2(u) in negLog2's units
		if lb >= thrLB || lb > logSlack && float64(lb-logSlack)*m.invW[i] >= thr {
			continue
		}
		k := ^math.Float64bits(float64(negLog2(h)) * m.invW[i])
		if t == copies && k <= top[t-1].key {
			continue
		}
		t = m.insert(top, t, copies, k, i)
		if t == copies {
			thr = math.Float64frombits(^top[t-1].key)
			if v := thr * m.maxW; v < 1<<62 {
				thrLB = uint64(v) + 1 + logSlack
			}
		}
	}
	return t
}

// logSlack covers the error of negLog2 (below 2^-26) in the lower
// bound of the weighted loop, with room to spare, so that the bound
// never rules out a node that would have made the top.
const logSlack = 1 << (logFrac - 24)

// insert puts node i with key k into top, which holds t entries, unless
// its zone already has a better node; it returns the new count.
func (m *Map) insert(top *[MaxCopies]cand, t, copies int, k uint64, i int) int {
	z := m.zoneOf[i]
	j := t
	if m.zoned {
		for j = 0; j < t && top[j].zone != z; j++ {
		}
		if j < t && k <= top[j].key {
			return t // its zone already has a better node
		}
	}
	if j == t { // a zone not in top: take a new slot or the last one
		if t < copies {
			t++
		}
		j = t - 1
	}
	// Move the entry up to keep top sorted by key, best first; equal
	// keys keep the earlier node first.
	for ; j > 0 && top[j-1].key < k; j-- {
		top[j] = top[j-1]
	}
	top[j] = cand{key: k, node: int32(i), zone: z}
	return t
}

// nodeSeed is a node's hash seed: FNV-1a of its ID, mixed.
func nodeSeed(id string) uint64 {
	h := uint64(0xcbf29ce484222325)
	for i := 0; i < len(id); i++ {
		h ^= uint64(id[i])
		h *= 0x100000001b3
	}
	return mix(h)
}

// objectHash spreads an object ID over 64 bits, so that the consecutive
// indexes of one VDI score independently.
func objectHash(id object.ID) uint64 { return mix(uint64(id) ^ 0x9e3779b97f4a7c15) }

// mix is MurmurHash3's 64-bit finalizer: a bijection whose output bits
// each depend on every input bit.
func mix(x uint64) uint64 {
	x ^= x >> 33
	x *= 0xff51afd7ed558ccd
	x ^= x >> 33
	x *= 0xc4ceb9fe1a85ec53
	x ^= x >> 33
	return x
}
