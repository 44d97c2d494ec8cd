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
		{"own is missing", []Copy{{Node: "c", Version: 9}, {Node: "b", Version: 9}}, Step{Action: Pull, Source: "b", Version: 9}},
		// Another copy of the source's rank lacks its version: the
		// write was never acknowledged, and that copy may be served.
		{"a copy of the best rank lacks the version: hidden", []Copy{{Node: "c", Version: 5<<32 | 1, Rank: 5}, {Node: "b", Version: 5<<32 | 2, Rank: 5}}, Step{Action: Pull, Source: "b", Version: 5<<32 | 2, Hide: true}},
		{"a copy of the best rank holds nothing: hidden", []Copy{{Node: "c", Absent: true, Rank: 5}, {Node: "b", Version: 5<<32 | 2, Rank: 5}}, Step{Action: Pull, Source: "b", Version: 5<<32 | 2, Hide: true}},
		{"a copy of the best rank holds nothing, the best a tombstone: not hidden", []Copy{{Node: "c", Absent: true, Rank: 5}, {Node: "b", Version: 5<<32 | 2, Rank: 5, Tombstone: true}}, Step{Action: PullTombstone, Source: "b", Version: 5<<32 | 2}},
		{"a copy of the best rank holds data, the best a tombstone: hidden", []Copy{{Node: "c", Version: 5<<32 | 1, Rank: 5}, {Node: "b", Version: 5<<32 | 2, Rank: 5, Tombstone: true}}, Step{Action: PullTombstone, Source: "b", Version: 5<<32 | 2, Hide: true}},
		{"a copy of a lower rank lacks the version: not hidden (it is not served before it recovers)", []Copy{{Node: "c", Version: 3<<32 | 1, Rank: 4}, {Node: "b", Version: 5<<32 | 2, Rank: 5}}, Step{Action: Pull, Source: "b", Version: 5<<32 | 2}},
		{"a suspect copy of the best rank lacks the version: not hidden (it is repaired before it is served)", []Copy{{Node: "c", Version: 5<<32 | 1, Rank: 5, Suspect: true}, {Node: "b", Version: 5<<32 | 2, Rank: 5}}, Step{Action: Pull, Source: "b", Version: 5<<32 | 2}},
		{"every other copy has the version: not hidden", []Copy{{Node: "c", Version: 5<<32 | 2, Rank: 5}, {Node: "b", Version: 5<<32 | 2, Rank: 5}, {Node: "a", Version: 5<<32 | 1, Rank: 4}}, Step{Action: Pull, Source: "b", Version: 5<<32 | 2}},
		{"own is live: a higher version of its epoch lacks its writes in flight, kept", []Copy{{Node: "a", Version: 5<<32 | 3, Rank: 5, Live: true}, {Node: "b", Version: 5<<32 | 4, Rank: 5, Live: true}}, Step{Action: Keep, Version: 5<<32 | 3}},
		{"own is live and the other copy holds nothing: kept", []Copy{{Node: "a", Version: 5<<32 | 1, Rank: 5, Live: true}, {Node: "b", Absent: true, Rank: 5}}, Step{Action: Keep, Version: 5<<32 | 1}},
		{"own is live but suspect: pulled", []Copy{{Node: "a", Version: 5<<32 | 3, Rank: 5, Live: true, Suspect: true}, {Node: "b", Version: 5<<32 | 4, Rank: 5}}, Step{Action: Pull, Source: "b", Version: 5<<32 | 4}},
		{"another copy is live, own took no write of the epoch: pulled", []Copy{{Node: "a", Version: 4<<32 | 3, Rank: 5}, {Node: "b", Version: 5<<32 | 1, Rank: 5, Live: true}}, Step{Action: Pull, Source: "b", Version: 5<<32 | 1}},
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
		// Each replica counts its own writes: the cut-off copy's version
		// can equal the others' with other bytes (TestHistories found it).
		{"own copy at the same version of a lower rank: pulled if its bytes differ", []Copy{{Node: "a", Version: 4<<32 | 3, Rank: 4}, {Node: "b", Version: 4<<32 | 3, Rank: 5}}, Step{Action: Pull, Source: "b", Version: 4<<32 | 3, Replace: true, Verify: true}},
		{"own copy at the same version of a lower rank, another of the best rank lacks it: compared, and hidden", []Copy{{Node: "a", Version: 4<<32 | 3, Rank: 4}, {Node: "b", Version: 4<<32 | 3, Rank: 5}, {Node: "c", Version: 4<<32 | 2, Rank: 5}}, Step{Action: Pull, Source: "b", Version: 4<<32 | 3, Replace: true, Verify: true, Hide: true}},
		{"own tombstone at the same version of a lower rank: kept", []Copy{{Node: "a", Version: 4<<32 | 3, Rank: 4, Tombstone: true}, {Node: "b", Version: 4<<32 | 3, Rank: 5, Tombstone: true}}, Step{Action: Keep, Version: 4<<32 | 3}},
		{"own data at a tombstone's version of a higher rank: replaced, nothing to compare", []Copy{{Node: "a", Version: 4<<32 | 3, Rank: 4}, {Node: "b", Version: 4<<32 | 3, Rank: 5, Tombstone: true}}, Step{Action: PullTombstone, Source: "b", Version: 4<<32 | 3, Replace: true}},
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

