package owner

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"pgregory.net/rapid"
)

var (
	states = []State{ReadOnly, Live, Suspended, Relocking, Lost, Revoked, Closed}
	kinds  = []Kind{LeaseLost, Rejoined, Retaken, Refused, Broken, Stale, Abandon, Close}
)

// transitions is the whole machine: every (state, event) pair that
// changes the state, with the state it leads to. Every pair not listed
// leaves the machine as it is. The machine under test starts with token
// 5; Retaken brings token 9, Stale names token 5 (the machine's own).
var transitions = `
read-only  close      closed
live       lease-lost suspended
live       broken     revoked
live       stale      revoked
live       close      closed
suspended  rejoined   relocking
suspended  refused    lost
suspended  broken     revoked
suspended  abandon    lost
suspended  close      closed
relocking  lease-lost suspended
relocking  retaken    live
relocking  refused    lost
relocking  broken     revoked
relocking  abandon    lost
relocking  close      closed
lost       close      closed
revoked    close      closed
`

// at returns a machine in state s with token 5 (0 when read-only), as
// the events would have left it.
func at(s State) Machine {
	m := Machine{State: s, Token: 5}
	switch s {
	case ReadOnly:
		m.Token = 0
	case Lost:
		m.Why = fmt.Errorf("%w: earlier", ErrLeaseLost)
	case Revoked:
		m.Why = fmt.Errorf("%w: earlier", ErrRevoked)
	}
	return m
}

func event(k Kind) Event {
	e := Event{Kind: k, Why: errors.New("cause")}
	switch k {
	case Retaken:
		e.Token = 9
	case Stale:
		e.Token = 5
	}
	return e
}

// TestTransitions runs every event in every state against the table,
// and checks what each transition does to the token and the reason.
func TestTransitions(t *testing.T) {
	want := map[[2]string]string{}
	for _, line := range strings.Split(strings.TrimSpace(transitions), "\n") {
		f := strings.Fields(line)
		if len(f) != 3 {
			t.Fatalf("bad table line %q", line)
		}
		want[[2]string{f[0], f[1]}] = f[2]
	}
	seen := 0
	for _, s := range states {
		for _, k := range kinds {
			m := at(s)
			n, changed := m.Next(event(k))
			exp, listed := want[[2]string{s.String(), k.String()}]
			if listed {
				seen++
			} else {
				exp = s.String()
			}
			if n.State.String() != exp {
				t.Errorf("%s + %s → %s, want %s", s, k, n.State, exp)
			}
			if changed != (n.State != m.State || n.Token != m.Token) {
				t.Errorf("%s + %s: changed %v, but %+v → %+v", s, k, changed, m, n)
			}
			// The token changes only by Retaken, from Relocking, upward.
			if n.Token != m.Token && !(s == Relocking && k == Retaken && n.Token == 9) {
				t.Errorf("%s + %s: token %d → %d", s, k, m.Token, n.Token)
			}
			// Why: set on entering Lost or Revoked, with its kind; kept.
			switch {
			case m.Why != nil && n.Why != m.Why:
				t.Errorf("%s + %s: reason %v replaced by %v", s, k, m.Why, n.Why)
			case n.State == Lost && !errors.Is(n.Why, ErrLeaseLost),
				n.State == Revoked && !errors.Is(n.Why, ErrRevoked):
				t.Errorf("%s + %s → %s with reason %v", s, k, n.State, n.Why)
			case m.Why == nil && n.Why != nil && !strings.Contains(n.Why.Error(), "cause"):
				t.Errorf("%s + %s: reason %v does not say the cause", s, k, n.Why)
			}
			// Invariant 4.
			if (n.WriteErr() == nil) != (n.State == Live) {
				t.Errorf("%s: write error %v", n.State, n.WriteErr())
			}
		}
	}
	if seen != len(want) {
		t.Errorf("%d table rows matched, of %d: a row names a state or event that does not exist", seen, len(want))
	}
}

// TestStaleOfOlderToken: a refusal of a token the machine no longer
// carries changes nothing (invariant 3).
func TestStaleOfOlderToken(t *testing.T) {
	m := Start(9)
	if n, changed := m.Next(Event{Kind: Stale, Token: 5, Why: errors.New("old")}); changed || n != m {
		t.Fatalf("a refusal of token 5 moved a machine at 9: %+v", n)
	}
	if n, changed := (Machine{State: Relocking, Token: 9}).Next(Event{Kind: Retaken, Token: 7}); changed || n.Token != 9 {
		t.Fatalf("Retaken with a lower token moved the machine: %+v", n)
	}
}

// TestMachineRandomEvents drives the machine with random events and
// checks its invariants over whole histories: the token never goes
// down, a machine that left Live for Lost, Revoked or Closed never
// writes again, and the first reason is kept.
func TestMachineRandomEvents(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		m := Start(rapid.Uint64Range(0, 3).Draw(t, "token"))
		final := false
		var why error
		for i := range rapid.IntRange(0, 40).Draw(t, "n") {
			e := Event{Kind: rapid.SampledFrom(kinds).Draw(t, fmt.Sprintf("kind%d", i)),
				Token: rapid.Uint64Range(0, 12).Draw(t, fmt.Sprintf("token%d", i)), Why: fmt.Errorf("cause %d", i)}
			n, _ := m.Next(e)
			if n.Token < m.Token {
				t.Fatalf("token went down: %+v + %+v → %+v", m, e, n)
			}
			if final && n.State == Live {
				t.Fatalf("%+v + %+v → live again", m, e)
			}
			if why != nil && n.Why != why {
				t.Fatalf("reason %v replaced by %v", why, n.Why)
			}
			if n.State == Lost || n.State == Revoked || n.State == Closed {
				final = true
			}
			if why == nil {
				why = n.Why
			}
			m = n
		}
	})
}
