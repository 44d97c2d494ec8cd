package nbd

import (
	"time"
)

// This file holds the reader's wait for room in a budget, during which
// another goroutine watches the client so that a disconnect is still
// noticed.

// acquireRoom takes one more request of n bytes of b for the reader,
// waiting for room if there is none. While it waits nothing reads from the
// client, and the requests in service that hold the room may themselves
// wait for the connection's context (a device blocked on a lost replica),
// which only a disconnect the reader sees cancels: so a watcher reads
// ahead meanwhile and cancels the context when the client goes away. It
// fails once the connection's context has ended.
func (t *transmission) acquireRoom(b *budget, n int64) error {
	if b.tryAcquire(n) {
		return nil
	}
	// Only the reader sets read deadlines (Shutdown only ever sets one
	// in the past), so clearing the idle deadline here cannot undo the
	// stop below.
	t.raw.SetReadDeadline(time.Time{})
	if t.srv.shuttingDown() {
		t.raw.SetReadDeadline(aLongTimeAgo)
		return b.acquire(t.ctx, n)
	}
	watched := make(chan struct{})
	go func() {
		defer close(watched)
		t.watchClient()
	}()
	err := b.acquire(t.ctx, n)
	// Stop the watcher and wait for it: the reader owns t.r again after.
	t.raw.SetReadDeadline(aLongTimeAgo)
	<-watched
	t.raw.SetReadDeadline(time.Time{})
	// Shutdown sets its flag before interrupting reads, so a shutdown
	// whose interruption the line above undid is seen here.
	if t.srv.shuttingDown() {
		t.raw.SetReadDeadline(aLongTimeAgo)
	}
	return err
}

// watchClient reads ahead into the reader's buffer, consuming nothing,
// until the client goes away or the stream breaks (then it cancels the
// connection's context), until its read is interrupted (acquireRoom is
// done, or Shutdown stops reading), or until the buffer is full: a client
// that has sent that much ahead is not watched further, and its
// disconnect is seen when the reader gets to it. The idle timeout does
// not apply: a connection waiting for its requests in service is not
// idle.
func (t *transmission) watchClient() {
	for n := t.r.Buffered() + 1; n <= t.r.Size(); n = t.r.Buffered() + 1 {
		if _, err := t.r.Peek(n); err != nil {
			if !isTimeout(err) {
				t.log.Debug("client gone while requests wait", "err", err)
				t.cancel()
			}
			return
		}
	}
}
