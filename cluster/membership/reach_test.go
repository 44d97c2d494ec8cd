package membership

import (
	"errors"
	"fmt"
	"slices"
	"testing"
	"time"

	"pgregory.net/rapid"
)

func TestLeavers(t *testing.T) {
	for _, c := range []struct {
		name    string
		nodes   []string
		reports map[string][]string
		want    []string
	}{
		{"no reports", []string{"a", "b", "c"}, nil, nil},
		{"one node cut off, reported by all and reporting all", []string{"a", "b", "c", "d"},
			map[string][]string{"a": {"c"}, "b": {"c"}, "d": {"c"}, "c": {"a", "b", "d"}}, []string{"c"}},
		{"one node cut off, only the others report: it is silent, and goes with its lease", []string{"a", "b", "c", "d"},
			map[string][]string{"a": {"b"}, "c": {"b"}, "d": {"b"}}, nil},
		{"a node cut off that saw it first: its peers, which report nobody yet, stay", []string{"a", "b", "c", "d"},
			map[string][]string{"a": {"b", "c", "d"}}, nil},
		{"a node cut off that one peer reported so far leaves, whatever its ID", []string{"a", "b", "c", "d"},
			map[string][]string{"a": {"b", "c", "d"}, "d": {"a"}}, []string{"a"}},
		{"one cut link costs its greater end", []string{"a", "b", "c"}, map[string][]string{"a": {"b"}, "b": {"a"}}, []string{"b"}},
		{"one cut link seen by one end so far: nobody leaves yet", []string{"a", "b", "c"}, map[string][]string{"a": {"b"}}, nil},
		{"two equal halves: the half with the smallest ID stays", []string{"a", "b", "c", "d"},
			map[string][]string{"a": {"c", "d"}, "b": {"c", "d"}, "c": {"a", "b"}, "d": {"a", "b"}}, []string{"c", "d"}},
		{"a report of or by a node outside the epoch does not count", []string{"a", "b"},
			map[string][]string{"a": {"x"}, "x": {"b"}}, nil},
		{"a node reporting itself does not count", []string{"a", "b"}, map[string][]string{"a": {"a"}}, nil},
		{"a dead node (reported, reporting nobody) makes nobody leave", []string{"a", "b"},
			map[string][]string{"b": {"a"}}, nil},
		{"a dead node and a cut link", []string{"a", "b", "c", "d"},
			map[string][]string{"a": {"d", "b"}, "b": {"d", "a"}, "c": {"d"}}, []string{"b"}},
		{"a one-way report between two nodes that report others is a cut link", []string{"a", "b", "c"},
			map[string][]string{"a": {"b"}, "b": {"c"}, "c": {"b"}}, []string{"b"}},
	} {
		if got := Leavers(c.nodes, c.reports); !slices.Equal(got, c.want) {
			t.Errorf("%s: leavers %v, want %v", c.name, got, c.want)
		}
	}
}

