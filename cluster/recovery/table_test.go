package recovery

import (
	"fmt"
	"slices"
	"testing"

	"pgregory.net/rapid"

	"github.com/ovis-storage/ovis/cluster/object"
)

// TestTableTransitions walks the transition table of Table's doc.
func TestTableTransitions(t *testing.T) {
	a, b, c, d := object.Make(1, 0), object.Make(1, 1), object.Make(1, 2), object.Make(1, 3)
	var tb Table[object.ID]
	tb.Begin(5)
	for _, o := range []object.ID{a, b, c, d} {
		if s := tb.State(o, 5); s != Undecided {
			t.Fatalf("before the listing %s is %v", o, s)
		}
	}
	tb.Recovered(d, 5) // on demand, before the listing
	if !tb.List(5, map[object.ID]Step{a: {Action: Pull, Source: "n2"}, d: {Action: Pull}}, map[object.ID][]string{b: {"n3"}, d: {"n4"}}) {
		t.Fatal("the listing of the Table's epoch was refused")
	}
	for o, want := range map[object.ID]State{a: Pending, b: Unavailable, c: Current, d: Current} {
		if s := tb.State(o, 5); s != want {
			t.Errorf("after the listing %s is %v, want %v", o, s, want)
		}
	}
	if st, ok := tb.Step(a, 5); !ok || st.Source != "n2" {
		t.Errorf("a's step: %+v %v", st, ok)
	}
	if away, ok := tb.Away(b, 5); !ok || !slices.Equal(away, []string{"n3"}) {
		t.Errorf("b's holders: %v %v", away, ok)
	}
	if _, ok := tb.Step(d, 5); ok {
		t.Error("an object recovered on demand kept the listing's step")
	}
	if tb.List(4, nil, nil) {
		t.Error("a stale run's listing was taken")
	}
	tb.Pulled(a, 5)
	if s := tb.State(a, 5); s != Current {
		t.Errorf("after its pull a is %v", s)
	}
	tb.Recovered(b, 5)
	if s := tb.State(b, 5); s != Current || tb.UnavailableCount() != 0 {
		t.Errorf("after its recovery on demand b is %v (%d unavailable)", s, tb.UnavailableCount())
	}
	tb.Recovered(c, 6) // the node is in epoch 6 before its run began
	tb.Begin(6)
	for o, want := range map[object.ID]State{a: Undecided, b: Undecided, c: Current, d: Undecided} {
		if s := tb.State(o, 6); s != want {
			t.Errorf("in the next epoch %s is %v, want %v", o, s, want)
		}
	}
}

// tableModel is the transition table of Table's doc, object by object.
type tableModel struct {
	epoch  uint64
	listed bool
	state  map[object.ID]State  // after the listing, in epoch
	early  map[object.ID]uint64 // recovered on demand, in which epoch
}

func (m *tableModel) get(o object.ID, e uint64) State {
	if m.early[o] == e {
		return Current
	}
	if !m.listed || e != m.epoch {
		return Undecided
	}
	return m.state[o]
}

