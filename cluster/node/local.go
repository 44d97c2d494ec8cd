package node

import (
	"context"
	"strings"

	"github.com/ovis-storage/ovis/cluster/protocol"
)

// localCaller is the gateway's network: requests for this node's own
// address go straight to its handler, in process (no socket, no framing,
// no checksum, and a read lands in the caller's buffer); the rest go
// through the pool. The handler sees the same request either way, epoch
// and token checks included.
type localCaller struct {
	self string
	h    *Handler
	pool *protocol.Pool
}

func (c *localCaller) Call(ctx context.Context, addr string, req *protocol.Request, resp *protocol.Response) error {
	if addr != c.self {
		return c.pool.Call(ctx, addr, req, resp)
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	c.h.Serve(ctx, req, resp)
	if resp.Status != protocol.StatusOK {
		return &protocol.Error{Status: resp.Status, Op: req.Op, Object: req.Object, Msg: strings.ToValidUTF8(string(resp.Payload), "\uFFFD")}
	}
	return nil
}
