package nbd

import (
	"context"
	"sync"
)

// This file holds the budget that bounds the requests and buffer bytes in
// service, per connection and for the server's READ buffers.

// budget bounds requests in service by count and by buffer bytes. A
// connection's budget is acquired only by its reader; the server's
// (Server.readMem) by every connection's reader. Handlers release.
type budget struct {
	mu       sync.Mutex
	cond     sync.Cond
	maxReqs  int
	maxBytes int64
	reqs     int
	bytes    int64
}

func (b *budget) init(maxReqs int, maxBytes int64) {
	b.cond.L = &b.mu
	b.maxReqs, b.maxBytes = maxReqs, maxBytes
}

// tryAcquire takes one more request of n bytes if it fits now, and
// reports whether it did.
func (b *budget) tryAcquire(n int64) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	if !b.fits(n) {
		return false
	}
	b.reqs++
	b.bytes += n
	return true
}

// acquire waits until one more request of n bytes fits, or until ctx
// ends (the connection is closing; its requests in service may never
// release what it waits for). A request always fits when nothing else is
// in service. Once ctx has ended it fails even if the request fits: a
// closing connection starts no more device calls.
func (b *budget) acquire(ctx context.Context, n int64) error {
	var stop func() bool
	b.mu.Lock()
	for {
		if err := ctx.Err(); err != nil {
			b.mu.Unlock()
			if stop != nil {
				stop()
			}
			return err
		}
		if b.fits(n) {
			break
		}
		if stop == nil {
			stop = context.AfterFunc(ctx, func() {
				b.mu.Lock()
				b.cond.Broadcast()
				b.mu.Unlock()
			})
		}
		b.cond.Wait()
	}
	b.reqs++
	b.bytes += n
	b.mu.Unlock()
	if stop != nil {
		stop()
	}
	return nil
}

// fits reports whether a request of n bytes may start. Called with mu
// held.
func (b *budget) fits(n int64) bool {
	return b.reqs < b.maxReqs && (b.reqs == 0 || b.bytes+n <= b.maxBytes)
}

// release gives back a request of n bytes. Every waiter is woken: waiters
// of different sizes may wait on the server's budget, and the one that
// now fits may not be the first.
func (b *budget) release(n int64) {
	b.mu.Lock()
	b.reqs--
	b.bytes -= n
	b.mu.Unlock()
	b.cond.Broadcast()
}

// busy reports whether a request is in service.
func (b *budget) busy() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.reqs > 0
}
