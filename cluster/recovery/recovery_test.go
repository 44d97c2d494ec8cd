package recovery

import (
	"fmt"
	"slices"
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
		{"nobody of the best rank holds it: a cut-off writer's copy goes", []Copy{{Node: "a", Version: 4<<32 | 1, Rank: 4}, {Node: "b", Absent: true, Rank: 5}}, Step{Action: Drop, Version: 4<<32 | 1}},
		{"an absent node of a lower rank says nothing", []Copy{{Node: "a", Version: 4<<32 | 1, Rank: 4}, {Node: "b", Absent: true, Rank: 3}}, Step{Action: Keep, Version: 4<<32 | 1}},
		{"an absent node of the same rank says nothing", []Copy{{Node: "a", Absent: true, Rank: 4}, {Node: "b", Version: 4<<32 | 1, Rank: 4}}, Step{Action: Pull, Source: "b", Version: 4<<32 | 1}},
		{"absent and so is the best", []Copy{{Node: "a", Absent: true, Rank: 2}, {Node: "b", Absent: true, Rank: 5}}, Step{Action: Keep}},
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
		// A cut-off writer's copy (rank 4) has the higher version; the
		// copies of the nodes that went on (rank 5) win.
		{"cut-off own copy loses to a higher rank", []Copy{{Node: "a", Version: 4<<32 | 3, Rank: 4}, {Node: "b", Version: 4<<32 | 2, Rank: 5}}, Step{Action: Pull, Source: "b", Version: 4<<32 | 2, Replace: true}},
		{"cut-off other copy is not chosen", []Copy{{Node: "a", Version: 4<<32 | 2, Rank: 5}, {Node: "c", Version: 4<<32 | 3, Rank: 4}}, Step{Action: Keep, Version: 4<<32 | 2}},
		{"cut-off own tombstone loses to the data", []Copy{{Node: "a", Version: 4<<32 | 3, Rank: 4, Tombstone: true}, {Node: "b", Version: 4<<32 | 2, Rank: 5}}, Step{Action: Pull, Source: "b", Version: 4<<32 | 2, Replace: true}},
		{"cut-off own data loses to a tombstone", []Copy{{Node: "a", Version: 4<<32 | 3, Rank: 4}, {Node: "b", Version: 4<<32 | 2, Rank: 5, Tombstone: true}}, Step{Action: PullTombstone, Source: "b", Version: 4<<32 | 2, Replace: true}},
		{"a newer write wins over a higher rank's older one only by rank", []Copy{{Node: "a", Version: 3<<32 | 1, Rank: 6}, {Node: "b", Version: 6<<32 | 1, Rank: 6}}, Step{Action: Pull, Source: "b", Version: 6<<32 | 1}},
		{"a suspect copy of a higher rank wins over a good stale one", []Copy{{Node: "a", Version: 3<<32 | 1, Rank: 3}, {Node: "b", Version: 6<<32 | 4, Rank: 6, Suspect: true}}, Step{Action: Pull, Source: "b", Version: 6<<32 | 4, FromSuspect: true}},
		{"own suspect copy of the best rank is trusted", []Copy{{Node: "a", Version: 6<<32 | 4, Rank: 6, Suspect: true}, {Node: "b", Version: 3<<32 | 1, Rank: 3}}, Step{Action: Trust, Version: 6<<32 | 4}},
		{"within a rank a good copy beats a suspect one", []Copy{{Node: "a", Version: 6<<32 | 9, Rank: 6, Suspect: true}, {Node: "b", Version: 6<<32 | 4, Rank: 6}}, Step{Action: Pull, Source: "b", Version: 6<<32 | 4}},
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

func TestTombstoneFloor(t *testing.T) {
	tests := []struct {
		rec, clean map[string]uint64
		want       uint64
	}{
		{map[string]uint64{"a": 5, "b": 6}, map[string]uint64{"a": 4, "b": 6}, 4},
		{map[string]uint64{"a": 5, "b": 6}, map[string]uint64{"a": 4}, 0},    // b never clean: nothing goes
		{map[string]uint64{"a": 5}, map[string]uint64{"a": 5, "gone": 1}, 5}, // a node that never recovered counts not
		{map[string]uint64{}, map[string]uint64{}, 1<<64 - 1},
	}
	for _, tt := range tests {
		if got := TombstoneFloor(tt.rec, tt.clean); got != tt.want {
			t.Errorf("TombstoneFloor(%v, %v) = %d, want %d", tt.rec, tt.clean, got, tt.want)
		}
	}
}

// copyOf is one node's copy in the model: a version and the write it
// holds (data), as the store would keep them.
type copyOf struct {
	version   uint64
	data      int // the write it holds; 0 none, negative one never acknowledged
	suspect   bool
	tombstone bool
}

// bump is the store's version rule.
func bump(old, epoch uint64) uint64 {
	return max(old+1, epoch<<32|1)
}

// TestHistories drives one object through random histories of writes,
// removals, nodes leaving, returning and crashing, nodes cut off while
// their gateway writes, and epochs, with the rules the node follows: a
// node placed for the object decides (Decide over the live nodes' copies,
// ranked as cluster/node ranks them) before it takes a write, and
// whenever the test says so. The property: once every placed node has
// recovered in the current epoch, each holds exactly the last
// acknowledged write (or its removal), as long as one live node held it;
// a cut-off writer's unacknowledged write never comes back.
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
		// rec is each node's last epoch of a completed run; hist the
		// placement of every epoch; cut the nodes that left cut off, with
		// the epoch of the run that must complete before they return.
		rec := map[string]uint64{}
		hist := map[uint64][]string{}
		cut := map[string]uint64{}
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
		placedAt := func(e uint64, n string) bool { return slices.Contains(hist[e], n) }
		// rank is cluster/node's: the copy's version epoch, or the end
		// of the unbroken run of placed epochs from the node's last
		// completed run (or from its copy's epoch).
		rank := func(n string, c *copyOf) uint64 {
			r := c.version >> 32
			for _, from := range []uint64{rec[n], c.version >> 32} {
				if from == 0 || !placedAt(from, n) {
					continue
				}
				e := from
				for e < epoch && placedAt(e+1, n) {
					e++
				}
				r = max(r, e)
			}
			return r
		}
		copiesNow := func() []Copy {
			var cs []Copy
			for _, n := range nodes {
				switch c := held[n]; {
				case !live[n]:
				case c != nil:
					cs = append(cs, Copy{Node: n, Version: c.version, Suspect: c.suspect, Tombstone: c.tombstone, Rank: rank(n, c)})
				default:
					cs = append(cs, Copy{Node: n, Absent: true, Rank: rank(n, &copyOf{})})
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
			case Drop:
				delete(held, n)
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
		liveCount := func() int {
			cnt := 0
			for _, l := range live {
				if l {
					cnt++
				}
			}
			return cnt
		}
		steps := rapid.IntRange(1, 60).Draw(t, "steps")
		for i := 0; i < steps; i++ {
			hist[epoch] = place()
			op := rapid.IntRange(0, 6).Draw(t, "op")
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
				if live[n] && liveCount() > 3 {
					live[n] = false
					epoch++
				}
			case 3: // a node returns with whatever it held
				n := rapid.SampledFrom(nodes).Draw(t, "return")
				// A node cut off is away a lease's time at least: the
				// others' run of the epoch without it completes first.
				if e, ok := cut[n]; ok && rec[place()[0]] < e {
					break
				}
				if !live[n] {
					live[n] = true
					delete(cut, n)
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
					rec[n] = epoch
				}
			case 6: // a placed node is cut off while its gateway writes
				p := rapid.SampledFrom(place()).Draw(t, "cut")
				if liveCount() <= 3 {
					break
				}
				recover(p)
				old := uint64(0)
				if c := held[p]; c != nil {
					old = c.version
				}
				// Applied to its own copy only, never acknowledged.
				held[p] = &copyOf{version: bump(old, epoch), data: -next}
				next++
				live[p] = false
				epoch++
				cut[p] = epoch
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
