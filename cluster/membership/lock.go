package membership

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"github.com/ovis-storage/ovis/cluster/object"
	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// Lock is a VDI's writer lock. Token is the lock key's create revision:
// etcd's revisions only grow, so each new lock of any VDI gets a larger
// token than every lock before it, and storage nodes refuse writes with
// a token below the highest they have seen for the VDI. Lease is the
// etcd lease the lock is held under (its holder's registration).
//
// Its JSON form (the admin commands' `ovis vdi lock list|break
// --output=json`) carries both; the stored record (lockRecord) carries
// neither, since etcd gives them.
type Lock struct {
	VDI    object.VDI `json:"vdi"`
	Name   string     `json:"name"`
	Holder string     `json:"holder"`
	Token  uint64     `json:"token"`
	Lease  int64      `json:"lease"`
}

// lockRecord is the stored value of a lock key.
type lockRecord struct {
	VDI    object.VDI `json:"vdi"`
	Name   string     `json:"name"`
	Holder string     `json:"holder"`
}

func decodeLock(kv *mvccpb.KeyValue) (Lock, error) {
	var r lockRecord
	if err := json.Unmarshal(kv.Value, &r); err != nil {
		return Lock{}, fmt.Errorf("membership: lock record %s %q: %w", kv.Key, kv.Value, err)
	}
	return Lock{VDI: r.VDI, Name: r.Name, Holder: r.Holder, Token: uint64(kv.CreateRevision), Lease: kv.Lease}, nil
}

// ownerRecord is the stored value of an owners/ key: who took the VDI's
// lock last, and under which lease. It outlives the lock (no lease), so
// that Relock can tell whether anyone took the lock after a holder lost
// it.
type ownerRecord struct {
	Holder string `json:"holder"`
	Lease  int64  `json:"lease"`
}

func ownerValue(holder string, lease int64) string {
	b, _ := json.Marshal(ownerRecord{Holder: holder, Lease: lease})
	return string(b)
}

// Lock takes the writer lock of the VDI named name for holder, under
// r's lease: it vanishes when the lease does. A lock the same holder
// already has under the same lease is returned as it is. Another holder
// gets a *LockedError naming it; an unknown VDI ErrNoVDI; a fenced
// registration ErrFenced.
func (c *Client) Lock(ctx context.Context, r *Registration, name, holder string) (Lock, error) {
	return c.lock(ctx, r, name, holder, nil)
}

// Relock takes the lock of the VDI named name again for old's holder,
// under r's lease, after old was lost with the lease it was held under
// (its node was cut off from etcd, or etcd lost its quorum, for longer
// than the lease). It succeeds only if nobody took the lock since old:
// otherwise it returns ErrTakenOver, and the caller must not write with
// what it knew of the VDI (another owner may have changed it). It fails
// as Lock does otherwise.
func (c *Client) Relock(ctx context.Context, r *Registration, name string, old Lock) (Lock, error) {
	return c.lock(ctx, r, name, old.Holder, &old)
}

