// Package faultnet is a node-to-node network that tests can cut: each
// node dials through Net.Dialer(name), and Cut(a, b) makes every
// connection between nodes a and b fail at once, both ways, and refuses
// new ones until Heal(a, b). Drop(from, to) cuts the link too, but
// dials from one end to the other hang until their context ends, as
// into a blackholed route, where the other end's fail at once: the two
// ends of one cut see it at different speeds, as on a real network.
// Traffic to anything else (etcd, NBD clients) does not go through it,
// so a test can cut a node off its peers while it still reaches etcd.
//
// Locking: mu guards cut, drop, names and conns; it is never held while
// dialing or closing a connection.
package faultnet

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
)

// ErrCut is the error of a dial or a connection between cut nodes.
var ErrCut = errors.New("faultnet: cut")

// Net is the network of one test cluster. The zero value is not usable;
// use New. Safe for concurrent use.
type Net struct {
	mu    sync.Mutex
	cut   map[[2]string]bool
	drop  map[[2]string]bool // from, to: dials hang
	names map[string]string  // listen address → node name
	// conns is every open connection: who dialed it, and where to (an
	// address, named at Cut time, so that connections dialed before
	// Name are cut too).
	conns map[*conn]struct{}
}

// New returns a network with nothing cut.
func New() *Net {
	return &Net{cut: map[[2]string]bool{}, drop: map[[2]string]bool{}, names: map[string]string{}, conns: map[*conn]struct{}{}}
}

func pair(a, b string) [2]string {
	if a > b {
		a, b = b, a
	}
	return [2]string{a, b}
}

// Name says that the node called name listens at addr.
func (n *Net) Name(addr, name string) {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.names[addr] = name
}

// Cut cuts a off b, both ways: their connections fail now, and new ones
// are refused until Heal.
func (n *Net) Cut(a, b string) {
	n.mu.Lock()
	n.cutLocked(pair(a, b))
}

// Drop cuts from off to as Cut does, except that from's dials to to
// hang until their context ends instead of failing.
func (n *Net) Drop(from, to string) {
	n.mu.Lock()
	n.drop[[2]string{from, to}] = true
	n.cutLocked(pair(from, to))
}

// cutLocked marks p cut, unlocks mu and closes p's connections.
func (n *Net) cutLocked(p [2]string) {
	n.cut[p] = true
	var doomed []*conn
	for c := range n.conns {
		if pair(c.from, n.names[c.addr]) == p {
			doomed = append(doomed, c)
		}
	}
	n.mu.Unlock()
	for _, c := range doomed {
		c.Close()
	}
}

// Heal ends the cut between a and b.
func (n *Net) Heal(a, b string) {
	n.mu.Lock()
	defer n.mu.Unlock()
	delete(n.cut, pair(a, b))
	delete(n.drop, [2]string{a, b})
	delete(n.drop, [2]string{b, a})
}

// Dialer returns the dialer of the node called from (a
// protocol.Dialer).
func (n *Net) Dialer(from string) func(ctx context.Context, addr string) (net.Conn, error) {
	var d net.Dialer
	return func(ctx context.Context, addr string) (net.Conn, error) {
		n.mu.Lock()
		to := n.names[addr]
		p := pair(from, to)
		cut, drop := n.cut[p], n.drop[[2]string{from, to}]
		n.mu.Unlock()
		if drop {
			<-ctx.Done()
			return nil, fmt.Errorf("faultnet: dial %s (%s) from %s: %w (%w)", addr, to, from, ErrCut, ctx.Err())
		}
		if cut {
			return nil, fmt.Errorf("faultnet: dial %s (%s) from %s: %w", addr, to, from, ErrCut)
		}
		c, err := d.DialContext(ctx, "tcp", addr)
		if err != nil {
			return nil, err
		}
		n.mu.Lock()
		if n.cut[p] { // cut while dialing
			n.mu.Unlock()
			c.Close()
			return nil, fmt.Errorf("faultnet: dial %s (%s) from %s: %w", addr, to, from, ErrCut)
		}
		fc := &conn{Conn: c, n: n, from: from, addr: addr}
		n.conns[fc] = struct{}{}
		n.mu.Unlock()
		return fc, nil
	}
}

// conn forgets itself when closed.
type conn struct {
	net.Conn
	n          *Net
	from, addr string
}

func (c *conn) Close() error {
	c.n.mu.Lock()
	delete(c.n.conns, c)
	c.n.mu.Unlock()
	return c.Conn.Close()
}
