package membership

import (
	"context"
	"fmt"
	"strconv"
	"strings"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ovis-storage/ovis/cluster/object"
)

// keyAlloc holds each VDI's allocation map, the objects of the VDI that
// may hold data: "alloc/<vdi id, 8 hex>/<chunk, 8 hex>" =
// object.Set.ChunkBytes of that chunk (bit i%8 of byte i/8 is object
// chunk*object.SetChunk+i; trailing zero bytes cut). A writer's gateway
// adds an object before any replica gets a write of it, and nothing
// takes one out while the VDI lives, so an object not in the map was
// never written: its absence from every node is no loss. The map is
// what lets `cluster check` tell a lost object from one never written.
// DeleteVDI deletes it with the record.
const keyAlloc = "alloc/"

func (k keys) allocs(id object.VDI) string {
	return fmt.Sprintf("%s%s%08x/", k.prefix, keyAlloc, uint32(id))
}
func (k keys) alloc(id object.VDI, chunk uint32) string {
	return fmt.Sprintf("%s%08x", k.allocs(id), chunk)
}

// Allocated returns VDI id's allocation map: the indices of its objects
// that may hold data. A VDI that keeps none (VDI.Allocation false) has
// an empty one.
func (c *Client) Allocated(ctx context.Context, id object.VDI) (*object.Set, error) {
	if err := c.checkOpen(); err != nil {
		return nil, err
	}
	resp, err := c.cli.Get(ctx, c.k.allocs(id), clientv3.WithPrefix())
	if err != nil {
		return nil, fmt.Errorf("membership: allocation map of vdi %d: %w", id, err)
	}
	var s object.Set
	for _, kv := range resp.Kvs {
		chunk, err := c.k.parseAllocKey(id, string(kv.Key))
		if err != nil {
			return nil, err
		}
		if err := s.AddChunkBytes(chunk, kv.Value); err != nil {
			return nil, fmt.Errorf("membership: allocation map of vdi %d: %s: %w", id, kv.Key, err)
		}
	}
	return &s, nil
}

// MarkAllocated adds the objects idx of VDI id to its allocation map,
// in one transaction over the chunks they fall in (compared by
// revision, and tried again when another writer changed one meanwhile).
// It returns once etcd has the marks. With a token (not 0), the
// transaction also requires that the VDI's lock is still the one of that
// token, and fails with ErrNotLocked otherwise: a writer fenced off
// changes nothing, the map included.
func (c *Client) MarkAllocated(ctx context.Context, id object.VDI, token uint64, idx []uint32) error {
	return c.changeAllocated(ctx, id, token, idx, true)
}

// UnmarkAllocated takes the objects idx of VDI id out of its allocation
// map, as MarkAllocated adds them; a chunk left empty is deleted. The
// caller must know that no node holds data of them (every replica
// removed them) and that no write of them is under way.
func (c *Client) UnmarkAllocated(ctx context.Context, id object.VDI, token uint64, idx []uint32) error {
	return c.changeAllocated(ctx, id, token, idx, false)
}

// changeAllocated adds (mark) or takes out idx, under token's lock.
func (c *Client) changeAllocated(ctx context.Context, id object.VDI, token uint64, idx []uint32, mark bool) error {
	if err := c.checkOpen(); err != nil {
		return err
	}
	what := "mark objects of vdi %d allocated"
	if !mark {
		what = "unmark objects of vdi %d"
	}
	byChunk := map[uint32][]uint32{}
	for _, i := range idx {
		byChunk[i/object.SetChunk] = append(byChunk[i/object.SetChunk], i)
	}
	chunks := make([]uint32, 0, len(byChunk))
	gets := make([]clientv3.Op, 0, len(byChunk))
	for ch := range byChunk {
		chunks = append(chunks, ch)
		gets = append(gets, clientv3.OpGet(c.k.alloc(id, ch)))
	}
	for {
		resp, err := c.cli.Txn(ctx).Then(gets...).Commit()
		if err != nil {
			return fmt.Errorf("membership: "+what+": %w", id, err)
		}
		var cmps []clientv3.Cmp
		var puts []clientv3.Op
		for j, ch := range chunks {
			key := c.k.alloc(id, ch)
			var s object.Set
			mod := int64(0)
			if kvs := resp.Responses[j].GetResponseRange().Kvs; len(kvs) > 0 {
				if err := s.AddChunkBytes(ch, kvs[0].Value); err != nil {
					return fmt.Errorf("membership: allocation map of vdi %d: %s: %w", id, key, err)
				}
				mod = kvs[0].ModRevision
			}
			changed := false
			for _, i := range byChunk[ch] {
				if mark {
					changed = s.Add(i) || changed
				} else {
					changed = s.Remove(i) || changed
				}
			}
			if !changed {
				continue
			}
			if mod == 0 {
				cmps = append(cmps, clientv3.Compare(clientv3.CreateRevision(key), "=", 0))
			} else {
				cmps = append(cmps, clientv3.Compare(clientv3.ModRevision(key), "=", mod))
			}
			if b := s.ChunkBytes(ch); b != nil {
				puts = append(puts, clientv3.OpPut(key, string(b)))
			} else {
				puts = append(puts, clientv3.OpDelete(key))
			}
		}
		if len(puts) == 0 {
			return nil // nothing to change
		}
		lk := c.k.lock(id)
		if token != 0 {
			cmps = append(cmps, clientv3.Compare(clientv3.CreateRevision(lk), "=", int64(token)))
		}
		tr, err := c.cli.Txn(ctx).If(cmps...).Then(puts...).Else(clientv3.OpGet(lk)).Commit()
		if err != nil {
			return fmt.Errorf("membership: "+what+": %w", id, err)
		}
		if tr.Succeeded {
			return nil
		}
		if kvs := tr.Responses[0].GetResponseRange().Kvs; token != 0 && (len(kvs) == 0 || uint64(kvs[0].CreateRevision) != token) {
			return fmt.Errorf("membership: "+what+" under token %d: %w", id, token, ErrNotLocked)
		}
	}
}

// parseAllocKey reads the chunk number of one of VDI id's alloc/ keys.
func (k keys) parseAllocKey(id object.VDI, key string) (uint32, error) {
	s, ok := strings.CutPrefix(key, k.allocs(id))
	if !ok || len(s) != 8 {
		return 0, fmt.Errorf("membership: allocation key %q: want %s and 8 hex digits", key, k.allocs(id))
	}
	ch, err := strconv.ParseUint(s, 16, 32)
	if err != nil {
		return 0, fmt.Errorf("membership: allocation key %q: %w", key, err)
	}
	if ch >= 1<<32/object.SetChunk {
		return 0, fmt.Errorf("membership: allocation key %q: chunk %d past the last of a VDI", key, ch)
	}
	return uint32(ch), nil
}
