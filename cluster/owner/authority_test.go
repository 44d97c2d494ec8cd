package owner

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/ovis-storage/ovis/block"
)

// start runs f in a goroutine and returns where its error comes;
// pending checks that it has not come in 100 ms, result waits 5 s for it.
func start(f func() error) <-chan error {
	ch := make(chan error, 1)
	go func() { ch <- f() }()
	return ch
}

func pending(t *testing.T, ch <-chan error, what string) {
	t.Helper()
	select {
	case err := <-ch:
		t.Fatalf("%s returned %v, want it to wait", what, err)
	case <-time.After(100 * time.Millisecond):
	}
}

func result(t *testing.T, ch <-chan error, what string) error {
	t.Helper()
	select {
	case err := <-ch:
		return err
	case <-time.After(5 * time.Second):
		t.Fatalf("%s still waits after 5 s", what)
		return nil
	}
}

// TestAuthorityHoldsWhileRelocking: requests wait while the node is away
// and while it takes the lock again, and go on under the new token; a
// refusal of the old token then asks for another try, and one of the
// new token revokes, once.
func TestAuthorityHoldsWhileRelocking(t *testing.T) {
	ctx := context.Background()
	var mu sync.Mutex
	var seen []Kind
	a := New(Config{Token: 4, Changed: func(_ Machine, e Event, _ Machine) {
		mu.Lock()
		seen = append(seen, e.Kind)
		mu.Unlock()
	}})
	if err := a.Admit(ctx, true); err != nil {
		t.Fatalf("a live owner refused a write: %v", err)
	}
	a.Apply(Event{Kind: LeaseLost})
	w := start(func() error { return a.Admit(ctx, true) })
	r := start(func() error { return a.Admit(ctx, false) })
	pending(t, w, "a write while suspended")
	pending(t, r, "a read while suspended")
	a.Apply(Event{Kind: Rejoined})
	pending(t, w, "a write while relocking")
	s := start(func() error { return a.Stale(ctx, 4, errors.New("refused")) })
	pending(t, s, "a stale refusal while relocking")
	a.Apply(Event{Kind: Retaken, Token: 8})
	for _, ch := range []<-chan error{w, r, s} {
		if err := result(t, ch, "a held call"); err != nil {
			t.Fatalf("after the lock was taken again: %v", err)
		}
	}
	if tok, waited, err := a.Live(ctx); err != nil || tok != 8 || waited != 0 {
		t.Fatalf("Live: token %d, waited %v, %v; want 8 at once", tok, waited, err)
	}
	err := a.Stale(ctx, 8, errors.New("node n2 refused token 8"))
	if !errors.Is(err, ErrRevoked) || !errors.Is(err, block.ErrReadOnly) {
		t.Fatalf("a refusal of the current token: %v, want ErrRevoked", err)
	}
	if err := a.Admit(ctx, true); !errors.Is(err, ErrRevoked) {
		t.Fatalf("a write after the revocation: %v", err)
	}
	if err := a.Admit(ctx, false); err != nil {
		t.Fatalf("a read after the revocation: %v", err)
	}
	if err := a.Stale(ctx, 8, errors.New("again")); !errors.Is(err, ErrRevoked) {
		t.Fatalf("a second refusal: %v", err)
	}
	mu.Lock()
	defer mu.Unlock()
	want := []Kind{LeaseLost, Rejoined, Retaken, Stale}
	if len(seen) != len(want) {
		t.Fatalf("transitions %v, want %v", seen, want)
	}
	for i := range want {
		if seen[i] != want[i] {
			t.Fatalf("transitions %v, want %v", seen, want)
		}
	}
}

// TestAuthorityLease: without a way to wait for the lease, a write while
// it may have expired fails at once; with one, an attempt waits for it.
func TestAuthorityLease(t *testing.T) {
	ctx := context.Background()
	var mu sync.Mutex
	valid := false
	back := make(chan struct{})
	isValid := func(time.Time) bool { mu.Lock(); defer mu.Unlock(); return valid }
	a := New(Config{Token: 3, Valid: isValid})
	if err := a.Admit(ctx, true); !errors.Is(err, ErrLeaseLost) {
		t.Fatalf("a write without the lease: %v, want ErrLeaseLost", err)
	}
	if err := a.Admit(ctx, false); err != nil {
		t.Fatalf("a read without the lease: %v", err)
	}
	b := New(Config{Token: 3, Valid: isValid, AwaitValid: func(ctx context.Context) error {
		select {
		case <-back:
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	}})
	if err := b.Admit(ctx, true); err != nil {
		t.Fatalf("a write that may wait for the lease: %v", err)
	}
	l := start(func() error {
		_, waited, err := b.Live(ctx)
		if err == nil && waited == 0 {
			err = errors.New("Live waited for the lease and says it did not")
		}
		return err
	})
	pending(t, l, "an attempt without the lease")
	mu.Lock()
	valid = true
	mu.Unlock()
	close(back)
	if err := result(t, l, "an attempt"); err != nil {
		t.Fatal(err)
	}
	cctx, cancel := context.WithCancel(ctx)
	b.Apply(Event{Kind: LeaseLost})
	c := start(func() error { return b.Admit(cctx, true) })
	cancel()
	if err := result(t, c, "a held write whose context ended"); !errors.Is(err, context.Canceled) {
		t.Fatalf("a held write whose context ended: %v", err)
	}
	b.Apply(Event{Kind: Close})
	if err := b.Admit(ctx, false); !errors.Is(err, block.ErrClosed) {
		t.Fatalf("a read once closed: %v", err)
	}
}
