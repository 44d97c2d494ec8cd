package img

import (
	"context"
	"sync"
	"time"
)

// rateLimiter paces a copy's writes to a number of bytes per second (qemu-img
// convert -r, which throttles the target's write bandwidth): every write
// books the next slot of len/rate seconds and waits for the slot's end, so
// that n bytes take at least n/rate seconds whatever the concurrency. A nil
// *rateLimiter does not limit.
//
// Safe for concurrent use.
type rateLimiter struct {
	rate int64 // bytes per second, > 0
	mu   sync.Mutex
	// next is when the bytes booked so far will have had their time.
	next time.Time
}

// newRateLimiter returns a limiter of rate bytes per second, or nil for a
// rate of 0 (no limit).
func newRateLimiter(rate int64) *rateLimiter {
	if rate <= 0 {
		return nil
	}
	return &rateLimiter{rate: rate}
}

// wait books n bytes and sleeps until their slot ends, or ctx is done.
func (r *rateLimiter) wait(ctx context.Context, n int64) error {
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
