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

func (k keys) recovered() string            { return k.prefix + keyRecovered }
func (k keys) recoveredOf(id string) string { return k.prefix + keyRecovered + id }

// SetRecovered records that node id completed recovery of epoch e. A
// lower epoch than the one recorded changes nothing.
func (c *Client) SetRecovered(ctx context.Context, id string, e uint64) error {
	if err := c.checkOpen(); err != nil {
		return err
	}
	key := c.k.recoveredOf(id)
	for {
		resp, err := c.cli.Get(ctx, key)
		if err != nil {
			return fmt.Errorf("membership: recovered epoch of %q: get: %w", id, err)
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
			return fmt.Errorf("membership: recovered epoch of %q: put: %w", id, err)
		}
		if t.Succeeded {
			return nil
		}
	}
}

// Recovered returns every node's last completely recovered epoch.
func (c *Client) Recovered(ctx context.Context) (map[string]uint64, error) {
	if err := c.checkOpen(); err != nil {
		return nil, err
	}
	resp, err := c.cli.Get(ctx, c.k.recovered(), clientv3.WithPrefix())
	if err != nil {
		return nil, fmt.Errorf("membership: recovered epochs: %w", err)
	}
	out := make(map[string]uint64, len(resp.Kvs))
	for _, kv := range resp.Kvs {
		e, err := strconv.ParseUint(string(kv.Value), 10, 64)
		if err != nil {
			return nil, fmt.Errorf("membership: recovered epoch %s=%q: %w", kv.Key, kv.Value, err)
		}
		out[strings.TrimPrefix(string(kv.Key), c.k.recovered())] = e
	}
	return out, nil
}
