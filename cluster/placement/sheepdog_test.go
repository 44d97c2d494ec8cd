package placement

import (
	"math"
	"slices"

	"github.com/ovis-storage/ovis/cluster/object"
)

// The baseline: Sheepdog's ring, as in sheepdog/sheepdog
// include/sheep.h (node_to_vnodes, oid_to_vnodes) and
// include/sheepdog_proto.h (fnv_64a_64, sd_hash, sd_hash_next,
// sd_hash_oid), with the vnode count per node of sheep/group.c
// (recalculate_vnodes: rintf(SD_DEFAULT_VNODES * space/avg)). Sheepdog
// hashes a node's address and port; here the node's ID string stands
// for them.

const (
	fnvInit         = 0xcbf29ce484222325
	fnvPrime        = 0x100000001b3
	sdDefaultVnodes = 128
)

func fnv64aBuf(p []byte, h uint64) uint64 {
	for _, c := range p {
		h ^= uint64(c)
		h *= fnvPrime
	}
	return h
}

// fnv64a64 is FNV-1a over the 8 little-endian bytes of v.
func fnv64a64(v, h uint64) uint64 {
	for i := 0; i < 8; i++ {
		h ^= v >> (8 * i) & 0xff
		h *= fnvPrime
	}
	return h
}

func sdHash(p []byte) uint64 {
	h := fnv64aBuf(p, fnvInit)
	return fnv64a64(h, h)
}

func sdHashNext(h uint64) uint64 { return fnv64a64(h, h) }

func sdHashOID(oid uint64) uint64 {
	h := fnv64a64(oid, fnvInit)
	return fnv64a64(h, h)
}

// ring is Sheepdog's vnode ring over a node list.
type ring struct {
	hash  []uint64 // sorted
	owner []int32  // owner[i] is the node of vnode i
	zone  []int32  // zone[n] is node n's failure domain
}

// newRing builds the ring of nodes with perNode vnodes for a node of
// average weight (128 in Sheepdog).
func newRing(nodes []Node, perNode int) *ring {
	var sum float64
	zoned := false
	for _, n := range nodes {
		sum += float64(n.Weight)
		zoned = zoned || n.Zone != 0
	}
	avg := sum / float64(len(nodes))
	type vnode struct {
		hash  uint64
		owner int32
	}
	var vs []vnode
	r := &ring{zone: make([]int32, len(nodes))}
	zones := map[uint32]int32{}
	for i, n := range nodes {
		r.zone[i] = int32(i)
		if zoned {
			z, ok := zones[n.Zone]
			if !ok {
				z = int32(len(zones))
				zones[n.Zone] = z
			}
			r.zone[i] = z
		}
		h := sdHash([]byte(n.ID))
		count := int(math.RoundToEven(float64(perNode) * float64(n.Weight) / avg))
		for range count {
			h = sdHashNext(h)
			vs = append(vs, vnode{h, int32(i)})
		}
	}
	slices.SortFunc(vs, func(a, b vnode) int {
		if a.hash < b.hash {
			return -1
		}
		if a.hash > b.hash {
			return 1
		}
		return 0
	})
	for _, v := range vs {
		r.hash = append(r.hash, v.hash)
		r.owner = append(r.owner, v.owner)
	}
	return r
}

// place appends the nodes (indexes into the ring's node list) of oid:
// the owner of the first vnode at or after the object's hash, then the
// next vnodes clockwise whose zone is not taken yet. copies must not
// exceed the number of zones.
func (r *ring) place(id object.ID, copies int, dst []int32) []int32 {
	key := sdHashOID(uint64(id))
	i, _ := slices.BinarySearch(r.hash, key)
	if i == len(r.hash) {
		i = 0
	}
	start := len(dst)
	for len(dst)-start < copies {
		n := r.owner[i]
		taken := false
		for _, m := range dst[start:] {
			if r.zone[m] == r.zone[n] {
				taken = true
				break
			}
		}
		if !taken {
			dst = append(dst, n)
		}
		if i++; i == len(r.hash) {
			i = 0
		}
	}
	return dst
}
