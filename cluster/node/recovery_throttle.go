package node

import (
	"context"
	"time"
)

// control applies `ovis node recovery`'s settings.
func (r *recoverer) control(c RecoveryControl) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if c.MaxRate != nil {
		r.maxRate = max(*c.MaxRate, 0)
		r.next = time.Time{}
	}
	if c.Paused != nil {
		r.paused = *c.Paused
	}
	close(r.resumed)
	r.resumed = make(chan struct{})
	if c.MaxRate != nil || c.Paused != nil {
		r.log.Info("recovery settings", "paused", r.paused, "max_rate", r.maxRate)
	}
}

// throttle waits until a background pull of n bytes may start: not while
// paused, and no faster than maxRate over time. On-demand recoveries do
// not wait: a VM's request is never held back by the throttle.
func (r *recoverer) throttle(ctx context.Context, n int64) error {
	for {
		r.mu.Lock()
		paused, wake := r.paused, r.resumed
		var wait time.Duration
		if !paused && r.maxRate > 0 {
			now := r.clock()
			if r.next.Before(now) {
				r.next = now
			}
			wait = r.next.Sub(now)
			if wait == 0 {
				r.next = r.next.Add(time.Duration(float64(n) / float64(r.maxRate) * float64(time.Second)))
			}
		}
		r.mu.Unlock()
		if !paused && wait == 0 {
			return nil
		}
		var t *time.Timer
		var tc <-chan time.Time
		if !paused {
			t = time.NewTimer(wait)
			tc = t.C
		}
		select {
		case <-ctx.Done():
		case <-wake:
		case <-tc:
		}
		if t != nil {
			t.Stop()
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
	}
}
