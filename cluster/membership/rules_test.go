package membership

import (
	"cmp"
	"slices"
	"testing"
	"time"

	"pgregory.net/rapid"
)

func nodes(ids ...string) []NodeInfo {
	var ns []NodeInfo
	for _, id := range ids {
		ns = append(ns, NodeInfo{ID: id, Addr: id + ":7000", Weight: 1})
	}
	return ns
}

func TestNextEpoch(t *testing.T) {
	now := time.Unix(1000, 0)
	moved := nodes("a", "b")
	moved[1].Addr = "elsewhere:7000"
	tests := []struct {
		name   string
		cur    View
		ok     bool
		live   []NodeInfo
		want   View
		wantOK bool
	}{
		{"first join", View{}, false, nodes("a"), View{Epoch: 1, Nodes: nodes("a"), Created: now}, true},
		{"no live node, no epoch", View{}, false, nil, View{}, false},
		{"everyone gone keeps the last", View{Epoch: 3, Nodes: nodes("a")}, true, nil, View{}, false},
		{"same set", View{Epoch: 3, Nodes: nodes("a", "b")}, true, nodes("b", "a"), View{}, false},
		{"join", View{Epoch: 3, Nodes: nodes("a")}, true, nodes("b", "a"), View{Epoch: 4, Nodes: nodes("a", "b"), Created: now}, true},
		{"leave", View{Epoch: 3, Nodes: nodes("a", "b")}, true, nodes("b"), View{Epoch: 4, Nodes: nodes("b"), Created: now}, true},
		{"rejoin at a new address", View{Epoch: 7, Nodes: nodes("a", "b")}, true, moved, View{Epoch: 8, Nodes: moved, Created: now}, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			live := slices.Clone(tt.live)
			got, ok := nextEpoch(tt.cur, tt.ok, tt.live, now)
			if ok != tt.wantOK {
				t.Fatalf("ok = %v, want %v", ok, tt.wantOK)
			}
			if ok && (got.Epoch != tt.want.Epoch || !slices.Equal(got.Nodes, tt.want.Nodes) || !got.Created.Equal(now)) {
				t.Fatalf("next = %+v, want %+v", got, tt.want)
			}
			if !slices.Equal(live, tt.live) {
				t.Fatalf("nextEpoch changed its input: %v", tt.live)
			}
		})
	}
}

// TestNextEpochModel runs random membership changes through the rule and
// checks it against the model: one epoch per change of the live set,
// none otherwise, and every epoch lists the live set sorted.
func TestNextEpochModel(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		ids := []string{"a", "b", "c", "d", "e"}
		live := map[string]bool{}
		var cur View
		ok := false
		changes := 0
		for step := range rapid.IntRange(1, 40).Draw(t, "steps") {
			id := rapid.SampledFrom(ids).Draw(t, "id")
			if rapid.Bool().Draw(t, "toggle") {
				live[id] = !live[id]
			}
			var ls []NodeInfo
			for _, i := range rapid.Permutation(ids).Draw(t, "order") {
				if live[i] {
					ls = append(ls, nodes(i)...)
				}
			}
			// The model: a new epoch iff the set differs from the last
			// recorded one and is not empty.
			want := len(ls) > 0 && (!ok || !sameIDs(cur.Nodes, ls))
			next, bump := nextEpoch(cur, ok, ls, time.Unix(int64(step), 0))
			if bump != want {
				t.Fatalf("step %d: live %v, cur %+v: bump = %v, want %v", step, ls, cur, bump, want)
			}
			if bump {
				if next.Epoch != cur.Epoch+1 {
					t.Fatalf("epoch %d after %d", next.Epoch, cur.Epoch)
				}
				if !slices.IsSortedFunc(next.Nodes, func(a, b NodeInfo) int { return cmp.Compare(a.ID, b.ID) }) || !sameIDs(next.Nodes, ls) {
					t.Fatalf("epoch lists %v, live %v", next.Nodes, ls)
				}
				cur, ok = next, true
				changes++
			}
		}
		if cur.Epoch != uint64(changes) {
			t.Fatalf("epoch %d after %d changes", cur.Epoch, changes)
		}
	})
}

func sameIDs(a, b []NodeInfo) bool {
	ia, ib := map[string]bool{}, map[string]bool{}
	for _, n := range a {
		ia[n.ID] = true
	}
	for _, n := range b {
		ib[n.ID] = true
	}
	if len(ia) != len(ib) {
		return false
	}
	for id := range ia {
		if !ib[id] {
			return false
		}
	}
	return true
}

func TestZones(t *testing.T) {
	mk := func(zones ...uint32) View {
		var v View
		for i, z := range zones {
			v.Nodes = append(v.Nodes, NodeInfo{ID: string(rune('a' + i)), Zone: z})
		}
		return v
	}
	tests := []struct {
		v    View
		want int
	}{
		{View{}, 0},
		{mk(0, 0, 0), 3},
		{mk(1, 1, 1), 1},
		{mk(1, 2, 1, 3), 3},
		{mk(0, 1, 1), 2},
	}
	for _, tt := range tests {
		if got := tt.v.Zones(); got != tt.want {
			t.Errorf("Zones(%v) = %d, want %d", tt.v.Nodes, got, tt.want)
		}
	}
}

func TestFenceDeadline(t *testing.T) {
	t0 := time.Unix(5000, 0)
	for _, ttl := range []time.Duration{2 * time.Second, 5 * time.Second, 60 * time.Second} {
		d := fenceDeadline(t0, ttl)
		if !d.Before(t0.Add(ttl)) {
			t.Errorf("ttl %v: deadline %v is not before the lease's own expiry %v", ttl, d, t0.Add(ttl))
		}
		// The keepalive loop renews every ttl/3: two renewals must fit
		// before the deadline, so one lost renewal does not fence.
		if !t0.Add(2 * ttl / 3).Before(d) {
			t.Errorf("ttl %v: deadline %v leaves no room for a second renewal", ttl, d.Sub(t0))
		}
	}
}

func TestCompactTarget(t *testing.T) {
	tests := []struct {
		rev, keep, done int64
		want            int64
		ok              bool
	}{
		{rev: 50, keep: 100, done: 0},
		{rev: 100, keep: 100, done: 0},
		{rev: 101, keep: 100, done: 0, want: 1, ok: true},
		{rev: 1000, keep: 100, done: 0, want: 900, ok: true},
		{rev: 1000, keep: 100, done: 900},
		{rev: 1000, keep: 100, done: 950},
		{rev: 1001, keep: 100, done: 900, want: 901, ok: true},
	}
	for _, tt := range tests {
		got, ok := compactTarget(tt.rev, tt.keep, tt.done)
		if got != tt.want || ok != tt.ok {
			t.Errorf("compactTarget(%d, %d, %d) = %d, %v; want %d, %v", tt.rev, tt.keep, tt.done, got, ok, tt.want, tt.ok)
		}
	}
}
