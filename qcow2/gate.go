package qcow2

import (
	"errors"
)

// This file holds the exclusive gate: exclusive drains every user of the
// image (Image.gate held exclusively, no I/O in flight), flushes, and runs
// an operation that rewrites metadata wholesale with flushMu and mu held
// throughout; table loads still release mu, which is safe because nothing
// else can run.

// exclusive runs fn with no I/O in flight, the metadata flushed, and
// flushMu and mu held.
func (img *Image) exclusive(fn func() error) error {
	if img.ro {
		return errReadOnly
	}
	img.gate.Lock()
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
			e, err := nl.c.load(nl.off)
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
