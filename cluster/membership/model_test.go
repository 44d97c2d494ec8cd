package membership

import (
	"errors"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/ovis-storage/ovis/cluster/object"
	"pgregory.net/rapid"
)

// modelVDI is what the model knows of one VDI.
type modelVDI struct {
	id     object.VDI
	size   int64
	holder int // index of the registration holding the lock, -1 for none
	token  uint64
}

// TestVDITableModel runs random creates, deletes, resizes, locks,
// unlocks and breaks against the VDI table and a map, and checks every
// answer and, after each step, the whole table and lock list.
func TestVDITableModel(t *testing.T) {
	t.Parallel()
	runs := 0
	// Locks need only a live lease, which does not depend on the prefix:
	// two registrations serve every run.
	base := newClient(t, shared.Endpoints(), "")
	// Their lease is long: this test is about the table, not fencing,
	// and it keeps etcd busy.
	var regs []*Registration
	for _, id := range []string{"n0", "n1"} {
		r, err := base.Join(ctx, NodeInfo{ID: id, Addr: "x:1"}, 15*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		defer r.Leave(ctx)
		regs = append(regs, r)
	}
	rapid.Check(t, func(rt *rapid.T) {
		runs++
		c := newClient(t, shared.Endpoints(), fmt.Sprintf("/model-%d/", prefixes.Add(1)))
		defer c.Close()
		if err := c.Format(ctx, Format{Copies: 1}, false); err != nil {
			rt.Fatal(err)
		}
		if _, err := c.writeEpoch(ctx, View{Epoch: 1, Nodes: nodes("n0")}, 0); err != nil {
			rt.Fatal(err)
		}
		holders := []string{"gw0", "gw1"}
		model := map[string]*modelVDI{}
		var maxID object.VDI
		var maxToken uint64
		names := []string{"a", "b", "c"}
		for step := range rapid.IntRange(1, 25).Draw(rt, "steps") {
			name := rapid.SampledFrom(names).Draw(rt, "name")
			m := model[name]
			switch op := rapid.SampledFrom([]string{"create", "delete", "resize", "lock", "unlock", "break"}).Draw(rt, "op"); op {
			case "create":
				size := int64(rapid.IntRange(1, 8).Draw(rt, "size")) << 20
				v, err := c.CreateVDI(ctx, VDI{Name: name, Size: size})
				if m != nil {
					if !errors.Is(err, ErrVDIExists) {
						rt.Fatalf("step %d: create of existing %q: %v", step, name, err)
					}
					break
				}
				if err != nil {
					rt.Fatalf("step %d: create %q: %v", step, name, err)
				}
				if v.ID <= maxID {
					rt.Fatalf("step %d: id %d not above every earlier id %d", step, v.ID, maxID)
				}
				maxID = v.ID
				model[name] = &modelVDI{id: v.ID, size: size, holder: -1}
			case "delete":
				_, err := c.DeleteVDI(ctx, name)
				var le *LockedError
				switch {
				case m == nil:
					if !errors.Is(err, ErrNoVDI) {
						rt.Fatalf("step %d: delete of missing %q: %v", step, name, err)
					}
				case m.holder >= 0:
					if !errors.As(err, &le) || le.Holder != holders[m.holder] {
						rt.Fatalf("step %d: delete of locked %q: %v", step, name, err)
					}
				case err != nil:
					rt.Fatalf("step %d: delete %q: %v", step, name, err)
				default:
					delete(model, name)
				}
			case "resize":
				size := int64(rapid.IntRange(1, 8).Draw(rt, "size")) << 20
				shrink := rapid.Bool().Draw(rt, "shrink")
				v, err := c.ResizeVDI(ctx, name, size, shrink)
				switch {
				case m == nil:
					if !errors.Is(err, ErrNoVDI) {
						rt.Fatalf("step %d: resize of missing %q: %v", step, name, err)
					}
				case size < m.size && !shrink:
					if !errors.Is(err, ErrInvalid) {
						rt.Fatalf("step %d: shrink of %q without leave: %v", step, name, err)
					}
				case err != nil || v.Size != size:
					rt.Fatalf("step %d: resize %q to %d: %+v, %v", step, name, size, v, err)
				default:
					m.size = size
				}
			case "lock":
				who := rapid.IntRange(0, 1).Draw(rt, "who")
				l, err := c.Lock(ctx, regs[who], name, holders[who])
				var le *LockedError
				switch {
				case m == nil:
					if !errors.Is(err, ErrNoVDI) {
						rt.Fatalf("step %d: lock of missing %q: %v", step, name, err)
					}
				case m.holder >= 0 && m.holder != who:
					if !errors.As(err, &le) || le.Holder != holders[m.holder] {
						rt.Fatalf("step %d: lock of %q held by %d: %v", step, name, m.holder, err)
					}
				case err != nil:
					rt.Fatalf("step %d: lock %q: %v", step, name, err)
				case m.holder == who:
					if l.Token != m.token {
						rt.Fatalf("step %d: relock of %q gave token %d, was %d", step, name, l.Token, m.token)
					}
				default:
					if l.Token <= maxToken || l.VDI != m.id {
						rt.Fatalf("step %d: lock %q: %+v; tokens so far up to %d", step, name, l, maxToken)
					}
					maxToken, m.holder, m.token = l.Token, who, l.Token
				}
			case "unlock", "break":
				var err error
				if op == "unlock" {
					var id object.VDI
					var token uint64
					if m != nil {
						id, token = m.id, m.token
					}
					err = c.Unlock(ctx, Lock{VDI: id, Name: name, Token: token})
				} else {
					_, err = c.BreakLock(ctx, name)
				}
				switch {
				case m == nil && op == "break":
					if !errors.Is(err, ErrNoVDI) {
						rt.Fatalf("step %d: break of missing %q: %v", step, name, err)
					}
				case m == nil || m.holder < 0:
					if !errors.Is(err, ErrNotLocked) {
						rt.Fatalf("step %d: %s of unlocked %q: %v", step, op, name, err)
					}
				case err != nil:
					rt.Fatalf("step %d: %s %q: %v", step, op, name, err)
				default:
					m.holder, m.token = -1, 0
				}
			}
			checkTable(rt, c, model, holders)
		}
	})
	t.Logf("%d runs", runs)
}

// checkTable compares the whole VDI table and lock list with the model.
func checkTable(rt *rapid.T, c *Client, model map[string]*modelVDI, holders []string) {
	vs, err := c.ListVDIs(ctx)
	if err != nil {
		rt.Fatal(err)
	}
	var got, want []string
	for _, v := range vs {
		got = append(got, fmt.Sprintf("%s:%d:%d", v.Name, v.ID, v.Size))
	}
	var locks []string
	for name, m := range model {
		want = append(want, fmt.Sprintf("%s:%d:%d", name, m.id, m.size))
		if m.holder >= 0 {
			locks = append(locks, fmt.Sprintf("%s:%s:%d", name, holders[m.holder], m.token))
		}
	}
	slices.Sort(want)
	slices.Sort(locks)
	if !slices.Equal(got, want) {
		rt.Fatalf("table %v, model %v", got, want)
	}
	ls, err := c.Locks(ctx)
	if err != nil {
		rt.Fatal(err)
	}
	var gotLocks []string
	for _, l := range ls {
		gotLocks = append(gotLocks, fmt.Sprintf("%s:%s:%d", l.Name, l.Holder, l.Token))
	}
	if !slices.Equal(gotLocks, locks) {
		rt.Fatalf("locks %v, model %v", gotLocks, locks)
	}
}

// TestReproUnlockUnlocked: Unlock of a VDI with no lock, with a zero
// token, once succeeded, because create_revision == 0 also holds for a
// missing key. Found by TestVDITableModel.
func TestReproUnlockUnlocked(t *testing.T) {
	t.Parallel()
	c, _ := formatted(t, 1, 0)
	v, err := c.CreateVDI(ctx, VDI{Name: "a", Size: 1 << 20})
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Unlock(ctx, Lock{VDI: v.ID, Name: "a"}); !errors.Is(err, ErrNotLocked) {
		t.Fatalf("Unlock of an unlocked vdi: %v", err)
	}
}
