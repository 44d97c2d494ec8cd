package serve

import (
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"sync"
	"syscall"

	"github.com/ovis-storage/ovis/nbd"
)

// listen binds the unix socket or the TCP address of c, with qemu-nbd's
// messages on failure. A socket file left at the path by an earlier run
// is removed first (qemu-nbd removes any file there; ovis refuses to
// remove anything that is not a socket).
func listen(c *Config) (net.Listener, error) {
	if c.Listener != nil {
		return c.Listener, nil
	}
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
		if errors.Is(err, syscall.EADDRINUSE) {
			// QEMU's inet_listen_saddr tries every address and says
			// this when all of them are taken.
			return nil, fmt.Errorf("Failed to find an available port: %s", strerror(err))
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
// It learns what becomes of the connections it accepted from the nbd
// server's nbd.Config.ConnState hook (connState): a connection counts as a
// client from StateTransmission, and its slot is given back at
// StateClosed, which the server reports exactly once for every connection
// it accepted, refused ones included.
//
// Locking: mu guards the counters and the connection table; it is a leaf
// and is never held while calling the listener or idle.
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
	// empty gets a token each time the number of open clients drops to
	// zero, for a stop that waits for the clients to leave.
	empty chan struct{}

	mu struct {
		sync.Mutex
		// clients counts open connections past the handshake.
		clients int
		// joined holds the open connections past the handshake.
		joined map[net.Conn]bool
		// idleCalled is set once idle has been called.
		idleCalled bool
	}
}

// newGate wraps l; max 0 means no limit.
func newGate(l net.Listener, max int, idle func()) *gate {
	g := &gate{Listener: l, done: make(chan struct{}), idle: idle, empty: make(chan struct{}, 1)}
	if max > 0 {
		g.slots = make(chan struct{}, max)
	}
	g.mu.joined = make(map[net.Conn]bool)
	return g
}

// Accept waits for a free slot, then accepts a connection. The slot is
// given back when connState sees the connection closed.
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
	return c, nil
}

// Close closes the listener and wakes a waiting Accept.
func (g *gate) Close() error {
	g.closeOnce.Do(func() { close(g.done) })
	return g.Listener.Close()
}

// clients returns the number of open connections past the handshake.
func (g *gate) clients() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.mu.clients
}

func (g *gate) release() {
	if g.slots != nil {
		<-g.slots
	}
}

// connState is the nbd server's ConnState hook: StateTransmission makes
// a connection a client; StateClosed gives its slot back and, for a
// client, calls idle when it was the last one.
func (g *gate) connState(c net.Conn, st nbd.ConnState) {
	switch st {
	case nbd.StateTransmission:
		g.mu.Lock()
		if !g.mu.joined[c] {
			g.mu.joined[c] = true
			g.mu.clients++
		}
		g.mu.Unlock()
	case nbd.StateClosed:
		g.mu.Lock()
		joined := g.mu.joined[c]
		delete(g.mu.joined, c)
		call := false
		if joined {
			g.mu.clients--
			call = g.mu.clients == 0 && !g.mu.idleCalled && g.idle != nil
			g.mu.idleCalled = g.mu.idleCalled || call
			if g.mu.clients == 0 {
				select {
				case g.empty <- struct{}{}:
				default:
				}
			}
		}
		g.mu.Unlock()
		g.release()
		if call {
			g.idle()
		}
	}
}
