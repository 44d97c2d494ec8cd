package membership

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// A node that will never come back (its disk died) still counts for
// recovery: a tombstone is forgotten only once every node that ever
// recovered is clean past it, so its absence keeps tombstones forever.
// RemoveNode ends its part: its recovered/ and clean/ records go, and a
// removed/ record makes sure it never returns with its old copies. Once
// the others have forgotten tombstones it never saw, those copies would
// bring deleted data back.

// keyRemoved holds the nodes removed for good: "removed/<node id>" = a
// JSON Removal. Join refuses those IDs.
const keyRemoved = "removed/"

func (k keys) removed(id string) string { return k.prefix + keyRemoved + id }

// Removal is the record of a removed node.
type Removal struct {
	ID      string    `json:"id"`
	Removed time.Time `json:"removed"`
}

var (
	// ErrNodeLive means RemoveNode was asked to remove a node that is
	// registered: it must be stopped (or its lease expire) first.
	ErrNodeLive = errors.New("node is live; stop it first")
	// ErrNoNode means the cluster has no record of the node: it never
	// recovered an epoch, and is not live.
	ErrNoNode = errors.New("no such node")
	// ErrRemovedNode means the node's ID was removed from the cluster
	// (RemoveNode): it can never join again under that ID.
	ErrRemovedNode = errors.New("node was removed from the cluster (ovis node remove); its copies may hold data deleted since, so it may not rejoin: " +
		"start it on an empty data directory (without --id), which gives it a new ID")
)

// RemoveNode removes the node id for good: in one txn, if no node is
// registered under id, it deletes the node's recovered/ and clean/
// records, writes removed/<id>, and writes a new epoch with the current
// epoch's nodes. From then on recovery no longer waits for the node, and
// the new epoch makes every node run it: each is then clean past every
// tombstone made so far, and forgets those no other node needs. Join
// refuses the ID with ErrRemovedNode. Removing a removed node again
// succeeds and changes nothing. Errors: ErrNodeLive naming the node's
// address, ErrNoNode for an ID the cluster has no record of, an
// ErrInvalid error for a malformed ID.
func (c *Client) RemoveNode(ctx context.Context, id string) error {
	if err := validName(id); err != nil {
		return fmt.Errorf("membership: remove node: %w", err)
	}
	if err := c.checkOpen(); err != nil {
		return err
	}
	node, rec, clean, rem := c.k.node(id), c.k.recovered()+id, c.k.clean()+id, c.k.removed(id)
	for {
		// What the cluster knows of the node (to refuse an ID that is
		// probably a typo) and the epoch, at one revision; the txn
		// below guards against the node joining and epochs meanwhile.
		kr, err := c.cli.Txn(ctx).Then(
			clientv3.OpGet(rec, clientv3.WithCountOnly()),
			clientv3.OpGet(clean, clientv3.WithCountOnly()),
			clientv3.OpGet(rem, clientv3.WithCountOnly()),
			clientv3.OpGet(c.k.epoch()),
		).Commit()
		if err != nil {
			return fmt.Errorf("membership: remove node %q: read its records: %w", id, err)
		}
		records := kr.Responses[0].GetResponseRange().Count+kr.Responses[1].GetResponseRange().Count > 0
		removed := kr.Responses[2].GetResponseRange().Count > 0
		cmps := []clientv3.Cmp{clientv3.Compare(clientv3.CreateRevision(node), "=", 0)}
		var ops []clientv3.Op // none for an unknown node: the txn only tells live from unknown
		if records {
			ops = append(ops, clientv3.OpDelete(rec), clientv3.OpDelete(clean))
			if ekvs := kr.Responses[3].GetResponseRange().Kvs; len(ekvs) > 0 {
				cur, err := decodeView(ekvs[0].Value)
				if err != nil {
					return err
				}
				// Same nodes, next number: every node runs recovery,
				// and records a clean epoch past every tombstone.
				ec, eo, err := c.epochTxn(View{Epoch: cur.Epoch + 1, Nodes: cur.Nodes, Created: c.now().UTC()}, ekvs[0].ModRevision)
				if err != nil {
					return err
				}
				cmps, ops = append(cmps, ec...), append(ops, eo...)
			}
		}
		if records && !removed {
			b, err := json.Marshal(Removal{ID: id, Removed: c.now().UTC()})
			if err != nil {
				return fmt.Errorf("membership: remove node %q: %w", id, err)
			}
			ops = append(ops, clientv3.OpPut(rem, string(b)))
		}
		resp, err := c.cli.Txn(ctx).If(cmps...).Then(ops...).Else(clientv3.OpGet(node)).Commit()
		if err != nil {
			return fmt.Errorf("membership: remove node %q: %w", id, err)
		}
		if !resp.Succeeded {
			kvs := resp.Responses[0].GetResponseRange().Kvs
			if len(kvs) == 0 {
				continue // a new epoch came first: read again
			}
			addr := "?"
			var n NodeInfo
			if json.Unmarshal(kvs[0].Value, &n) == nil {
				addr = n.Addr
			}
			return fmt.Errorf("membership: remove node %q: %w (registered at %s)", id, ErrNodeLive, addr)
		}
		switch {
		case records:
			c.log.Info("node removed", "node", id)
		case !removed:
			return fmt.Errorf("membership: remove node %q: %w: it never recovered an epoch", id, ErrNoNode)
		}
		return nil
	}
}

// Removed returns the removed nodes, by ID.
func (c *Client) Removed(ctx context.Context) (map[string]Removal, error) {
	if err := c.checkOpen(); err != nil {
		return nil, err
	}
	resp, err := c.cli.Get(ctx, c.k.prefix+keyRemoved, clientv3.WithPrefix())
	if err != nil {
		return nil, fmt.Errorf("membership: removed nodes: %w", err)
	}
	out := make(map[string]Removal, len(resp.Kvs))
	for _, kv := range resp.Kvs {
		var r Removal
		if err := json.Unmarshal(kv.Value, &r); err != nil {
			return nil, fmt.Errorf("membership: removed node record %s %q: %w", kv.Key, kv.Value, err)
		}
		out[r.ID] = r
	}
	return out, nil
}
