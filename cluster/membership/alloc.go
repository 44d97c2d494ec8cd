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

// keyUnsynced holds each VDI's unsynced set, the objects of its
// allocation map that no write was made durable to yet, in the
// allocation map's encoding: "unsynced/<vdi id, 8 hex>/<chunk, 8 hex>".
// MarkAllocated adds an object to both in one transaction; the writer
// takes it out (MarkSynced) once a write of it is durable on every
// replica, before it acknowledges that. So an object of the map that no
// node holds, once every node that may hold it answered, is a loss only
// when it is not in this set (a power loss took every replica's copy of
// writes never flushed otherwise, which nobody was told were safe).
const keyUnsynced = "unsynced/"

func (k keys) allocs(id object.VDI) string {
	return fmt.Sprintf("%s%s%08x/", k.prefix, keyAlloc, uint32(id))
}
func (k keys) alloc(id object.VDI, chunk uint32) string {
	return fmt.Sprintf("%s%08x", k.allocs(id), chunk)
}
func (k keys) unsynceds(id object.VDI) string {
	return fmt.Sprintf("%s%s%08x/", k.prefix, keyUnsynced, uint32(id))
}
func (k keys) unsynced(id object.VDI, chunk uint32) string {
	return fmt.Sprintf("%s%08x", k.unsynceds(id), chunk)
}

// Allocated returns VDI id's allocation map: the indices of its objects
// that may hold data. A VDI that keeps none (VDI.Allocation false) has
// an empty one.
func (c *Client) Allocated(ctx context.Context, id object.VDI) (*object.Set, error) {
	return c.readSet(ctx, id, c.k.allocs(id), c.k.alloc)
}

// readSet reads one of VDI id's object sets: the chunk keys under
// prefix, each named by key.
func (c *Client) readSet(ctx context.Context, id object.VDI, prefix string, key func(object.VDI, uint32) string) (*object.Set, error) {
	if err := c.checkOpen(); err != nil {
		return nil, err
	}
	resp, err := c.cli.Get(ctx, prefix, clientv3.WithPrefix())
	if err != nil {
		return nil, fmt.Errorf("membership: object set %s of vdi %d: %w", prefix, id, err)
	}
	var s object.Set
	for _, kv := range resp.Kvs {
		chunk, err := parseChunkKey(string(kv.Key), prefix)
		if err != nil {
			return nil, err
		}
		if k := key(id, chunk); k != string(kv.Key) {
			return nil, fmt.Errorf("membership: object set key %q: want %q", kv.Key, k)
		}
		if err := s.AddChunkBytes(chunk, kv.Value); err != nil {
			return nil, fmt.Errorf("membership: object set of vdi %d: %s: %w", id, kv.Key, err)
		}
	}
	return &s, nil
}

// MarkAllocated adds the objects idx of VDI id to its allocation map
// and to its unsynced set (Unsynced), in one transaction over the chunks
// they fall in (compared by revision, and tried again when another
// writer changed one meanwhile). It returns once etcd has the marks.
// With a token (not 0), the transaction also requires that the VDI's
// lock is still the one of that token, and fails with ErrNotLocked
// otherwise: a writer fenced off changes nothing, the map included.
func (c *Client) MarkAllocated(ctx context.Context, id object.VDI, token uint64, idx []uint32) error {
	return c.changeSets(ctx, id, token, idx, "mark objects of vdi %d allocated",
		setChange{c.k.alloc, true}, setChange{c.k.unsynced, true})
}

// UnmarkAllocated takes the objects idx of VDI id out of its allocation
// map (and its unsynced set), as MarkAllocated adds them; a chunk left
// empty is deleted. The caller must know that no node holds data of
// them (every replica removed them) and that no write of them is under
// way.
func (c *Client) UnmarkAllocated(ctx context.Context, id object.VDI, token uint64, idx []uint32) error {
	return c.changeSets(ctx, id, token, idx, "unmark objects of vdi %d",
		setChange{c.k.alloc, false}, setChange{c.k.unsynced, false})
}

// MarkSynced takes the objects idx of VDI id out of its unsynced set,
// under token's lock as MarkAllocated: the writer calls it once a write
// of each was made durable on every replica (a FUA write, or a flush
// after the write), before it acknowledges that durability.
func (c *Client) MarkSynced(ctx context.Context, id object.VDI, token uint64, idx []uint32) error {
	return c.changeSets(ctx, id, token, idx, "mark objects of vdi %d synced", setChange{c.k.unsynced, false})
}

// Unsynced returns VDI id's unsynced set: the objects of its allocation
// map that no write was ever made durable to (MarkSynced). Such an
// object that no node holds, once every node that may hold it answered,
// lost only writes that were never acknowledged durable (a power loss
// took them): it is no loss, and reads as zeros. Objects marked before
// the set existed are all synced, which is the strict answer.
func (c *Client) Unsynced(ctx context.Context, id object.VDI) (*object.Set, error) {
	return c.readSet(ctx, id, c.k.unsynceds(id), c.k.unsynced)
}

// setChange is one change of one of a VDI's object sets: add (or take
// out) the objects in the set whose chunk keys key names.
type setChange struct {
	key func(id object.VDI, chunk uint32) string
	add bool
}

// changeSets applies changes to idx, under token's lock.
func (c *Client) changeSets(ctx context.Context, id object.VDI, token uint64, idx []uint32, what string, changes ...setChange) error {
	if err := c.checkOpen(); err != nil {
		return err
	}
	byChunk := map[uint32][]uint32{}
	for _, i := range idx {
		byChunk[i/object.SetChunk] = append(byChunk[i/object.SetChunk], i)
	}
	type part struct {
		chunk uint32
		ch    setChange
	}
	var parts []part
	var gets []clientv3.Op
	for ch := range byChunk {
		for _, sc := range changes {
			parts = append(parts, part{ch, sc})
			gets = append(gets, clientv3.OpGet(sc.key(id, ch)))
		}
	}
	for {
		resp, err := c.cli.Txn(ctx).Then(gets...).Commit()
		if err != nil {
			return fmt.Errorf("membership: "+what+": %w", id, err)
		}
		var cmps []clientv3.Cmp
		var puts []clientv3.Op
		for j, p := range parts {
			key := p.ch.key(id, p.chunk)
			var s object.Set
			mod := int64(0)
			if kvs := resp.Responses[j].GetResponseRange().Kvs; len(kvs) > 0 {
				if err := s.AddChunkBytes(p.chunk, kvs[0].Value); err != nil {
					return fmt.Errorf("membership: object set of vdi %d: %s: %w", id, key, err)
				}
				mod = kvs[0].ModRevision
			}
			changed := false
			for _, i := range byChunk[p.chunk] {
				if p.ch.add {
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
			if b := s.ChunkBytes(p.chunk); b != nil {
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

// parseChunkKey reads the chunk number of an object set's key under
// prefix.
func parseChunkKey(key, prefix string) (uint32, error) {
	s, ok := strings.CutPrefix(key, prefix)
	if !ok || len(s) != 8 {
		return 0, fmt.Errorf("membership: object set key %q: want %s and 8 hex digits", key, prefix)
	}
	ch, err := strconv.ParseUint(s, 16, 32)
	if err != nil {
		return 0, fmt.Errorf("membership: object set key %q: %w", key, err)
	}
	if ch >= 1<<32/object.SetChunk {
		return 0, fmt.Errorf("membership: object set key %q: chunk %d past the last of a VDI", key, ch)
	}
	return uint32(ch), nil
}