func (c *Client) lock(ctx context.Context, r *Registration, name, holder string, old *Lock) (Lock, error) {
	if err := r.Err(); err != nil {
		return Lock{}, fmt.Errorf("membership: lock vdi %q: %w", name, err)
	}
	if holder == "" {
		return Lock{}, fmt.Errorf("membership: lock vdi %q: empty holder: %w", name, ErrInvalid)
	}
	for {
		v, create, _, err := c.getVDI(ctx, name)
		if err != nil {
			return Lock{}, fmt.Errorf("membership: lock: %w", err)
		}
		if old != nil && old.VDI != v.ID {
			return Lock{}, fmt.Errorf("membership: relock vdi %q: it was deleted and made again: %w", name, ErrTakenOver)
		}
		b, err := json.Marshal(lockRecord{VDI: v.ID, Name: v.Name, Holder: holder})
		if err != nil {
			return Lock{}, fmt.Errorf("membership: lock vdi %q: %w", name, err)
		}
		lk, ow := c.k.lock(v.ID), c.k.owner(v.ID)
		conds := []clientv3.Cmp{
			// The VDI is the one we read (not deleted and recreated).
			clientv3.Compare(clientv3.CreateRevision(c.k.vdiName(name)), "=", create),
			clientv3.Compare(clientv3.CreateRevision(lk), "=", 0),
		}
		if old != nil {
			conds = append(conds, clientv3.Compare(clientv3.Value(ow), "=", ownerValue(old.Holder, old.Lease)))
		}
		resp, err := c.cli.Txn(ctx).If(conds...).Then(
			clientv3.OpPut(lk, string(b), clientv3.WithLease(r.LeaseID())),
			clientv3.OpPut(ow, ownerValue(holder, int64(r.LeaseID()))),
			clientv3.OpGet(lk),
		).Else(
			clientv3.OpGet(ow),
			clientv3.OpGet(lk),
		).Commit()
		if err != nil {
			return Lock{}, fmt.Errorf("membership: lock vdi %q: %w", name, err)
		}
		get := resp.Responses[len(resp.Responses)-1].GetResponseRange()
		if len(get.Kvs) == 0 {
			if old != nil && !resp.Succeeded {
				if o := resp.Responses[0].GetResponseRange().Kvs; len(o) == 0 || string(o[0].Value) != ownerValue(old.Holder, old.Lease) {
					return Lock{}, fmt.Errorf("membership: relock vdi %q: %w", name, ErrTakenOver)
				}
			}
			continue // the VDI changed, or the lock went between: again
		}
		l, err := decodeLock(get.Kvs[0])
		if err != nil {
			return Lock{}, err
		}
		if resp.Succeeded || l.Holder == holder && l.Lease == int64(r.LeaseID()) {
			return l, nil
		}
		return Lock{}, fmt.Errorf("membership: lock: %w", &LockedError{Name: name, Holder: l.Holder})
	}
}

// Unlock releases l. It returns ErrNotLocked when the lock is no
// longer l (broken, or gone with its lease).
func (c *Client) Unlock(ctx context.Context, l Lock) error {
	lk := c.k.lock(l.VDI)
	resp, err := c.cli.Txn(ctx).
		If(clientv3.Compare(clientv3.CreateRevision(lk), "=", int64(l.Token))).
		Then(clientv3.OpDelete(lk)).
		Commit()
	if err != nil {
		return fmt.Errorf("membership: unlock vdi %q: %w", l.Name, err)
	}
	// A zero token compares equal to a missing key: count the delete.
	if !resp.Succeeded || resp.Responses[0].GetResponseDeleteRange().Deleted == 0 {
		return fmt.Errorf("membership: unlock vdi %q token %d: %w", l.Name, l.Token, ErrNotLocked)
	}
	return nil
}

// Locks returns every held lock, sorted by VDI name. The caller owns
// the slice.
func (c *Client) Locks(ctx context.Context) ([]Lock, error) {
	resp, err := c.cli.Get(ctx, c.k.locks(), clientv3.WithPrefix())
	if err != nil {
		return nil, fmt.Errorf("membership: list locks: %w", err)
	}
	ls := make([]Lock, 0, len(resp.Kvs))
	for _, kv := range resp.Kvs {
		l, err := decodeLock(kv)
		if err != nil {
			return nil, err
		}
		ls = append(ls, l)
	}
	sortLocks(ls)
	return ls, nil
}

// LockOf returns the lock of the VDI named name, or ErrNotLocked.
func (c *Client) LockOf(ctx context.Context, name string) (Lock, error) {
	v, err := c.GetVDI(ctx, name)
	if err != nil {
		return Lock{}, err
	}
	resp, err := c.cli.Get(ctx, c.k.lock(v.ID))
	if err != nil {
		return Lock{}, fmt.Errorf("membership: get lock of vdi %q: %w", name, err)
	}
	if len(resp.Kvs) == 0 {
		return Lock{}, fmt.Errorf("membership: vdi %q: %w", name, ErrNotLocked)
	}
	return decodeLock(resp.Kvs[0])
}

