package node

import (
	"context"
	"errors"
	"time"

	"github.com/ovis-storage/ovis/cluster/object"
	"github.com/ovis-storage/ovis/cluster/protocol"
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
	if !r.current(obj, e) {
		return false
	}
	v := r.n.views.View()
	if v.Epoch != e {
		return false
	}
	ctx, cancel := context.WithTimeout(context.Background(), agreeWait)
	defer cancel()
	reps, err := r.replicas(ctx, v, obj)
	if err != nil {
		return false
	}
	// none: the node holds nothing of obj, or a tombstone.
	type sum struct {
		crc  uint32
		none bool
	}
	var own sum
	crc, _, err := r.n.st.Checksum(obj)
	switch {
	case errors.Is(err, store.ErrNotFound):
		own.none = true
	case err != nil:
		return false
	default:
		own.crc = crc
	}
	for _, id := range reps {
		if id == r.n.id {
			continue
		}
		addr, ok := v.Addr[id]
		if !ok {
			return false
		}
		var resp protocol.Response
		req := &protocol.Request{Op: protocol.OpChecksum, Flags: protocol.FlagRecovery, Epoch: v.Epoch, Object: obj, Length: protocol.MaxObjectSpan}
		err := r.n.net.Call(ctx, addr, req, &resp)
		var in sum
		switch {
		case protocol.StatusOf(err) == protocol.StatusNoEnt:
			in.none = true
		case err != nil:
			return false
		default:
			if in.crc, _, err = protocol.ParseChecksumReply(resp.Payload); err != nil {
				return false
			}
		}
		if in != own {
			return false
		}
	}
	return true
}