// state is what a read of a copy gives: the data of a write, 0 for
// nothing or a removal.
func (c *copyOf) state() int {
	if c == nil || c.tombstone {
		return 0
	}
	return c.data
}

// TestHistories drives one object through random histories of writes,
// reads, removals, nodes leaving (every holder at once included),
// returning in any order and crashing, nodes cut off while their gateway
// writes, and epochs, with the rules the node follows: a node placed for
// the object decides (Unfound, then Decide over the live nodes' copies,
// ranked as cluster/node ranks them) before it serves a read or takes a
// write, and whenever the test says so; an object Unfound names is not
// served, and the node's run is not recorded. The properties:
//   - no read returns anything but the last acknowledged write or one
//     made after it that failed (an indeterminate write);
//   - once every node is back and recovery ran, each placed node holds
//     exactly that; an acknowledged write is never lost, whatever was
//     away for however long;
//   - a cut-off writer's unacknowledged write never comes back (unless
//     it returned before the others could recover: see the final phase).
func TestHistories(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		nodes := []string{"a", "b", "c", "d", "e"}
		live := map[string]bool{}
		for _, n := range nodes {
			live[n] = true
		}
		held := map[string]*copyOf{}
		epoch := uint64(1)
		truth := 0 // the last acknowledged write's data (0: none, or removed)
		next := 1
		// maybe holds the data of the writes that failed after the last
		// acknowledged one, having reached some copies: any of them may
		// be what the object ends up holding.
		maybe := map[int]bool{}
		cutBack := false // a cut-off writer returned before the others recovered
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
		newEpoch := func() {
			epoch++
			hist[epoch] = place()
		}
		hist[epoch] = place()
		placedAt := func(e uint64, n string) bool { return slices.Contains(hist[e], n) }
		// copiesNow ranks the live nodes' copies as cluster/node does
		// (Ranked over Rank), with the VDI made in epoch 1.
		copiesNow := func() []Copy {
			var cs []Copy
			var ids []string
			for _, n := range nodes {
				if !live[n] {
					continue
				}
				ids = append(ids, n)
				if c := held[n]; c != nil {
					cs = append(cs, Copy{Node: n, Version: c.version, Suspect: c.suspect, Tombstone: c.tombstone})
				}
			}
			cs, err := Ranked(cs, ids, epoch, func(n string, version uint64) (uint64, error) {
				return Rank(version, rec[n], 1, epoch, func(e uint64) (bool, bool, error) {
					return placedAt(e, n), true, nil
				})
			})
			if err != nil {
				t.Fatal(err)
			}
			return cs
		}
		unfound := func() []string {
			cs := copiesNow()
			away, err := Unfound(cs, func(n string) bool { return live[n] }, 1, epoch, func(e uint64) (Placement, error) {
				return Placement{Nodes: hist[e], Exact: true}, nil
			})
			if err != nil {
				t.Fatal(err)
			}
			return away
		}
		// recover makes n's copy current, as the node does before it
		// serves the object; false when the object is unavailable.
		recover := func(n string) bool {
			if unfound() != nil {
				return false
			}
			st := Decide(n, copiesNow())
			switch st.Action {
			case Pull:
				if st.Verify && held[n].data == held[st.Source].data {
					break // the same bytes: kept, as the node's checksums find
				}
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
			return true
		}
		ok := func(data int) bool {
			return data == truth || maybe[data] || (cutBack && data < 0)
		}
		describe := func(n string) string {
			c := held[n]
			if c == nil {
				return "none"
			}
			return fmt.Sprintf("data %d tombstone %v suspect %v v%x", c.data, c.tombstone, c.suspect, c.version)
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
		// runAll is a recovery run on every placed node: it completes
		// (and is recorded) where the object is not unfound.
		runAll := func(step int) {
			for _, n := range place() {
				if !recover(n) {
					continue
				}
				rec[n] = epoch
				if c := held[n]; (c != nil && c.suspect) || !ok(c.state()) {
					t.Fatalf("step %d: node %s (placed %v, epoch %d) recovered and holds %s, want data %d (or one of %v)", step, n, place(), epoch, describe(n), truth, maybe)
				}
			}
		}
		// comeBack brings node n back, as a node returns with whatever
		// it held.
		comeBack := func(n string) {
			live[n] = true
			delete(cut, n)
			newEpoch()
		}
		steps := rapid.IntRange(1, 80).Draw(t, "steps")
		for i := 0; i < steps; i++ {
			op := rapid.IntRange(0, 7).Draw(t, "op")
			switch op {
			case 0, 1: // a write (or a removal) through every placed node
				rm := rapid.IntRange(0, 4).Draw(t, "remove") == 0
				data := next
				if rm {
					data = 0
				}
				applied, failed := 0, 0
				for _, n := range place() {
					if !recover(n) {
						failed++ // refused: the object is unavailable there
						continue
					}
					old := uint64(0)
					if c := held[n]; c != nil {
						old = c.version
					}
					held[n] = &copyOf{version: bump(old, epoch), data: data, tombstone: rm}
					applied++
				}
				switch {
				case failed == 0:
					truth = data
					maybe = map[int]bool{}
				case applied > 0:
					maybe[data] = true // failed, but reached some copies
				}
				next++
			case 2: // a node leaves; every node but one may go
				n := rapid.SampledFrom(nodes).Draw(t, "leave")
				if live[n] && liveCount() > 1 {
					live[n] = false
					newEpoch()
				}
			case 3: // a node returns with whatever it held
				n := rapid.SampledFrom(nodes).Draw(t, "return")
				// A node cut off is away a lease's time at least: the
				// others' run of the epoch without it completes first.
				if e, isCut := cut[n]; isCut && rec[place()[0]] < e {
					break
				}
				if !live[n] {
					comeBack(n)
				}
			case 4: // a node crashes with unflushed writes and restarts
				n := rapid.SampledFrom(nodes).Draw(t, "crash")
				if c := held[n]; c != nil && live[n] && rapid.Bool().Draw(t, "torn") {
					c.suspect = true
				}
				newEpoch()
			case 5: // recovery runs on every placed node
				runAll(i)
			case 6: // a placed node is cut off while its gateway writes
				p := rapid.SampledFrom(place()).Draw(t, "cut")
				if liveCount() <= 3 || !recover(p) {
					break
				}
				old := uint64(0)
				if c := held[p]; c != nil {
					old = c.version
				}
				// Applied to its own copy only, never acknowledged.
				held[p] = &copyOf{version: bump(old, epoch), data: -next}
				next++
				live[p] = false
				newEpoch()
				cut[p] = epoch
			case 7: // a read through one placed node
				n := rapid.SampledFrom(place()).Draw(t, "read")
				if recover(n) && !ok(held[n].state()) {
					t.Fatalf("step %d: a read through node %s (placed %v, epoch %d) returns %s, want data %d (or one of %v)", i, n, place(), epoch, describe(n), truth, maybe)
				}
			}
		}
		// Every node comes back, in any order, with recovery between:
		// cut-off writers last, once the others recovered if they can.
		for {
			var away []string
			for _, n := range nodes {
				if !live[n] {
					away = append(away, n)
				}
			}
			if len(away) == 0 {
				break
			}
			slices.SortStableFunc(away, func(a, b string) int {
				_, ca := cut[a]
				_, cb := cut[b]
				switch {
				case ca == cb:
					return 0
				case ca:
					return 1
				}
				return -1
			})
			k := 0
			if _, isCut := cut[away[0]]; !isCut {
				k = rapid.IntRange(0, len(away)-1).Draw(t, "back")
				if _, isCut := cut[away[k]]; isCut {
					k = 0
				}
			}
			n := away[k]
			if e, isCut := cut[n]; isCut && rec[place()[0]] < e {
				// The others could not recover (the object was
				// unavailable to them): the writer's unacknowledged
				// write is then an indeterminate one, which may win.
				cutBack = true
			}
			comeBack(n)
			runAll(steps)
		}
		runAll(steps)
		runAll(steps)
		for _, n := range place() {
			if away := unfound(); away != nil {
				t.Fatalf("every node is back, yet the object is unfound on %v", away)
			}
			if c := held[n]; rec[n] != epoch || (c != nil && c.suspect) || !ok(c.state()) {
				t.Fatalf("the end: node %s (placed %v, epoch %d, recovered %d) holds %s, want data %d (or one of %v)", n, place(), epoch, rec[n], describe(n), truth, maybe)
			}
		}
	})
}

