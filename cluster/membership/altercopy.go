package membership

import (
	"context"
	"encoding/json"
	"fmt"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// A VDI's copies can change (AlterCopies, `ovis vdi alter-copy`). The
// rule that keeps every copy current across the change: a request in
// epoch E uses the copies the VDI had when E was written. A gateway that
// wrote N copies in an epoch whose record says N+1 would skip the new
// replica that recovery just made, and a later read there would be
// stale. So AlterCopies writes the record and a new epoch in one txn:
// every node refuses requests of the older epoch once it knows the new
// one (gateways place them again, with the new copies), and every node
// runs recovery for it (the new holders pull; the old ones drop).
//
// The record remembers earlier copies (CopiesBefore), so that any read
// of it made after epoch E was known gives E's copies (CopiesAt), also
// for a past epoch: readers need no read at E's exact revision, which
// compaction may have removed.

// CopiesChange is one earlier value of a VDI's copies: Copies held in
// the epochs below Until.
type CopiesChange struct {
	Until  uint64 `json:"until"`
	Copies int    `json:"copies"`
}

// MaxCopiesHistory bounds CopiesBefore: past that many changes the
// oldest is dropped, and CopiesKnownFrom says from which epoch on the
// record still knows its copies.
const MaxCopiesHistory = 64

// CopiesAt returns the copies the VDI had in epoch e, and whether the
// record knows them: false for an epoch older than the kept history
// (CopiesKnownFrom), where the oldest value kept is returned. A record
// read after epoch e was known to the reader gives e's copies: the
// change that made an epoch is written with it.
func (v VDI) CopiesAt(e uint64) (int, bool) {
	known := e >= v.CopiesKnownFrom
	for _, h := range v.CopiesBefore {
		if e < h.Until {
			return h.Copies, known
		}
	}
	return v.Copies, known
}

// AlterCopies sets the copies of the VDI named name to n, from a new
// epoch on: in one etcd txn it rewrites the record (the old copies go to
// CopiesBefore, until the new epoch) and writes the next epoch with the
// current epoch's nodes. n is validated as in CreateVDI: 1 to MaxCopies
// and at most the current view's zones. It returns the new record, and
// the record unchanged (no epoch written) when n is already the copies.
// Errors: ErrNoVDI, ErrNoEpoch, an ErrInvalid error naming n.
func (c *Client) AlterCopies(ctx context.Context, name string, n int) (VDI, error) {
	if err := validName(name); err != nil {
		return VDI{}, fmt.Errorf("membership: alter copies: vdi: %w", err)
	}
	nameKey := c.k.vdiName(name)
	for {
		// The epoch and the record at one revision, so that the txn's
		// guards see both as they were read.
		resp, err := c.cli.Txn(ctx).Then(clientv3.OpGet(c.k.epoch()), clientv3.OpGet(nameKey)).Commit()
		if err != nil {
			return VDI{}, fmt.Errorf("membership: alter copies of vdi %q: read: %w", name, err)
		}
		ekvs, vkvs := resp.Responses[0].GetResponseRange().Kvs, resp.Responses[1].GetResponseRange().Kvs
		if len(vkvs) == 0 {
			return VDI{}, fmt.Errorf("membership: alter copies: vdi %q: %w", name, ErrNoVDI)
		}
		if len(ekvs) == 0 {
			return VDI{}, fmt.Errorf("membership: alter copies of vdi %q: %w", name, ErrNoEpoch)
		}
		cur, err := decodeView(ekvs[0].Value)
		if err != nil {
			return VDI{}, err
		}
		v, err := decodeVDI(vkvs[0].Value)
		if err != nil {
			return VDI{}, err
		}
		if v.Copies == n {
			return v, nil
		}
		next := View{Epoch: cur.Epoch + 1, Nodes: cur.Nodes, Created: c.now().UTC()}
		nv := alterCopies(v, n, next.Epoch)
		if err := ValidateVDI(nv, Format{}, cur.Zones()); err != nil {
			return VDI{}, fmt.Errorf("membership: alter copies: %w", err)
		}
		b, err := json.Marshal(nv)
		if err != nil {
			return VDI{}, fmt.Errorf("membership: alter copies of vdi %q: %w", name, err)
		}
		cmps, ops, err := c.epochTxn(next, ekvs[0].ModRevision)
		if err != nil {
			return VDI{}, err
		}
		cmps = append(cmps, clientv3.Compare(clientv3.ModRevision(nameKey), "=", vkvs[0].ModRevision))
		ops = append(ops, clientv3.OpPut(nameKey, string(b)))
		tr, err := c.cli.Txn(ctx).If(cmps...).Then(ops...).Commit()
		if err != nil {
			return VDI{}, fmt.Errorf("membership: alter copies of vdi %q: %w", name, err)
		}
		if tr.Succeeded {
			c.log.Info("vdi copies altered", "vdi", name, "copies", n, "was", v.Copies, "epoch", next.Epoch)
			return nv, nil
		}
		// A new epoch or a change of the record came first: read again.
	}
}

// alterCopies returns v with n copies from epoch from on, its old copies
// kept for the epochs before. Pure.
func alterCopies(v VDI, n int, from uint64) VDI {
	nv := v
	nv.CopiesBefore = append(append([]CopiesChange(nil), v.CopiesBefore...), CopiesChange{Until: from, Copies: v.Copies})
	if drop := len(nv.CopiesBefore) - MaxCopiesHistory; drop > 0 {
		nv.CopiesKnownFrom = nv.CopiesBefore[drop-1].Until
		nv.CopiesBefore = nv.CopiesBefore[drop:]
	}
	nv.Copies = n
	return nv
}