// TestTableModel drives a Table and the model through random runs,
// listings, pulls and recoveries on demand, with epochs that only grow,
// and compares every object's state after each step. Besides: an object
// recovered on demand in an epoch stays current in it whatever follows
// (a second decision could lose a write: Table.Recovered), Pending and
// Unavailable agree with Step and Away, and a stale listing changes
// nothing.
func TestTableModel(t *testing.T) {
	objs := []object.ID{object.Make(1, 0), object.Make(1, 1), object.Make(2, 0), object.Make(2, 7)}
	rapid.Check(t, func(t *rapid.T) {
		var tb Table[object.ID]
		m := &tableModel{state: map[object.ID]State{}, early: map[object.ID]uint64{}}
		epoch := uint64(1)
		tb.Begin(epoch)
		m.epoch = epoch
		for i := range rapid.IntRange(1, 60).Draw(t, "steps") {
			o := rapid.SampledFrom(objs).Draw(t, fmt.Sprintf("obj%d", i))
			switch op := rapid.IntRange(0, 5).Draw(t, fmt.Sprintf("op%d", i)); op {
			case 0: // a new epoch; its run begins now or later
				epoch += uint64(rapid.IntRange(1, 2).Draw(t, fmt.Sprintf("de%d", i)))
				if rapid.Bool().Draw(t, fmt.Sprintf("begin%d", i)) {
					tb.Begin(epoch)
					m.epoch, m.listed, m.state = epoch, false, map[object.ID]State{}
					for x, e := range m.early {
						if e != epoch {
							delete(m.early, x)
						}
					}
				}
			case 1: // the run begins (again)
				tb.Begin(epoch)
				if m.epoch != epoch {
					m.epoch, m.listed, m.state = epoch, false, map[object.ID]State{}
					for x, e := range m.early {
						if e != epoch {
							delete(m.early, x)
						}
					}
				}
			case 2: // a listing, of the current epoch or a stale one
				le := epoch
				if rapid.Bool().Draw(t, fmt.Sprintf("stale%d", i)) && epoch > 1 {
					le = epoch - 1
				}
				pending, away := map[object.ID]Step{}, map[object.ID][]string{}
				for _, x := range objs {
					switch rapid.IntRange(0, 2).Draw(t, fmt.Sprintf("list%d-%s", i, x)) {
					case 1:
						pending[x] = Step{Action: Pull, Source: "n1"}
					case 2:
						away[x] = []string{"n2"}
					}
				}
				before := snapshot(&tb, objs, epoch)
				took := tb.List(le, pending, away)
				if took != (le == m.epoch) {
					t.Fatalf("listing of epoch %d with the Table at %d: taken %v", le, m.epoch, took)
				}
				if !took {
					if after := snapshot(&tb, objs, epoch); !slices.Equal(before, after) {
						t.Fatalf("a stale listing changed the states %v to %v", before, after)
					}
					break
				}
				m.listed = true
				for _, x := range objs {
					switch {
					case m.early[x] == le:
						m.state[x] = Current
					case pending[x] != Step{}:
						m.state[x] = Pending
					case away[x] != nil:
						m.state[x] = Unavailable
					default:
						m.state[x] = Current
					}
				}
			case 3: // a pull of the current epoch's step
				if _, ok := tb.Step(o, epoch); ok {
					tb.Pulled(o, epoch)
					m.state[o] = Current
				}
			case 4: // a recovery on demand in the current epoch
				tb.Recovered(o, epoch)
				m.early[o] = epoch
				if m.epoch == epoch && m.listed {
					m.state[o] = Current
				}
			case 5: // a pull finishing for an epoch that has gone
				tb.Pulled(o, epoch-1)
			}
			for _, x := range objs {
				got, want := tb.State(x, epoch), m.get(x, epoch)
				if got != want {
					t.Fatalf("step %d: %s is %v in epoch %d, want %v", i, x, got, epoch, want)
				}
				if m.early[x] == epoch && got != Current {
					t.Fatalf("step %d: %s, recovered on demand in %d, is %v", i, x, epoch, got)
				}
				if _, ok := tb.Step(x, epoch); ok != (got == Pending) {
					t.Fatalf("step %d: %s is %v but has a step: %v", i, x, got, ok)
				}
				if _, ok := tb.Away(x, epoch); ok != (got == Unavailable) {
					t.Fatalf("step %d: %s is %v but has holders away: %v", i, x, got, ok)
				}
			}
			if m.epoch == epoch {
				var pend []object.ID
				for _, x := range objs {
					if m.get(x, epoch) == Pending {
						pend = append(pend, x)
					}
				}
				if got := tb.Pending(); !slices.Equal(got, pend) || tb.PendingCount() != len(pend) {
					t.Fatalf("step %d: pending %v (%d), want %v", i, got, tb.PendingCount(), pend)
				}
			}
		}
	})
}

func snapshot(tb *Table[object.ID], objs []object.ID, e uint64) []State {
	out := make([]State, len(objs))
	for i, o := range objs {
		out[i] = tb.State(o, e)
	}
	return out
}