// BreakLock deletes the lock of the VDI named name, whoever holds it,
// and returns what it deleted. The holder's lease is left alone (it may
// be a live node's). The next Lock gets a larger token, so storage
// nodes refuse the old holder's writes once the new holder has shown
// them its token. It returns ErrNotLocked when there is no lock.
func (c *Client) BreakLock(ctx context.Context, name string) (Lock, error) {
	for {
		l, err := c.LockOf(ctx, name)
		if err != nil {
			return Lock{}, fmt.Errorf("membership: break lock: %w", err)
		}
		lk := c.k.lock(l.VDI)
		resp, err := c.cli.Txn(ctx).
			If(clientv3.Compare(clientv3.CreateRevision(lk), "=", int64(l.Token))).
			Then(clientv3.OpDelete(lk)).
			Commit()
		if err != nil {
			return Lock{}, fmt.Errorf("membership: break lock of vdi %q: %w", name, err)
		}
		if resp.Succeeded {
			c.log.Warn("lock broken", "vdi", name, "holder", l.Holder, "token", l.Token)
			return l, nil
		}
		// The lock changed between the read and the delete: read again.
	}
}

// LockLost returns a channel closed once l is no longer the VDI's lock:
// unlocked, broken, or gone with its lease. It is not closed when ctx
// ends or the Client closes; the goroutine watching then just stops.
// A gateway uses it to stop writing early, but the storage nodes'
// token check is what fences it.
func (c *Client) LockLost(ctx context.Context, l Lock) <-chan struct{} {
	lost := make(chan struct{})
	ctx, cancel := context.WithCancel(ctx)
	started := c.goTracked(func() {
		defer cancel()
		stop := context.AfterFunc(c.bg, cancel)
		defer stop()
		lk := c.k.lock(l.VDI)
		for ctx.Err() == nil {
			resp, err := c.cli.Get(ctx, lk)
			if err != nil {
				select {
				case <-time.After(200 * time.Millisecond):
				case <-ctx.Done():
				}
				continue
			}
			if len(resp.Kvs) == 0 || uint64(resp.Kvs[0].CreateRevision) != l.Token {
				close(lost)
				return
			}
			wc := c.cli.Watch(ctx, lk, clientv3.WithRev(resp.Header.Revision+1))
			for wr := range wc {
				if wr.Err() != nil {
					break // compacted or cancelled: read again
				}
				for _, ev := range wr.Events {
					if ev.Type == clientv3.EventTypeDelete || uint64(ev.Kv.CreateRevision) != l.Token {
						close(lost)
						return
					}
				}
			}
		}
	})
	if !started {
		cancel()
	}
	return lost
}

// Broken reports whether l is no longer the VDI's lock while the lease
// it was held under still lives: the lock was broken (BreakLock) or
// released, not lost with its holder's registration. It is false while
// l is still the lock, and false when l's lease is gone too (expired or
// revoked): the holder's node then fences itself, and Relock is its way
// back. A holder told true must stop writing under l's token.
func (c *Client) Broken(ctx context.Context, l Lock) (bool, error) {
	resp, err := c.cli.Get(ctx, c.k.lock(l.VDI))
	if err != nil {
		return false, fmt.Errorf("membership: lock of vdi %q: %w", l.Name, err)
	}
	if len(resp.Kvs) > 0 && uint64(resp.Kvs[0].CreateRevision) == l.Token {
		return false, nil
	}
	ttl, err := c.cli.TimeToLive(ctx, clientv3.LeaseID(l.Lease))
	if err != nil {
		return false, fmt.Errorf("membership: lease %x of vdi %q's lock: %w", l.Lease, l.Name, err)
	}
	return ttl.TTL > 0, nil
}
