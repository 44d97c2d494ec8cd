package recovery

import (
	"fmt"
	"testing"

	"pgregory.net/rapid"
)

func TestDecide(t *testing.T) {
	tests := []struct {
		name   string
		copies []Copy
		want   Step
	}{
		{"nobody holds it", nil, Step{Action: Keep}},
		{"own is newest", []Copy{{Node: "a", Version: 9}, {Node: "b", Version: 7}}, Step{Action: Keep, Version: 9}},
		{"own equals newest", []Copy{{Node: "a", Version: 9}, {Node: "b", Version: 9}}, Step{Action: Keep, Version: 9}},
		{"own is older", []Copy{{Node: "a", Version: 7}, {Node: "b", Version: 9}}, Step{Action: Pull, Source: "b", Version: 9}},
		{"own is missing", []Copy{{Node: "c", Version: 3}, {Node: "b", Version: 9}}, Step{Action: Pull, Source: "b", Version: 9}},
		{"ties go to the lower ID", []Copy{{Node: "c", Version: 9}, {Node: "b", Version: 9}}, Step{Action: Pull, Source: "b", Version: 9}},
		{"own is suspect", []Copy{{Node: "a", Version: 99, Suspect: true}, {Node: "b", Version: 9}}, Step{Action: Pull, Source: "b", Version: 9}},
		{"a suspect source is never chosen over a good one", []Copy{{Node: "c", Version: 99, Suspect: true}, {Node: "b", Version: 9}}, Step{Action: Pull, Source: "b", Version: 9}},
		{"removed meanwhile", []Copy{{Node: "a", Version: 7}, {Node: "b", Version: 9, Tombstone: true}}, Step{Action: PullTombstone, Source: "b", Version: 9}},
		{"rewritten after the removal", []Copy{{Node: "a", Version: 7, Tombstone: true}, {Node: "b", Version: 9}}, Step{Action: Pull, Source: "b", Version: 9}},
		{"own tombstone is newest", []Copy{{Node: "a", Version: 9, Tombstone: true}, {Node: "b", Version: 7}}, Step{Action: Keep, Version: 9}},
		{"all suspect, own chosen", []Copy{{Node: "a", Version: 9, Suspect: true}, {Node: "b", Version: 7, Suspect: true}}, Step{Action: Trust, Version: 9}},
		{"all suspect, other chosen", []Copy{{Node: "a", Version: 7, Suspect: true}, {Node: "b", Version: 9, Suspect: true}}, Step{Action: Pull, Source: "b", Version: 9, FromSuspect: true}},
		{"all suspect, own missing", []Copy{{Node: "c", Version: 9, Suspect: true}, {Node: "b", Version: 9, Suspect: true}}, Step{Action: Pull, Source: "b", Version: 9, FromSuspect: true}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := Decide("a", tt.copies); got != tt.want {
				t.Errorf("Decide(a, %+v) = %+v, want %+v", tt.copies, got, tt.want)
			}
		})
	}
}

func TestMayDrop(t *testing.T) {
	rec := map[string]uint64{"b": 5, "c": 4, "d": 6}
	tests := []struct {
		placed []string
		epoch  uint64
		want   bool
	}{
		{[]string{"b", "d"}, 5, true},
		{[]string{"b", "c"}, 5, false}, // c has not finished epoch 5
		{[]string{"a", "b"}, 5, false}, // still placed on a
		{nil, 5, false},
		{[]string{"e"}, 1, false}, // e never recovered anything
	}
	for _, tt := range tests {
		if got := MayDrop("a", tt.placed, tt.epoch, rec); got != tt.want {
			t.Errorf("MayDrop(a, %v, %d) = %v, want %v", tt.placed, tt.epoch, got, tt.want)
		}
	}
}

// copyOf is one node's copy in the model: a version and the write it
// holds (data), as the store would keep them.
type copyOf struct {
	version   uint64
	data      int // the acknowledged write it holds; 0 none
	suspect   bool
	tombstone bool
}

// bump is the store's version rule.
func bump(old, epoch uint64) uint64 {
	return max(old+1, epoch<<32|1)
}

