package node

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ovis-storage/ovis/cluster/object"
	"github.com/ovis-storage/ovis/cluster/store"
)

// agreeWait bounds the checksums of one agreement check.
const agreeWait = 2 * time.Second

// agreed reports whether obj's copy here is known current in epoch e
// and every other replica of obj in e holds the same bytes (a CRC32C of
// the whole copy; no copy, or a removed one, agrees only with the same),
// none suspect: the copies agree, so that a gate of an older epoch or a
// hide over obj may go (gate release rule 2) without a reader here
// seeing a write that a reader of another replica would miss. Bytes, not
// versions: a replica that took writes while it pulled the object
// applies them again on top and ends a version ahead of its peers with
// the same bytes. A copy that got an unacknowledged write its peers
// lack differs until their recovery pulls it; one with a write in
// flight differs until it lands everywhere. Any error, or a node that
// does not answer, is a no: the gate stays (at most GateMaxAge).
func (r *recoverer) agreed(obj object.ID, e uint64) bool {
	ok, why := r.agree(obj, e)
	if !ok {
		r.noteDisagreement(obj, why)
	}
	return ok
}

// disagreeLog is how often at most one object's disagreement is logged.
const disagreeLog = 10 * time.Second

// noteDisagreement logs why obj's copies do not agree, at most once per
// disagreeLog per object: a gate or hide that stays says why.
func (r *recoverer) noteDisagreement(obj object.ID, why string) {
	now := r.clock()
	r.mu.Lock()
	if r.disagreed == nil {
		r.disagreed = map[object.ID]time.Time{}
	}
	last, seen := r.disagreed[obj]
	if seen && now.Sub(last) < disagreeLog {
		r.mu.Unlock()
		return
	}
	r.disagreed[obj] = now
	if len(r.disagreed) > 4096 {
		clear(r.disagreed) // a bound, not a history
	}
	r.mu.Unlock()
	r.log.Info("gate kept: the copies do not agree yet", "object", obj.String(), "why", why)
}

// agree is agreed, with why not.
func (r *recoverer) agree(obj object.ID, e uint64) (bool, string) {
	if !r.current(obj, e) {
		return false, "this copy is not known current"
	}
	v := r.views.View()
	if v.Epoch != e {
		return false, fmt.Sprintf("the node moved from epoch %d to %d", e, v.Epoch)
	}
	ctx, cancel := context.WithTimeout(context.Background(), agreeWait)
	defer cancel()
	reps, err := r.replicas(ctx, v, obj)
	if err != nil {
		return false, err.Error()
	}
	// none: the node holds nothing of obj, or a tombstone.
	type sum struct {
		crc  uint32
		none bool
	}
	var own sum
	crc, _, err := r.st.Checksum(obj)
	switch {
	case errors.Is(err, store.ErrNotFound):
		own.none = true
	case err != nil:
		return false, "this copy: " + err.Error()
	default:
		own.crc = crc
	}
	for _, id := range reps {
		if id == r.id {
			continue
		}
		crc, _, none, err := r.peerChecksum(ctx, v, id, obj)
		if err != nil {
			return false, "replica " + id + ": " + err.Error()
		}
		in := sum{crc: crc, none: none}
		if in != own {
			return false, fmt.Sprintf("replica %s holds %+v, this node %+v", id, in, own)
		}
	}
	return true, ""
}
