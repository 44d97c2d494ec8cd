package protocol

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"time"
)

// Dialer opens a connection to addr; for mutual TLS it returns a
// *tls.Conn whose handshake it has done.
type Dialer func(ctx context.Context, addr string) (net.Conn, error)

// Pool keeps one multiplexed Client per peer address, dialed on the
// first call and dialed again on the first call after it failed. Calls
// to one address share its connection.
//
// Locking: mu guards the map of peers; each peer's own mutex guards its
// Client and the dial in progress. Lock order: Pool.mu before peer.mu. No lock is held while dialing or
// calling; concurrent first calls share one dial. Safe for concurrent
// use. Release with Close.
type Pool struct {
	dial Dialer
	mu   struct {
		sync.Mutex
		peers  map[string]*peer
		closed bool
	}
}

// peer is the connection state of one address.
type peer struct {
	mu      sync.Mutex
	client  *Client       // nil, or live or failed
	dialing chan struct{} // non-nil while a dial is under way; closed when it ends
	dialErr error         // the result of the last dial, read after dialing closes
}

// keepAlive is the TCP keepalive period of the default dialer.
const keepAlive = 15 * time.Second

// NewPool returns a Pool dialing with dial; nil dial is TCP with
// keepalive.
func NewPool(dial Dialer) *Pool {
	if dial == nil {
		d := &net.Dialer{KeepAlive: keepAlive}
		dial = func(ctx context.Context, addr string) (net.Conn, error) {
			return d.DialContext(ctx, "tcp", addr)
		}
	}
	p := &Pool{dial: dial}
	p.mu.peers = make(map[string]*peer)
	return p
}

// Call makes one call to addr, as Client.Call does, on the address's
// kept connection, dialing one first when there is none or it failed.
// A call that fails with ErrNotSent (the kept connection had died
// unnoticed) is tried once more on a new connection. Dial errors are
// returned wrapped with the address.
func (p *Pool) Call(ctx context.Context, addr string, req *Request, resp *Response) error {
	for attempt := 0; ; attempt++ {
		c, err := p.client(ctx, addr)
		if err != nil {
			return err
		}
		err = c.Call(ctx, req, resp)
		if err != nil && attempt == 0 && errors.Is(err, ErrNotSent) {
			continue
		}
		return err
	}
}

// client returns the live Client of addr, dialing when needed.
func (p *Pool) client(ctx context.Context, addr string) (*Client, error) {
	p.mu.Lock()
	if p.mu.closed {
		p.mu.Unlock()
		return nil, ErrClosed
	}
	pe := p.mu.peers[addr]
	if pe == nil {
		pe = &peer{}
		p.mu.peers[addr] = pe
	}
	p.mu.Unlock()

	dialed := false
	for {
		pe.mu.Lock()
		if pe.client != nil && !pe.client.dead() {
			c := pe.client
			pe.mu.Unlock()
			return c, nil
		}
		if wait := pe.dialing; wait != nil {
			pe.mu.Unlock()
			select {
			case <-wait:
			case <-ctx.Done():
				return nil, ctx.Err()
			}
			pe.mu.Lock()
			err := pe.dialErr
			pe.mu.Unlock()
			// Another caller's dial failed: share its error, unless it
			// was that caller's context, which is not ours.
			if err != nil && !errors.Is(err, context.Canceled) && !errors.Is(err, context.DeadlineExceeded) {
				return nil, err
			}
			continue
		}
		if dialed {
			pe.mu.Unlock()
			return nil, fmt.Errorf("protocol: peer %s: connection lost right after dialing", addr)
		}
		dialed = true
		old := pe.client
		pe.client = nil
		wait := make(chan struct{})
		pe.dialing = wait
		pe.mu.Unlock()

		if old != nil {
			old.Close() // failed already; waits for its goroutines
		}
		conn, err := p.dial(ctx, addr)
		if err != nil {
			err = fmt.Errorf("protocol: dialing %s: %w", addr, err)
		}
		// Under both locks, so that Close either sees the new Client or
		// is seen to have run.
		p.mu.Lock()
		closed := p.mu.closed || p.mu.peers[addr] != pe // closed, or dropped
		pe.mu.Lock()
		pe.dialing = nil
		pe.dialErr = err
		if err == nil && !closed {
			pe.client = NewClient(conn)
		}
		pe.mu.Unlock()
		p.mu.Unlock()
		close(wait)
		if err != nil {
			return nil, err
		}
		if closed {
			conn.Close()
			return nil, fmt.Errorf("protocol: peer %s: %w while dialing", addr, ErrClosed)
		}
	}
}

// Drop closes the kept connection to addr, if any, failing its pending
// calls: for a node that left the cluster. A later call dials again; a
// dial under way is closed when it ends and its call fails with an
// error wrapping ErrClosed.
func (p *Pool) Drop(addr string) {
	p.mu.Lock()
	pe := p.mu.peers[addr]
	delete(p.mu.peers, addr)
	p.mu.Unlock()
	if pe == nil {
		return
	}
	pe.mu.Lock()
	c := pe.client
	pe.client = nil
	pe.mu.Unlock()
	if c != nil {
		c.Close()
	}
}

// Close closes every kept connection, failing their pending calls; later
// calls return ErrClosed. A dial under way is closed when it ends, and
// its call fails with an error wrapping ErrClosed. A
// second Close returns ErrClosed.
func (p *Pool) Close() error {
	p.mu.Lock()
	if p.mu.closed {
		p.mu.Unlock()
		return ErrClosed
	}
	p.mu.closed = true
	peers := p.mu.peers
	p.mu.peers = nil
	p.mu.Unlock()
	for _, pe := range peers {
		pe.mu.Lock()
		c := pe.client
		pe.client = nil
		pe.mu.Unlock()
		if c != nil {
			c.Close()
		}
	}
	return nil
}