// TestHistories drives one object through random histories of writes,
// removals, nodes leaving, returning and crashing, and epochs, with the
// recovery rule the node follows: a node placed for the object decides
// (Decide over the live nodes' copies) before it takes a write, and
// whenever the test says so. The property: once every placed node has
// recovered in the current epoch, each holds exactly the last
// acknowledged write (or its removal), as long as one live node held it.
func TestHistories(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		nodes := []string{"a", "b", "c", "d", "e"}
		live := map[string]bool{}
		for _, n := range nodes {
			live[n] = true
		}
		held := map[string]*copyOf{}
		epoch := uint64(1)
		truth, removed := 0, false
		next := 1
		place := func() []string {
			var l []string
			for _, n := range nodes {
				if live[n] {
					l = append(l, n)
				}
			}
			// A placement that changes with the epoch: 3 of the live
			// nodes, rotated.
			k := int(epoch) % len(l)
			l = append(l[k:], l[:k]...)
			return l[:min(3, len(l))]
		}
		copiesNow := func() []Copy {
			var cs []Copy
			for _, n := range nodes {
				if c := held[n]; live[n] && c != nil {
					cs = append(cs, Copy{Node: n, Version: c.version, Suspect: c.suspect, Tombstone: c.tombstone})
				}
			}
			return cs
		}
		recover := func(n string) {
			st := Decide(n, copiesNow())
			switch st.Action {
			case Pull:
				src := *held[st.Source]
				src.suspect = false
				held[n] = &src
			case PullTombstone:
				held[n] = &copyOf{version: st.Version, tombstone: true}
			case Trust:
				held[n].suspect = false
			}
		}
		survives := func() bool {
			for _, n := range nodes {
				if c := held[n]; live[n] && c != nil && !c.suspect && c.data == truth && c.tombstone == removed {
					return true
				}
			}
			return truth == 0
		}
		steps := rapid.IntRange(1, 60).Draw(t, "steps")
		for i := 0; i < steps; i++ {
			op := rapid.IntRange(0, 5).Draw(t, "op")
			switch op {
			case 0, 1: // a write (or a removal) to every placed node
				rm := rapid.IntRange(0, 4).Draw(t, "remove") == 0
				for _, n := range place() {
					recover(n)
					old := uint64(0)
					if c := held[n]; c != nil {
						old = c.version
					}
					c := &copyOf{version: bump(old, epoch), data: next, tombstone: rm}
					if rm {
						c.data = 0
					}
					held[n] = c
				}
				truth, removed = next, rm
				if rm {
					truth = 0
				}
				next++
			case 2: // a node leaves, if three would stay
				n := rapid.SampledFrom(nodes).Draw(t, "leave")
				cnt := 0
				for _, l := range live {
					if l {
						cnt++
					}
				}
				if live[n] && cnt > 3 {
					live[n] = false
					epoch++
				}
			case 3: // a node returns with whatever it held
				n := rapid.SampledFrom(nodes).Draw(t, "return")
				if !live[n] {
					live[n] = true
					epoch++
				}
			case 4: // a node crashes with unflushed writes and restarts
				n := rapid.SampledFrom(nodes).Draw(t, "crash")
				if c := held[n]; c != nil && live[n] && rapid.Bool().Draw(t, "torn") {
					c.suspect = true
				}
				epoch++
			case 5: // recovery runs on every placed node
				for _, n := range place() {
					recover(n)
				}
			}
			recovered := op == 5
			if !survives() {
				// More nodes away than the copies cover: the property
				// holds only while one live node has the last write.
				return
			}
			if !recovered {
				continue
			}
			for _, n := range place() {
				c := held[n]
				got := "none"
				if c != nil {
					got = fmt.Sprintf("data %d tombstone %v suspect %v v%x", c.data, c.tombstone, c.suspect, c.version)
				}
				if truth == 0 {
					if c != nil && !c.tombstone && c.data != 0 && !removed {
						t.Fatalf("step %d: node %s holds %s, want nothing", i, n, got)
					}
					if removed && (c == nil || !c.tombstone) {
						t.Fatalf("step %d: node %s holds %s, want the removal's tombstone", i, n, got)
					}
					continue
				}
				if c == nil || c.suspect || c.tombstone || c.data != truth {
					t.Fatalf("step %d: node %s (placed %v, epoch %d) holds %s, want data %d", i, n, place(), epoch, got, truth)
				}
			}
		}
	})
}
