package node

import (
	"context"
	"errors"
	"time"

	"github.com/ovis-storage/ovis/cluster/object"
	"github.com/ovis-storage/ovis/cluster/protocol"
	"github.com/ovis-storage/ovis/cluster/store"
)

// agreeWait bounds the stats of one agreement check.
const agreeWait = 2 * time.Second

// agreed reports whether obj's copy here is known current in epoch e
// and every other replica of obj in e holds a copy of the same version,
// neither suspect: the copies agree, so that a gate of an older epoch
// over obj may go (gate release rule 2) without a reader here seeing a
// write that a reader of another replica would miss. A copy that got an
// unacknowledged write its peers lack is newer than theirs until their
// recovery pulls it. Any error, or a node that does not answer, is a
// no: the gate stays (at most GateMaxAge).
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
	own, err := r.n.st.Stat(obj)
	if err != nil && !errors.Is(err, store.ErrNotFound) || own.Suspect {
		return false
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
		req := &protocol.Request{Op: protocol.OpStat, Flags: protocol.FlagRecovery, Epoch: v.Epoch, Object: obj}
		err := r.n.net.Call(ctx, addr, req, &resp)
		var in protocol.ObjectInfo // a replica without the object: version 0
		switch {
		case protocol.StatusOf(err) == protocol.StatusNoEnt:
		case err != nil:
			return false
		default:
			infos, err := protocol.ParseObjectInfos(nil, resp.Payload)
			if err != nil || len(infos) != 1 {
				return false
			}
			in = infos[0]
		}
		if in.Suspect || in.Version != own.Version || in.Tombstone != own.Tombstone {
			return false
		}
	}
	return true
}