func TestUnfound(t *testing.T) {
	// The object's placement: epochs 1-3 on a b c, 4 on a d e (a, b and c
	// went; d and e came), 5 on d e f.
	hist := map[uint64][]string{1: {"a", "b", "c"}, 2: {"a", "b", "c"}, 3: {"a", "b", "c"}, 4: {"a", "d", "e"}, 5: {"d", "e", "f"}}
	exact := func(e uint64) (Placement, error) { return Placement{Nodes: hist[e], Exact: true}, nil }
	members := map[uint64][]string{3: {"a", "b", "c", "d"}}
	fuzzy := func(e uint64) (Placement, error) {
		if m, ok := members[e]; ok {
			return Placement{Nodes: m}, nil
		}
		return exact(e)
	}
	tests := []struct {
		name     string
		copies   []Copy
		answered []string
		from     uint64
		placed   func(uint64) (Placement, error)
		want     []string
	}{
		{"everybody answered", nil, []string{"a", "b", "c", "d", "e", "f"}, 1, exact, nil},
		// Issue 26: a, b and c, every holder of epochs 1-3, are away; d
		// holds nothing and knows nothing of the object before epoch 4.
		{"every holder of epochs 1-3 away: absence says nothing", []Copy{{Node: "d", Absent: true}}, []string{"d", "e", "f"}, 1, exact, []string{"a", "b", "c"}},
		{"a copy of a lower rank does not cover the epochs after it", []Copy{{Node: "f", Version: 1 << 32, Rank: 1}}, []string{"f"}, 1, exact, []string{"a", "b", "c", "d", "e"}},
		{"a rank of 3 and a node of epoch 4 answering settle it", []Copy{{Node: "d", Absent: true, Rank: 3}}, []string{"d", "e", "f"}, 1, exact, nil},
		{"one holder of each epoch answered", []Copy{{Node: "c", Version: 3 << 32, Rank: 3}}, []string{"c", "d", "f"}, 1, exact, nil},
		{"a rank covers the epochs nobody answers for", []Copy{{Node: "d", Version: 5 << 32, Rank: 5}}, []string{"d"}, 1, exact, nil},
		{"epochs before the VDI's creation do not count", nil, []string{"d", "f"}, 4, exact, nil},
		{"a kept node of epoch 4 answered, epoch 1-3's did not", nil, []string{"a", "d", "f"}, 1, exact, nil},
		{"epoch 4 lost everybody but a, who is away", []Copy{{Node: "b", Version: 2 << 32, Rank: 3}}, []string{"b", "f"}, 1, exact, []string{"a", "d", "e"}},
		{"an epoch of unknown copies needs every member", []Copy{{Node: "a", Version: 2 << 32, Rank: 2}}, []string{"a", "b", "c", "d", "e", "f"}, 1, fuzzy, nil},
		{"an epoch of unknown copies with a member away", []Copy{{Node: "a", Version: 2 << 32, Rank: 2}}, []string{"a", "b", "c", "e", "f"}, 1, fuzzy, []string{"d"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := Unfound(tt.copies, func(n string) bool { return slices.Contains(tt.answered, n) }, tt.from, 5, tt.placed)
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(got, tt.want) {
				t.Errorf("Unfound = %v, want %v", got, tt.want)
			}
		})
	}
	// An error from placed is returned.
	boom := fmt.Errorf("no epoch")
	if _, err := Unfound(nil, func(string) bool { return false }, 1, 2, func(uint64) (Placement, error) { return Placement{}, boom }); err != boom {
		t.Errorf("Unfound with a failing placement: err %v, want %v", err, boom)
	}
}

