package membership

import (
	"errors"
	"testing"
)

// TestRelock: a holder whose lease went (its node was cut off from etcd
// for longer than it) takes its lock again under a new lease only when
// nobody took the lock between; a lock taken and released by another
// holder meanwhile gives ErrTakenOver.
func TestRelock(t *testing.T) {
	t.Parallel()
	c, regs := formatted(t, 1, 0, 0)
	if _, err := c.CreateVDI(ctx, VDI{Name: "disk", Size: 1 << 20}); err != nil {
		t.Fatal(err)
	}
	lose := func(r *Registration) {
		t.Helper()
		if _, err := c.cli.Revoke(ctx, r.LeaseID()); err != nil {
			t.Fatal(err)
		}
		<-r.Fenced()
	}
	join := func(id string) *Registration {
		t.Helper()
		r, err := c.Join(ctx, NodeInfo{ID: id, Addr: id + ":1"}, testTTL)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { r.Leave(ctx) })
		return r
	}

	old, err := c.Lock(ctx, regs[0], "disk", "gw-a")
	if err != nil {
		t.Fatal(err)
	}
	lose(regs[0])
	back := join("a2")
	l, err := c.Relock(ctx, back, "disk", old)
	if err != nil {
		t.Fatalf("Relock with nobody between: %v", err)
	}
	if l.Token <= old.Token || l.Holder != "gw-a" || l.Lease != int64(back.LeaseID()) {
		t.Fatalf("Relock gave %+v after %+v", l, old)
	}
	// Again under the same lease: the same lock.
	if again, err := c.Relock(ctx, back, "disk", l); err != nil || again.Token != l.Token {
		t.Fatalf("second Relock: %+v, %v", again, err)
	}

	// Lost again; another holder takes the lock and lets it go.
	lose(back)
	other := join("b")
	ol, err := c.Lock(ctx, other, "disk", "gw-b")
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Unlock(ctx, ol); err != nil {
		t.Fatal(err)
	}
	back2 := join("a3")
	if _, err := c.Relock(ctx, back2, "disk", l); !errors.Is(err, ErrTakenOver) {
		t.Fatalf("Relock after another holder: %v, want ErrTakenOver", err)
	}
	// And while another holds it: LockedError.
	held, err := c.Lock(ctx, other, "disk", "gw-b")
	if err != nil {
		t.Fatal(err)
	}
	var le *LockedError
	if _, err := c.Relock(ctx, back2, "disk", held); !errors.As(err, &le) {
		t.Fatalf("Relock of a held lock: %v, want a LockedError", err)
	}
}
