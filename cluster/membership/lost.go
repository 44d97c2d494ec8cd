package membership

import (
	"context"
	"fmt"
	"strconv"
	"strings"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ovis-storage/ovis/cluster/object"
)

// keyLost holds, per object an operator gave up (`ovis cluster
// mark-lost`), the epoch up to which its unfound copies are given up:
// "lost/<object id, 16 hex digits>" = the epoch in decimal. Recovery
// then takes the absence of the nodes that were away up to that epoch as
// settled (recovery.Unfound starts after it): the object is decided from
// the copies the nodes that answer hold, and a returning holder's copy,
// of a lower rank, is replaced. Later epochs are judged as usual: the
// mark gives up what was unfound when it was made, nothing after.
const keyLost = "lost/"

func (k keys) lost() string { return k.prefix + keyLost }
func (k keys) lostObject(id object.ID) string {
	return k.prefix + keyLost + id.String()
}

// MarkLost records that the unfound copies of objs are given up up to
// epoch e. A mark of a later epoch replaces an earlier one; a lower one
// changes nothing.
func (c *Client) MarkLost(ctx context.Context, objs []object.ID, e uint64) error {
	for _, id := range objs {
		if err := c.raise(ctx, c.k.lostObject(id), "lost mark of object "+id.String(), e); err != nil {
			return err
		}
	}
	return nil
}

// Lost returns every object marked lost, with the epoch of its mark.
func (c *Client) Lost(ctx context.Context) (map[object.ID]uint64, error) {
	if err := c.checkOpen(); err != nil {
		return nil, err
	}
	resp, err := c.cli.Get(ctx, c.k.lost(), clientv3.WithPrefix())
	if err != nil {
		return nil, fmt.Errorf("membership: lost objects: %w", err)
	}
	out := make(map[object.ID]uint64, len(resp.Kvs))
	for _, kv := range resp.Kvs {
		s := strings.TrimPrefix(string(kv.Key), c.k.lost())
		id, err := object.Parse(s)
		if err != nil {
			return nil, fmt.Errorf("membership: lost objects: key %q: %w", kv.Key, err)
		}
		e, err := strconv.ParseUint(string(kv.Value), 10, 64)
		if err != nil {
			return nil, fmt.Errorf("membership: lost objects: %s=%q: %w", kv.Key, kv.Value, err)
		}
		out[id] = e
	}
	return out, nil
}
