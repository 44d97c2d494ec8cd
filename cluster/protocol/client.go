package protocol

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ovis-storage/ovis/cluster/object"
)

// ioTimeout bounds a write to a peer and the read of a payload once its
// header has arrived, on both sides: a peer that stops reading, or stops
// sending in the middle of a message, loses the connection.
const ioTimeout = 30 * time.Second

// queueLen is how many calls may wait for a Client's writer.
const queueLen = 256

// Client is one connection to a peer, on which calls are multiplexed:
// each gets its own handle, requests are written in the order they are
// queued and responses are matched by handle in whatever order they
// come.
//
// A Client owns a reader and a writer goroutine. When the connection
// fails (the peer closes it, an I/O error or timeout, a response that
// breaks the framing) every pending call fails with an error wrapping
// ErrConnection that names the peer, and so does every later call. A
// Client is never reconnected; Pool dials a new one.
//
// Locking: mu guards the pending calls and the failure; it is never held
// across I/O. Safe for concurrent use. Release with Close.
type Client struct {
	conn  net.Conn
	peer  string
	queue chan *call
	// done is closed when the connection has failed or been closed.
	done chan struct{}
	wg   sync.WaitGroup

	mu struct {
		sync.Mutex
		next    uint64
		pending map[uint64]*call // nil once failed
		err     error            // the failure, set once
		closed  bool             // Close was called
	}
}

// Call states: a queued call is taken by the writer or abandoned by its
// caller, never both.
const (
	callQueued int32 = iota
	callWriting
	callAbandoned
)

// call is one request in flight.
type call struct {
	req *Request
	// op, object and length are copied from req for the reader, which
	// may still look at a call whose caller has left.
	op     Op
	object object.ID
	length uint32
	crc    uint32 // of req.Payload
	handle uint64
	state  atomic.Int32
	// written is closed by the writer once it no longer reads req, after
	// taking the call (callWriting).
	written chan struct{}
	// done is closed once resp or err is set.
	done chan struct{}
	resp Response
	err  error
}

// NewClient starts a Client on conn, which it owns from then on.
func NewClient(conn net.Conn) *Client {
	c := &Client{
		conn:  conn,
		peer:  conn.RemoteAddr().String(),
		queue: make(chan *call, queueLen),
		done:  make(chan struct{}),
	}
	c.mu.pending = make(map[uint64]*call)
	c.wg.Add(2)
	go c.writeLoop()
	go c.readLoop()
	return c
}

// Call sends req and waits for its response, which it stores in resp.
// It assigns the request's handle itself (req.Handle is not sent nor
// changed); resp.Handle is the handle used. resp.Payload is replaced by
// a slice the Client allocated, which the caller owns. resp must not be
// nil.
//
// It returns an *Error when resp.Status is not StatusOK (resp is filled
// then too), an error wrapping ErrConnection (and ErrNotSent when it
// applies) when the connection fails, ErrChecksum when the response's
// payload fails its checksum, ErrMalformed when a successful OpRead
// reply is not req.Length bytes, and ctx.Err() when ctx ends first: the
// call is then abandoned and its response discarded when it comes.
// Call does not return while the connection's writer still reads
// req.Payload.
func (c *Client) Call(ctx context.Context, req *Request, resp *Response) error {
	if _, err := checkRequest(req); err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		return err // never sent
	}
	// The checksum is computed here, not by the writer, so that the
	// callers' CRCs run in parallel and overlap the writes.
	cl := &call{req: req, op: req.Op, object: req.Object, length: req.Length, crc: Checksum(req.Payload),
		written: make(chan struct{}), done: make(chan struct{})}
	c.mu.Lock()
	if err := c.mu.err; err != nil {
		c.mu.Unlock()
		return c.failedErr(err, true)
	}
	c.mu.next++
	cl.handle = c.mu.next
	c.mu.pending[cl.handle] = cl
	c.mu.Unlock()

	select {
	case c.queue <- cl:
	case <-ctx.Done():
		c.abandon(cl)
		return ctx.Err()
	case <-c.done:
		// fail has failed the call, or will: it saw it pending.
	}
	select {
	case <-cl.done:
	case <-ctx.Done():
		c.abandon(cl)
		return ctx.Err()
	}
	c.release(cl)
	if cl.err != nil {
		return cl.err
	}
	*resp = cl.resp
	if resp.Status != StatusOK {
		return newError(req, resp)
	}
	return nil
}

// abandon forgets a call whose caller leaves before its response: the
// writer skips it if it has not taken it, and the reader discards its
// response.
func (c *Client) abandon(cl *call) {
	c.mu.Lock()
	if c.mu.pending != nil {
		delete(c.mu.pending, cl.handle)
	}
	c.mu.Unlock()
	c.release(cl)
}

// release returns once the writer no longer reads cl.req: it never took
// the call (which it now never will), or it has finished writing it,
// which ioTimeout bounds.
func (c *Client) release(cl *call) {
	if cl.state.CompareAndSwap(callQueued, callAbandoned) || cl.state.Load() == callAbandoned {
		return
	}
	<-cl.written
}

