package node

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"syscall"

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
	p, err := EncodeAdmin(ar, data)
	if err != nil {
		return nil, err
	}
	var resp protocol.Response
	err = a.pool.Call(ctx, a.addr, &protocol.Request{Op: protocol.OpAdmin, Length: uint32(len(p)), Payload: p}, &resp)
	if err != nil {
		if errors.Is(err, syscall.ECONNREFUSED) {
			return nil, fmt.Errorf("no ovis node at %s (connection refused): start one with ovis node, or name one with -a HOST:PORT", a.addr)
		}
		var pe *protocol.Error
		if errors.As(err, &pe) {
			return nil, errors.New(pe.Msg)
		}
		return nil, fmt.Errorf("node %s: %w", a.addr, err)
	}
	return DecodeAdmin(resp.Payload, out)
}
