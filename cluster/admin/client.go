package admin

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"syscall"

	"github.com/ovis-storage/ovis/cluster/protocol"
)

// Caller sends one request of the node protocol and waits for its
// response (protocol.Pool, or a node's own caller, which serves requests
// to itself in process).
type Caller interface {
	Call(ctx context.Context, addr string, req *protocol.Request, resp *protocol.Response) error
}

// Client sends admin requests to one node. Safe for concurrent use.
// Release one made by Dial with Close.
type Client struct {
	addr string
	net  Caller
	pool *protocol.Pool // Dial's own, closed by Close; nil for Via
	cli  bool           // words errors for the command line (Dial)
}

// Dial returns a client for the node at addr, for the command line and
// tools: it connects on first use, over mutual TLS when tlsCfg is not
// nil, and words a node that is not there as the command line says it.
func Dial(addr string, tlsCfg *tls.Config) *Client {
	var dial protocol.Dialer
	if tlsCfg != nil {
		dial = protocol.TLSDialer(tlsCfg)
	}
	p := protocol.NewPool(dial)
	return &Client{addr: addr, net: p, pool: p, cli: true}
}

// Via returns a client for the node at addr that sends through net, a
// node's own connections; Close is a no-op.
func Via(net Caller, addr string) *Client {
	return &Client{addr: addr, net: net}
}

// Addr is the node's address.
func (c *Client) Addr() string { return c.addr }

// Close closes the connections Dial opened.
func (c *Client) Close() error {
	if c.pool == nil {
		return nil
	}
	return c.pool.Close()
}

// Do sends req to the client's node as k's verb and returns its reply.
// A refusal by the node comes back as an error worded as the node
// worded it (protocol.StatusOf gives its status); a node that cannot be
// reached, as an error that names its address.
func (k Call[Req, Rep]) Do(ctx context.Context, c *Client, req Req) (Rep, error) {
	var rep Rep
	p, err := encodeRequest(k.Verb, req)
	if err != nil {
		return rep, err
	}
	var resp protocol.Response
	if err := c.net.Call(ctx, c.addr, &protocol.Request{Op: protocol.OpAdmin, Length: uint32(len(p)), Payload: p}, &resp); err != nil {
		return rep, c.sendErr(err)
	}
	if err := decodeReply(k.Verb, resp.Payload, &rep); err != nil {
		return rep, fmt.Errorf("node %s: %w", c.addr, err)
	}
	return rep, nil
}

// refusal is a node's refusal of a request: its text is the node's
// message alone, and it unwraps to the protocol error for its status.
type refusal struct{ pe *protocol.Error }

func (r *refusal) Error() string { return r.pe.Msg }
func (r *refusal) Unwrap() error { return r.pe }

// sendErr words a request that did not reach the node or that the node
// refused.
func (c *Client) sendErr(err error) error {
	var pe *protocol.Error
	if errors.As(err, &pe) {
		return &refusal{pe: pe}
	}
	if !c.cli {
		return err
	}
	if errors.Is(err, syscall.ECONNREFUSED) {
		return fmt.Errorf("no ovis node at %s (connection refused): start one with ovis node, or name one with -a HOST:PORT", c.addr)
	}
	return fmt.Errorf("node %s: %w", c.addr, err)
}
