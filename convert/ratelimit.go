package convert

import (
	"context"
	"sync"
	"time"
)

// RateLimiter paces writes to a number of bytes per second, as qemu-img
// throttles its target's write bandwidth (convert -r, commit -r): every
// write books the next slot of n/rate seconds and waits for the slot's
// end, so that n bytes take at least n/rate seconds whatever the
// concurrency. Copy makes one for Options.RateLimit; it is exported for
// the other copy loops. A nil *RateLimiter does not limit.
//
// Safe for concurrent use.
type RateLimiter struct {
	rate int64 // bytes per second, > 0
	mu   sync.Mutex
	// next is when the bytes booked so far will have had their time.
	next time.Time
}

// NewRateLimiter returns a limiter of rate bytes per second, or nil for a
// rate of 0 or less (no limit).
func NewRateLimiter(rate int64) *RateLimiter {
	if rate <= 0 {
		return nil
	}
	return &RateLimiter{rate: rate}
}

// Wait books n bytes and sleeps until their slot ends. It returns ctx's
// error if ctx is done first.
func (r *RateLimiter) Wait(ctx context.Context, n int64) error {
	if r == nil || n <= 0 {
		return nil
	}
	r.mu.Lock()
	now := time.Now()
	if r.next.Before(now) {
		r.next = now
	}
	r.next = r.next.Add(time.Duration(float64(n) / float64(r.rate) * float64(time.Second)))
	until := r.next
	r.mu.Unlock()
	t := time.NewTimer(time.Until(until))
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