// failedErr is the error of a call on a failed connection.
func (c *Client) failedErr(cause error, notSent bool) error {
	return &connError{peer: c.peer, cause: cause, notSent: notSent}
}

// fail records the connection's failure, closes it and fails every
// pending call. Only the first failure counts.
func (c *Client) fail(cause error) {
	c.mu.Lock()
	if c.mu.err != nil {
		c.mu.Unlock()
		return
	}
	c.mu.err = cause
	pending := c.mu.pending
	c.mu.pending = nil
	c.mu.Unlock()
	close(c.done)
	c.conn.Close()
	for _, cl := range pending {
		// A call the writer never took was not sent, and never will be.
		notSent := cl.state.CompareAndSwap(callQueued, callAbandoned)
		cl.err = c.failedErr(cause, notSent)
		close(cl.done)
	}
}

// dead reports whether the connection has failed or been closed.
func (c *Client) dead() bool {
	select {
	case <-c.done:
		return true
	default:
		return false
	}
}

// Close fails every pending call with ErrClosed as the cause, closes the
// connection and waits for the Client's goroutines. A second Close
// returns ErrClosed.
func (c *Client) Close() error {
	c.mu.Lock()
	if c.mu.closed {
		c.mu.Unlock()
		return ErrClosed
	}
	c.mu.closed = true
	c.mu.Unlock()
	c.fail(ErrClosed)
	c.wg.Wait()
	return nil
}

// writeLoop writes queued requests, flushing whenever the queue is
// empty so that requests queued together share a write.
func (c *Client) writeLoop() {
	defer c.wg.Done()
	bw := bufio.NewWriterSize(c.conn, 64<<10)
	var hdr [RequestHeaderLen]byte
	for {
		var cl *call
		select {
		case cl = <-c.queue:
		case <-c.done:
			return
		}
		if !cl.state.CompareAndSwap(callQueued, callWriting) {
			continue // abandoned before it was sent
		}
		err := c.writeCall(bw, cl, hdr[:])
		close(cl.written)
		if err == nil && len(c.queue) == 0 {
			err = bw.Flush()
		}
		if err != nil {
			c.fail(fmt.Errorf("writing %s request: %w", cl.op, err))
			return
		}
	}
}

// writeCall encodes one request into bw.
func (c *Client) writeCall(bw *bufio.Writer, cl *call, hdr []byte) error {
	r := cl.req
	n, _ := checkRequest(r) // checked by Call
	if err := c.conn.SetWriteDeadline(time.Now().Add(ioTimeout)); err != nil {
		return err
	}
	putRequestHeader(hdr, r, cl.handle, r.Payload != nil, int(n), cl.crc)
	if _, err := bw.Write(hdr); err != nil {
		return err
	}
	_, err := bw.Write(r.Payload)
	return err
}

// readLoop reads responses and hands each to its call.
func (c *Client) readLoop() {
	defer c.wg.Done()
	br := bufio.NewReaderSize(c.conn, 64<<10)
	var hdr [ResponseHeaderLen]byte
	for {
		if _, err := io.ReadFull(br, hdr[:]); err != nil {
			if err == io.EOF {
				err = fmt.Errorf("closed by peer: %w", io.EOF)
			} else {
				err = fmt.Errorf("reading response header: %w", err)
			}
			c.fail(err)
			return
		}
		var resp Response
		n, crc, err := parseResponseHeader(hdr[:], &resp)
		if err != nil {
			c.fail(err)
			return
		}
		c.mu.Lock()
		cl := c.mu.pending[resp.Handle]
		if cl != nil {
			delete(c.mu.pending, resp.Handle)
		}
		c.mu.Unlock()
		if n > 0 {
			// Deadline errors are left to the read: a net.Pipe refuses
			// deadlines once its peer closed, with our bytes still to read.
			c.conn.SetReadDeadline(time.Now().Add(ioTimeout))
			var p []byte
			if cl == nil {
				// Abandoned (or never ours): skip the bytes without
				// holding them.
				_, err = io.CopyN(io.Discard, br, int64(n))
			} else {
				var buf []byte
				if cl.op == OpRead && int(cl.length) >= n {
					buf = make([]byte, n) // asked for: allocate at once
				}
				p, err = readPayload(br, buf, n)
			}
			c.conn.SetReadDeadline(time.Time{})
			if err != nil {
				c.fail(fmt.Errorf("reading response handle %d payload of %d bytes: %w", resp.Handle, n, unexpected(err)))
				if cl != nil {
					cl.err = c.failedErr(err, false)
					close(cl.done)
				}
				return
			}
			resp.Payload = p
		}
		if cl == nil {
			continue
		}
		if got := Checksum(resp.Payload); got != crc {
			cl.err = fmt.Errorf("protocol: %s %s from %s: %w: crc32c %#08x, header says %#08x", cl.op, cl.object, c.peer, ErrChecksum, got, crc)
		} else if cl.op == OpRead && resp.Status == StatusOK && len(resp.Payload) != int(cl.length) {
			cl.err = fmt.Errorf("protocol: read %s from %s: %w: reply of %d bytes, asked for %d", cl.object, c.peer, ErrMalformed, len(resp.Payload), cl.length)
		}
		cl.resp = resp
		close(cl.done)
	}
}
