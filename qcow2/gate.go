package qcow2

import (
	"context"
	"errors"
	"fmt"
)

// This file holds the exclusive gate: exclusive drains every user of the
// image (Image.gate held exclusively, no I/O in flight), flushes, and runs
// an operation that rewrites metadata wholesale with flushMu and mu held
// throughout; table loads still release mu, which is safe because nothing
// else can run.

// exclusive runs fn with no I/O in flight, the metadata flushed, and
// flushMu and mu held. It gives up with ctx's error if ctx ends while it
// waits for the I/O in flight to drain.
func (img *Image) exclusive(ctx context.Context, fn func() error) error {
	if img.ro {
		return errReadOnly
	}
	if err := img.lockGate(ctx); err != nil {
		return err
	}
	defer img.gate.Unlock()
	if err := img.checkOpen(); err != nil {
		return err
	}
	if err := img.flush(); err != nil {
		return err
	}
	img.flushMu.Lock()
	defer img.flushMu.Unlock()
	img.mu.Lock()
	defer img.mu.Unlock()
	return fn()
}

// flushExclusiveLocked runs the ordered flush from inside exclusive.
func (img *Image) flushExclusiveLocked() error {
	img.mu.Unlock()
	defer img.mu.Lock()
	return img.flushLocked()
}

// retryExclusiveLocked runs fn until it stops asking for tables: a
// *needLoad is loaded (mu is released meanwhile, which is safe inside
// exclusive) and a *needGrow grows the refcount table (flushMu is held).
func (img *Image) retryExclusiveLocked(fn func() error) error {
	for {
		err := fn()
		if nl, ok := isNeedLoad(err); ok {
			// Nothing else runs inside exclusive, so no load is in
			// flight to wait for: the context has nothing to cut short.
			e, err := nl.c.load(context.Background(), nl.off)
			if err != nil {
				return err
			}
			e.pins--
			continue
		}
		var ng *needGrow
		if errors.As(err, &ng) {
			if err := img.growRefTableLocked(ng.need); err != nil {
				return err
			}
			continue
		}
		return err
	}
}

// lockGate takes the gate exclusively, waiting for the I/O in flight to
// drain, or returns ctx's error if ctx ends first. sync.RWMutex cannot
// give up a Lock, so a cancelled wait leaves a goroutine that takes the
// gate when the drain ends and releases it at once; it lives no longer
// than the I/O in flight.
func (img *Image) lockGate(ctx context.Context) error {
	if img.gate.TryLock() {
		return nil
	}
	if ctx.Done() == nil {
		img.gate.Lock()
		return nil
	}
	got := make(chan struct{})
	go func() {
		img.gate.Lock()
		close(got)
	}()
	select {
	case <-got:
		return nil
	case <-ctx.Done():
		go func() {
			<-got
			img.gate.Unlock()
		}()
		return fmt.Errorf("qcow2: waiting for I/O in flight to drain: %w", ctx.Err())
	}
}

// waitFor waits until ch is closed, or returns ctx's error if ctx ends
// first: a claim, a table load or a drain that a cancelled request no
// longer needs.
func waitFor(ctx context.Context, ch <-chan struct{}) error {
	select {
	case <-ch:
		return nil
	default:
	}
	select {
	case <-ch:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("qcow2: %w", ctx.Err())
	}
}
