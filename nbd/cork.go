package nbd

import (
	"bufio"
)

// This file holds the writing of replies under wmu and its corking: a
// reply made on the reader's goroutine stays buffered while more requests
// are waiting (flushHeld sends it before the reader waits), and replies
// that complete together share one flush; a write error closes the socket.

// sendInline writes a reply made on the reader's goroutine. While more
// requests are already buffered it leaves the reply in w, so that a burst
// answered at once goes out in one write, as through a corked socket;
// flushHeld sends it before the reader waits for the client.
func (t *transmission) sendInline(fn func(w *bufio.Writer) error) {
	t.wmu.Lock()
	defer t.wmu.Unlock()
	if t.werr != nil {
		return
	}
	t.armWrite()
	err := fn(t.w)
	if err == nil {
		if t.r.Buffered() >= requestHeaderLen {
			t.held.Store(true)
			return
		}
		err = t.w.Flush()
		t.held.Store(false)
	}
	if err != nil {
		t.werr = err
		t.raw.Close()
	}
}

// flushHeld sends replies sendInline left in w. The reader calls it before
// any read that may wait for the client.
func (t *transmission) flushHeld() {
	if !t.held.Load() {
		return
	}
	t.wmu.Lock()
	defer t.wmu.Unlock()
	if !t.held.Load() || t.werr != nil {
		return
	}
	t.held.Store(false)
	t.armWrite()
	if err := t.w.Flush(); err != nil {
		t.werr = err
		t.raw.Close()
	}
}

// replyError sends an error reply: an NBD_REPLY_TYPE_ERROR chunk with a
// message when structured replies were negotiated, else a simple reply.
func (t *transmission) replyError(req request, errno Errno, msg string) {
	t.send(func(w *bufio.Writer) error {
		if !t.structured {
			return writeSimple(w, req.handle, errno)
		}
		return writeErrorChunk(w, req.handle, errno, msg)
	})
}

// send writes one reply under wmu. The last of the replies waiting for the
// lock flushes, so replies that complete together share a write. After a
// write error the socket is closed, which ends the reader, and later
// replies are dropped.
func (t *transmission) send(fn func(w *bufio.Writer) error) {
	t.pending.Add(1)
	t.wmu.Lock()
	defer t.wmu.Unlock()
	last := t.pending.Add(-1) == 0
	if t.werr != nil {
		return
	}
	t.armWrite()
	err := fn(t.w)
	if err == nil && last {
		err = t.w.Flush()
		t.held.Store(false)
	}
	if err != nil {
		t.werr = err
		t.raw.Close()
	}
}
