package membership

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// Evict ends the registration of node id when it is registered at addr:
// its lease is revoked, so its key and every lock held under the lease
// go at once, and the live nodes write the next epoch without waiting
// for the lease to expire. It reports whether a registration was ended.
//
// Evicting a node that still serves would drop a live replica (it then
// fences itself when it finds its lease gone), so the caller must know
// that the node no longer serves: its port refused connections (nothing
// listens there), or the caller holds the node's data directory lock and
// is the node restarting.
func (c *Client) Evict(ctx context.Context, id, addr string) (bool, error) {
	if err := c.checkOpen(); err != nil {
		return false, err
	}
	key := c.k.node(id)
	resp, err := c.cli.Get(ctx, key)
	if err != nil {
		return false, fmt.Errorf("membership: evict %q: get %s: %w", id, key, err)
	}
	if len(resp.Kvs) == 0 {
		return false, nil
	}
	kv := resp.Kvs[0]
	var n NodeInfo
	if err := json.Unmarshal(kv.Value, &n); err != nil {
		return false, fmt.Errorf("membership: evict %q: %s: %w", id, key, err)
	}
	if n.Addr != addr || kv.Lease == 0 {
		return false, nil
	}
	if _, err := c.cli.Revoke(ctx, clientv3.LeaseID(kv.Lease)); err != nil {
		if errors.Is(err, rpctypes.ErrLeaseNotFound) {
			return false, nil
		}
		return false, fmt.Errorf("membership: evict %q: revoke lease %x: %w", id, kv.Lease, err)
	}
	c.log.Warn("evicted a node that no longer serves", "node", id, "addr", addr, "lease", fmt.Sprintf("%x", kv.Lease))
	return true, nil
}