// TestLeaversRandom: whatever the reports, no cut link is left between
// two nodes that stay and both report someone, each leaver reports a
// peer itself (a node that misses nobody never leaves), a silent node
// (reports nobody) never makes a reporter of it leave, and the answer
// does not depend on the order the reports are read in.
func TestLeaversRandom(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		n := rapid.IntRange(1, 8).Draw(t, "nodes")
		var nodes []string
		for i := range n {
			nodes = append(nodes, fmt.Sprintf("n%d", i))
		}
		reports := map[string][]string{}
		for i := range rapid.IntRange(0, 12).Draw(t, "reports") {
			from := rapid.SampledFrom(nodes).Draw(t, fmt.Sprintf("from%d", i))
			to := rapid.SampledFrom(nodes).Draw(t, fmt.Sprintf("to%d", i))
			reports[from] = append(reports[from], to)
		}
		out := Leavers(nodes, reports)
		leaves := map[string]bool{}
		for _, l := range out {
			leaves[l] = true
		}
		linked := map[string]bool{}
		for from, tos := range reports {
			for _, to := range tos {
				if from == to {
					continue
				}
				linked[from], linked[to] = true, true
				if !leaves[from] && !leaves[to] && reportsPeer(reports, to) {
					t.Fatalf("%s and %s both stay with a cut link between them: leavers %v of %v", from, to, out, reports)
				}
			}
		}
		for _, l := range out {
			if !linked[l] {
				t.Fatalf("%s leaves on no cut link: %v of %v", l, out, reports)
			}
			if !reportsPeer(reports, l) {
				t.Fatalf("%s leaves though it reports no peer: %v of %v", l, out, reports)
			}
		}
		// A node that reports nobody and that nobody reports stays.
		for _, nd := range nodes {
			if leaves[nd] && !linked[nd] {
				t.Fatalf("%s leaves untouched by any report", nd)
			}
		}
		// A reporter whose targets all report nobody (they are dead) stays.
		for from, tos := range reports {
			dead := true
			for _, to := range tos {
				if to == from || len(reports[to]) > 0 {
					dead = false
				}
			}
			reportedBy := false
			for f2, t2 := range reports {
				if f2 != from && slices.Contains(t2, from) {
					reportedBy = true
				}
			}
			if dead && !reportedBy && len(tos) > 0 && leaves[from] {
				t.Fatalf("%s leaves for reporting only dead nodes %v: %v of %v", from, tos, out, reports)
			}
		}
		rev := map[string][]string{}
		for from, tos := range reports {
			r := slices.Clone(tos)
			slices.Reverse(r)
			rev[from] = r
		}
		if again := Leavers(nodes, rev); !slices.Equal(again, out) {
			t.Fatalf("reports in another order: %v, then %v", out, again)
		}
	})
}

// reportsPeer reports whether n reports a node other than itself.
func reportsPeer(reports map[string][]string, n string) bool {
	for _, to := range reports[n] {
		if to != n {
			return true
		}
	}
	return false
}

// TestReports: reports are kept under the reporter's lease, read back
// per reporter, withdrawn, and gone with the lease when the reporter
// drops out, which fences it as a lost lease would.
func TestReports(t *testing.T) {
	t.Parallel()
	c := newClient(t, shared.Endpoints(), "")
	a := join(t, c, "a", 0)
	b := join(t, c, "b", 0)
	for _, x := range []struct {
		r      *Registration
		target string
		epoch  uint64
	}{{a, "c", 7}, {a, "b", 7}, {b, "a", 7}, {b, "c", 6}} {
		if err := x.r.Report(ctx, x.epoch, x.target); err != nil {
			t.Fatal(err)
		}
	}
	got, err := c.Reports(ctx, 7)
	if err != nil || !slices.Equal(got["a"], []string{"b", "c"}) || !slices.Equal(got["b"], []string{"a"}) || len(got) != 2 {
		t.Fatalf("reports of epoch 7: %v, %v", got, err)
	}
	if got, err := c.Reports(ctx, 6); err != nil || len(got) != 1 || !slices.Equal(got["b"], []string{"c"}) {
		t.Fatalf("reports of epoch 6: %v, %v", got, err)
	}
	if err := a.Report(ctx, 0, "c"); err != nil {
		t.Fatal(err)
	}
	if got, _ := c.Reports(ctx, 7); !slices.Equal(got["a"], []string{"b"}) {
		t.Fatalf("after a withdrawal: %v", got)
	}
	if err := a.Drop(ctx, "cut off from its peers"); err != nil {
		t.Fatal(err)
	}
	select {
	case <-a.Fenced():
	case <-time.After(5 * time.Second):
		t.Fatal("a dropped registration is not fenced")
	}
	if err := a.Err(); !errors.Is(err, ErrFenced) || errors.Is(err, ErrClosed) {
		t.Fatalf("a dropped registration says %v, want ErrFenced", err)
	}
	if got, _ := c.Reports(ctx, 7); len(got["a"]) != 0 || !slices.Equal(got["b"], []string{"a"}) {
		t.Fatalf("after a dropped out: %v, want b's report alone", got)
	}
	settle(t, c, 3, "b")
}
