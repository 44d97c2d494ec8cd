package membership

import (
	"context"
	"fmt"
	"strconv"
	"strings"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// keyRecovered holds, per node, the last epoch whose recovery the node
// completed: "recovered/<node id>" = the epoch in decimal. A node writes
// only its own key, and only raises it; the key outlives the node's
// lease, so that a node that returns knows where it stood, and a copy
// is dropped only once every new holder is known to have it
// (recovery.MayDrop).
const keyRecovered = "recovered/"

// keyClean holds, per node, the last epoch after whose recovery the node
// also dropped every copy it was no longer placed for: "clean/<node
// id>". Once every node's is at least a tombstone's epoch, no node holds
// a copy the tombstone removed, and the tombstone may go.
const keyClean = "clean/"

func (k keys) recovered() string { return k.prefix + keyRecovered }
func (k keys) clean() string     { return k.prefix + keyClean }

// SetRecovered records that node id completed recovery of epoch e. A
// lower epoch than the one recorded changes nothing.
func (c *Client) SetRecovered(ctx context.Context, id string, e uint64) error {
	return c.raise(ctx, c.k.recovered()+id, "recovered epoch of "+id, e)
}

// SetClean records that node id holds no copy it is not placed for as of
// epoch e. A lower epoch than the one recorded changes nothing.
func (c *Client) SetClean(ctx context.Context, id string, e uint64) error {
	return c.raise(ctx, c.k.clean()+id, "clean epoch of "+id, e)
}

// Clean returns every node's clean epoch (see SetClean).
func (c *Client) Clean(ctx context.Context) (map[string]uint64, error) {
	return c.epochsUnder(ctx, c.k.clean(), "clean epochs")
}

// raise sets key to e unless it holds a higher epoch.
func (c *Client) raise(ctx context.Context, key, what string, e uint64) error {
	if err := c.checkOpen(); err != nil {
		return err
	}
	id := what
	for {
		resp, err := c.cli.Get(ctx, key)
		if err != nil {
			return fmt.Errorf("membership: %s: get: %w", id, err)
		}
		var mod int64
		if len(resp.Kvs) > 0 {
			old, err := strconv.ParseUint(string(resp.Kvs[0].Value), 10, 64)
			if err == nil && old >= e {
				return nil
			}
			mod = resp.Kvs[0].ModRevision
		}
		t, err := c.cli.Txn(ctx).
			If(clientv3.Compare(clientv3.ModRevision(key), "=", mod)).
			Then(clientv3.OpPut(key, strconv.FormatUint(e, 10))).
			Commit()
		if err != nil {
			return fmt.Errorf("membership: %s: put: %w", id, err)
		}
		if t.Succeeded {
			return nil
		}
	}
}

// Recovered returns every node's last completely recovered epoch.
func (c *Client) Recovered(ctx context.Context) (map[string]uint64, error) {
	return c.epochsUnder(ctx, c.k.recovered(), "recovered epochs")
}

// epochsUnder reads the per-node epochs under prefix.
func (c *Client) epochsUnder(ctx context.Context, prefix, what string) (map[string]uint64, error) {
	if err := c.checkOpen(); err != nil {
		return nil, err
	}
	resp, err := c.cli.Get(ctx, prefix, clientv3.WithPrefix())
	if err != nil {
		return nil, fmt.Errorf("membership: %s: %w", what, err)
	}
	out := make(map[string]uint64, len(resp.Kvs))
	for _, kv := range resp.Kvs {
		e, err := strconv.ParseUint(string(kv.Value), 10, 64)
		if err != nil {
			return nil, fmt.Errorf("membership: %s: %s=%q: %w", what, kv.Key, kv.Value, err)
		}
		out[strings.TrimPrefix(string(kv.Key), prefix)] = e
	}
	return out, nil
}
