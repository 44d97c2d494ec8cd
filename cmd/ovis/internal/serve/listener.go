package serve

import (
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"sync"
	"time"
)

// listen binds the unix socket or the TCP address of c, with qemu-nbd's
// messages on failure. A socket file left at the path by an earlier run
// is removed first (qemu-nbd removes any file there; ovis refuses to
// remove anything that is not a socket).
func listen(c *Config) (net.Listener, error) {
	if c.Socket != "" {
		if st, err := os.Lstat(c.Socket); err == nil && st.Mode()&fs.ModeSocket != 0 {
			os.Remove(c.Socket)
		}
		l, err := net.Listen("unix", c.Socket)
		if err != nil {
			return nil, fmt.Errorf("Failed to bind socket to %s: %s", c.Socket, strerror(err))
		}
		return l, nil
	}
	addr := net.JoinHostPort(c.Bind, c.Port)
	l, err := net.Listen("tcp", addr)
	if err != nil {
		var dns *net.DNSError
		var ae *net.AddrError
		if errors.As(err, &dns) || errors.As(err, &ae) {
			return nil, fmt.Errorf("address resolution failed for %s: %v", addr, err)
		}
		return nil, fmt.Errorf("Failed to bind socket: %s", strerror(err))
	}
	return l, nil
}

// gate is a net.Listener that admits at most max connections at a time
// (qemu-nbd -e: Accept is not called while max are open, so further
// clients wait in the listen backlog) and reports when the last client
// that completed a handshake has gone (qemu-nbd without -t).
//
// A connection counts as a client once the nbd server clears its
// handshake deadline (SetDeadline with the zero time), which it does
// exactly when the handshake succeeded and transmission begins. Its slot
// is given back when the server closes it.
//
// Locking: mu guards the counters; it is a leaf and is never held while
// calling the listener, a connection or idle.
//
// Safe for concurrent use.
type gate struct {
	net.Listener
	// slots holds a token per open connection; nil means no limit.
	slots chan struct{}
	// done is closed by Close, to wake an Accept waiting for a slot.
	done      chan struct{}
	closeOnce sync.Once
	// idle, when non-nil, is called once, when the number of open clients
	// (handshake completed) drops to zero.
	idle func()

	mu struct {
		sync.Mutex
		// clients counts open connections past the handshake.
		clients int
		// idleCalled is set once idle has been called.
		idleCalled bool
	}
}

// newGate wraps l; max 0 means no limit.
func newGate(l net.Listener, max int, idle func()) *gate {
	g := &gate{Listener: l, done: make(chan struct{}), idle: idle}
	if max > 0 {
		g.slots = make(chan struct{}, max)
	}
	return g
}

// Accept waits for a free slot, then accepts a connection.
func (g *gate) Accept() (net.Conn, error) {
	if g.slots != nil {
		select {
		case g.slots <- struct{}{}:
		case <-g.done:
			return nil, net.ErrClosed
		}
	}
	c, err := g.Listener.Accept()
	if err != nil {
		g.release()
		return nil, err
	}
	return &gatedConn{Conn: c, g: g}, nil
}

// Close closes the listener and wakes a waiting Accept.
func (g *gate) Close() error {
	g.closeOnce.Do(func() { close(g.done) })
	return g.Listener.Close()
}

func (g *gate) release() {
	if g.slots != nil {
		<-g.slots
	}
}

// joined records a connection that completed its handshake.
func (g *gate) joined() {
	g.mu.Lock()
	g.mu.clients++
	g.mu.Unlock()
}

// left records the end of a connection that completed its handshake and
// calls idle when it was the last one.
func (g *gate) left() {
	g.mu.Lock()
	g.mu.clients--
	call := g.mu.clients == 0 && !g.mu.idleCalled && g.idle != nil
	if call {
		g.mu.idleCalled = true
	}
	g.mu.Unlock()
	if call {
		g.idle()
	}
}

// gatedConn gives its slot back when closed, and tells the gate when the
// handshake completed.
//
// Locking: mu is a leaf, like the gate's.
type gatedConn struct {
	net.Conn
	g *gate

	mu struct {
		sync.Mutex
		// joined is set when the handshake completed and the gate
		// counted the connection as a client.
		joined bool
		// released is set by the first Close, which gave the slot back.
		released bool
	}
}

// SetDeadline sets the connection's deadlines; the nbd server clears them
// (the zero time) when transmission begins.
func (c *gatedConn) SetDeadline(t time.Time) error {
	if t.IsZero() {
		c.mu.Lock()
		join := !c.mu.joined && !c.mu.released
		c.mu.joined = c.mu.joined || join
		c.mu.Unlock()
		if join {
			c.g.joined()
		}
	}
	return c.Conn.SetDeadline(t)
}

// Close closes the connection and, the first time, gives its slot back.
func (c *gatedConn) Close() error {
	err := c.Conn.Close()
	c.mu.Lock()
	first := !c.mu.released
	c.mu.released = true
	joined := c.mu.joined
	c.mu.Unlock()
	if first {
		c.g.release()
		if joined {
			c.g.left()
		}
	}
	return err
}