// TestRank: a copy's rank is the end of the unbroken run of placed
// epochs from its node's last completed run, the VDI's creation or its
// version's epoch; an epoch whose placement is no longer known ends a
// run; never below the version's epoch.
func TestRank(t *testing.T) {
	// The node is placed in epochs 2-4 and 6-9; epoch 8's placement is
	// no longer known.
	placed := func(e uint64) (bool, bool, error) {
		return e >= 2 && e <= 4 || e >= 6 && e <= 9, e != 8, nil
	}
	for _, tc := range []struct {
		name                              string
		version, recovered, created, upTo uint64
		want                              uint64
	}{
		{"from its last run to the gap", 0, 2, 1, 9, 4},
		{"from the VDI's creation", 0, 0, 3, 9, 4},
		{"from its version's epoch to the unknown epoch", 6 << 32, 0, 1, 9, 7},
		{"the version's epoch, though not placed in it", 5<<32 | 3, 0, 1, 9, 5},
		{"not placed where the run would start", 0, 5, 1, 9, 0},
		{"a run from after upTo says nothing", 0, 10, 1, 9, 0},
		{"nothing known", 0, 0, 0, 9, 0},
		{"the best of both runs", 6 << 32, 2, 1, 7, 7},
	} {
		got, err := Rank(tc.version, tc.recovered, tc.created, tc.upTo, placed)
		if err != nil || got != tc.want {
			t.Errorf("%s: Rank = %d, %v; want %d", tc.name, got, err, tc.want)
		}
	}
}
