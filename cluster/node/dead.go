package node

import (
	"context"
	"errors"
	"net"
	"sync"
	"syscall"
	"time"
)

// deadNodes acts on the gateway's reports of nodes whose port refused a
// connection. A refused connection means nothing listens at the node's
// address: the node died or stopped serving. Waiting for its lease to
// expire would stall every write to its objects for the lease's TTL, so
// the node checks the refusal itself, twice, and evicts the node from
// the membership (membership.Client.Evict); the next epoch then comes at
// once. A node that is only unreachable (a partition: no refusal, just
// silence) is left to its lease, which is the only safe judge there.
type deadNodes struct {
	n *Node

	mu   sync.Mutex
	last map[string]time.Time // node ID → when a check last began
}

// report is the gateway's Config.Dead: it never blocks.
func (d *deadNodes) report(id string) {
	if id == d.n.id {
		return
	}
	addr := d.n.views.View().Addr[id]
	if addr == "" {
		return
	}
	now := time.Now()
	d.mu.Lock()
	if t, ok := d.last[id]; ok && now.Sub(t) < time.Second {
		d.mu.Unlock()
		return
	}
	d.last[id] = now
	d.mu.Unlock()
	d.n.spawn(func() {
		for i := 0; i < 2; i++ {
			if i > 0 {
				time.Sleep(50 * time.Millisecond)
			}
			if !refuses(addr) {
				return
			}
		}
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
		defer cancel()
		if ok, err := d.n.mc.Evict(ctx, id, addr); err != nil {
			d.n.log.Warn("could not evict a node whose port refuses connections", "peer", id, "addr", addr, "err", err)
		} else if ok {
			d.n.log.Warn("evicted a node whose port refuses connections", "peer", id, "addr", addr)
		}
	})
}

// refuses reports whether a TCP connection to addr is refused.
func refuses(addr string) bool {
	c, err := net.DialTimeout("tcp", addr, time.Second)
	if err == nil {
		c.Close()
		return false
	}
	return errors.Is(err, syscall.ECONNREFUSED)
}
