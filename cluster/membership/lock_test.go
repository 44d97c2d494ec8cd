package membership

import (
	"encoding/json"
	"testing"
)

// TestLockJSON: a lock's JSON form (what `ovis vdi lock list|break
// --output=json` print) carries its real token and lease, and the token
// grows after a break and a new lock.
func TestLockJSON(t *testing.T) {
	t.Parallel()
	c, regs := formatted(t, 1, 0, 0)
	if _, err := c.CreateVDI(ctx, VDI{Name: "disk", Size: 1 << 20}); err != nil {
		t.Fatal(err)
	}
	l1, err := c.Lock(ctx, regs[0], "disk", "gw-a")
	if err != nil {
		t.Fatal(err)
	}
	roundTrip := func(l Lock) Lock {
		t.Helper()
		b, err := json.Marshal(l)
		if err != nil {
			t.Fatal(err)
		}
		var got struct {
			Name  string `json:"name"`
			Token uint64 `json:"token"`
			Lease int64  `json:"lease"`
		}
		if err := json.Unmarshal(b, &got); err != nil {
			t.Fatal(err)
		}
		if got.Token == 0 || got.Token != l.Token || got.Lease != l.Lease || got.Name != "disk" {
			t.Fatalf("JSON %s of lock %+v", b, l)
		}
		var back Lock
		if err := json.Unmarshal(b, &back); err != nil || back != l {
			t.Fatalf("decoded %+v (%v), want %+v", back, err, l)
		}
		return back
	}
	roundTrip(l1)
	broken, err := c.BreakLock(ctx, "disk")
	if err != nil || roundTrip(broken).Token != l1.Token {
		t.Fatalf("BreakLock: %+v, %v", broken, err)
	}
	l2, err := c.Lock(ctx, regs[1], "disk", "gw-b")
	if err != nil {
		t.Fatal(err)
	}
	ls, err := c.Locks(ctx)
	if err != nil || len(ls) != 1 {
		t.Fatalf("Locks: %+v, %v", ls, err)
	}
	if got := roundTrip(ls[0]); got.Token <= l1.Token || got.Token != l2.Token {
		t.Fatalf("token after a break and a new lock: %d, want %d > %d", got.Token, l2.Token, l1.Token)
	}
}

// TestBroken: Broken is false while the lock is held, true once it was
// broken while its lease lives, and false when it went with its lease
// (the holder's way back is Relock).
func TestBroken(t *testing.T) {
	t.Parallel()
	c, regs := formatted(t, 1, 0, 0)
	if _, err := c.CreateVDI(ctx, VDI{Name: "disk", Size: 1 << 20}); err != nil {
		t.Fatal(err)
	}
	l1, err := c.Lock(ctx, regs[0], "disk", "gw-a")
	if err != nil {
		t.Fatal(err)
	}
	if b, err := c.Broken(ctx, l1); err != nil || b {
		t.Fatalf("Broken of a held lock: %v, %v", b, err)
	}
	if _, err := c.BreakLock(ctx, "disk"); err != nil {
		t.Fatal(err)
	}
	if b, err := c.Broken(ctx, l1); err != nil || !b {
		t.Fatalf("Broken of a broken lock: %v, %v", b, err)
	}
	// Taken by another since: still broken for l1.
	l2, err := c.Lock(ctx, regs[1], "disk", "gw-b")
	if err != nil {
		t.Fatal(err)
	}
	if b, err := c.Broken(ctx, l1); err != nil || !b {
		t.Fatalf("Broken of a lock taken over: %v, %v", b, err)
	}
	// Lost with its lease: not broken.
	if _, err := c.cli.Revoke(ctx, regs[1].LeaseID()); err != nil {
		t.Fatal(err)
	}
	<-regs[1].Fenced()
	if b, err := c.Broken(ctx, l2); err != nil || b {
		t.Fatalf("Broken of a lock gone with its lease: %v, %v", b, err)
	}
}
