package node

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"syscall"

	"github.com/ovis-storage/ovis/cluster/gateway"
	"github.com/ovis-storage/ovis/cluster/protocol"
)

// AdminClient sends admin commands to one node.
type AdminClient struct {
	addr string
	pool *protocol.Pool
}

// DialAdmin returns a client for the node at addr, over mutual TLS when
// tlsCfg is not nil. It connects on first use.
func DialAdmin(addr string, tlsCfg *tls.Config) *AdminClient {
	var dial protocol.Dialer
	if tlsCfg != nil {
		dial = protocol.TLSDialer(tlsCfg)
	}
	return &AdminClient{addr: addr, pool: protocol.NewPool(dial)}
}

// Close closes the connection.
func (a *AdminClient) Close() error { return a.pool.Close() }

// Do runs one command: out receives the JSON result, and the raw bytes
// of the reply are returned.
func (a *AdminClient) Do(ctx context.Context, ar AdminRequest, data []byte, out any) ([]byte, error) {
	return callAdmin(ctx, a.pool, a.addr, ar, data, out, a.sendErr)
}

// sendErr words a request that did not reach the node or that the node
// refused, for the command line.
func (a *AdminClient) sendErr(err error) error {
	if errors.Is(err, syscall.ECONNREFUSED) {
		return fmt.Errorf("no ovis node at %s (connection refused): start one with ovis node, or name one with -a HOST:PORT", a.addr)
	}
	var pe *protocol.Error
	if errors.As(err, &pe) {
		return errors.New(pe.Msg)
	}
	return fmt.Errorf("node %s: %w", a.addr, err)
}

// callAdmin is the one framing of an admin command: ar and data go to
// addr as one OpAdmin request, and the reply is decoded (out receives
// the JSON result; the raw bytes are returned). sendErr, when not nil,
// words a failure to deliver the request or a refusal by the node; the
// command's own error comes back as the node gave it.
func callAdmin(ctx context.Context, pool gateway.Caller, addr string, ar AdminRequest, data []byte, out any, sendErr func(error) error) ([]byte, error) {
	p, err := EncodeAdmin(ar, data)
	if err != nil {
		return nil, err
	}
	var resp protocol.Response
	if err := pool.Call(ctx, addr, &protocol.Request{Op: protocol.OpAdmin, Length: uint32(len(p)), Payload: p}, &resp); err != nil {
		if sendErr != nil {
			return nil, sendErr(err)
		}
		return nil, err
	}
	return DecodeAdmin(resp.Payload, out)
}
