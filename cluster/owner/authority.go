package owner

import (
	"context"
	"fmt"
	"sync"
	"time"
)

// Config is an Authority's.
type Config struct {
	// Token is the lock's fencing token; 0 opens read-only.
	Token uint64
	// Valid, when not nil, says whether the node's membership lease (the
	// one the lock is held under) holds at now. Nil: it always does.
	Valid func(now time.Time) bool
	// AwaitValid, when not nil, waits until Valid holds again or ctx
	// ends: the node is rejoining, and requests wait for it. Nil with
	// Valid set: a write while the lease may have expired fails at once
	// with ErrLeaseLost.
	AwaitValid func(ctx context.Context) error
	// Changed, when not nil, is called after every transition, outside
	// the Authority's lock, in the order the transitions happened for
	// one caller. It must not block.
	Changed func(from Machine, e Event, to Machine)
}

// Authority drives one VDI's Machine for its node and its gateway: the
// node applies what happens to the lock and the lease (Apply), the
// gateway asks what it may do (Admit, Live, Stale). It is the
// cluster/gateway.Owner of the VDI's device.
//
// Locking: mu guards m and changed; it is held for reads and updates
// only, never while waiting or calling out.
type Authority struct {
	cfg Config

	mu sync.Mutex
	m  Machine
	// changed is closed, and replaced, at every transition: waiters
	// watch it.
	changed chan struct{}
}

// New returns the Authority of a VDI opened with cfg.Token. Safe for
// concurrent use.
func New(cfg Config) *Authority {
	return &Authority{cfg: cfg, m: Start(cfg.Token), changed: make(chan struct{})}
}

// Apply moves the machine by e and reports whether it changed.
func (a *Authority) Apply(e Event) bool {
	a.mu.Lock()
	from := a.m
	to, changed := from.Next(e)
	if changed {
		a.m = to
		close(a.changed)
		a.changed = make(chan struct{})
	}
	a.mu.Unlock()
	if changed && a.cfg.Changed != nil {
		a.cfg.Changed(from, e, to)
	}
	return changed
}

// Machine returns the machine now.
func (a *Authority) Machine() Machine {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.m
}

// Token is the token writes carry now (0 read-only).
func (a *Authority) Token() uint64 { return a.Machine().Token }

// Lost is why writes are refused for good (wrapping ErrLeaseLost or
// ErrRevoked), or nil.
func (a *Authority) Lost() error {
	m := a.Machine()
	if m.State == Lost || m.State == Revoked {
		return m.Why
	}
	return nil
}

// settled waits while the machine holds requests (Suspended,
// Relocking), and returns it once it does not.
func (a *Authority) settled(ctx context.Context) (Machine, error) {
	for {
		a.mu.Lock()
		m, ch := a.m, a.changed
		a.mu.Unlock()
		if !m.Holds() {
			return m, nil
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return m, fmt.Errorf("owner: waiting for the lock to be taken again: %w", ctx.Err())
		}
	}
}

// Admit waits until a new request may start (the machine holds none
// while the node takes the lock again) and returns why a write may not,
// or nil; a read is refused only once Closed.
func (a *Authority) Admit(ctx context.Context, write bool) error {
	m, err := a.settled(ctx)
	switch {
	case err != nil:
		return err
	case !write:
		if m.State == Closed {
			return m.WriteErr()
		}
		return nil
	}
	if err := m.WriteErr(); err != nil {
		return err
	}
	if a.cfg.Valid != nil && a.cfg.AwaitValid == nil && !a.cfg.Valid(time.Now()) {
		return ErrLeaseLost
	}
	return nil
}

// Live waits while the node's lease does not hold (a request's attempt
// goes only under a live lease) and returns the token to send now and
// how long it waited (0 when the lease held).
func (a *Authority) Live(ctx context.Context) (uint64, time.Duration, error) {
	var waited time.Duration
	if a.cfg.Valid != nil && a.cfg.AwaitValid != nil {
		if now := time.Now(); !a.cfg.Valid(now) {
			if err := a.cfg.AwaitValid(ctx); err != nil {
				return 0, 0, err
			}
			waited = time.Since(now)
		}
	}
	return a.Token(), waited, nil
}

// Stale handles a storage node's refusal of token as stale. Once the
// machine holds requests no more, it returns nil if the token moved on
// meanwhile (the lock was taken again: go again with the new one);
// otherwise the machine is revoked (invariant 3) and the error returned
// wraps why writes fail now and the refusal.
func (a *Authority) Stale(ctx context.Context, token uint64, refusal error) error {
	m, err := a.settled(ctx)
	if err != nil {
		return err
	}
	if m.Token != token {
		return nil
	}
	revoked := a.Apply(Event{Kind: Stale, Token: token, Why: refusal})
	m = a.Machine()
	switch {
	case revoked:
		return m.Why
	case m.State == Live || m.Holds():
		return nil // the lock moved on between settled and Apply: go again
	}
	return fmt.Errorf("%w (%w)", m.WriteErr(), refusal)
}
