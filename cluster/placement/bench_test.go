package placement

import (
	"fmt"
	"testing"
)

// BenchmarkPlace measures one Place of copies=3 at 10, 100 and 1,000
// nodes, without zones, with weights 1–4 and with 10 zones, next to a
// lookup in Sheepdog's ring of 128 vnodes per node (ring128) and in a
// ring of 4096 (ring4096).
func BenchmarkPlace(b *testing.B) {
	for _, n := range []int{10, 100, 1000} {
		for _, c := range []struct {
			name   string
			zone   func(int) uint32
			weight func(int) uint32
		}{
			{"flat", nil, nil},
			{"weighted", nil, func(i int) uint32 { return uint32(1 + i%4) }},
			{"zones", func(i int) uint32 { return uint32(1 + i%10) }, nil},
		} {
			nodes := universe(n, c.zone, c.weight)
			b.Run(fmt.Sprintf("nodes=%d/%s/ovis", n, c.name), func(b *testing.B) {
				m, err := New(nodes)
				if err != nil {
					b.Fatal(err)
				}
				dst := make([]string, 0, 3)
				b.ReportAllocs()
				i := 0
				for b.Loop() {
					dst, _ = m.Place(simID(i), 3, dst[:0])
					i++
				}
			})
			if c.name == "weighted" {
				continue // the ring's lookup does not depend on weights
			}
			for _, k := range []kind{sheepKind, ring4kKind} {
				if k == ring4kKind && c.name != "flat" {
					continue
				}
				b.Run(fmt.Sprintf("nodes=%d/%s/ring%d", n, c.name, k.vnodes), func(b *testing.B) {
					r := newRing(nodes, k.vnodes)
					dst := make([]int32, 0, 3)
					i := 0
					for b.Loop() {
						dst = r.place(simID(i), 3, dst[:0])
						i++
					}
				})
			}
		}
	}
}

// BenchmarkNew measures building a map, which every membership change
// does once.
func BenchmarkNew(b *testing.B) {
	for _, n := range []int{10, 1000} {
		nodes := universe(n, func(i int) uint32 { return uint32(i % 10) }, func(i int) uint32 { return uint32(1 + i%4) })
		b.Run(fmt.Sprintf("nodes=%d", n), func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				if _, err := New(nodes); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkNewRing measures building the rings of the comparison at
// 1,000 nodes.
func BenchmarkNewRing(b *testing.B) {
	nodes := universe(1000, nil, nil)
	for _, k := range []kind{sheepKind, ring4kKind} {
		b.Run(fmt.Sprintf("nodes=1000/ring%d", k.vnodes), func(b *testing.B) {
			for b.Loop() {
				newRing(nodes, k.vnodes)
			}
		})
	}
}
