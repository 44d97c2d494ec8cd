package node

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ovis-storage/ovis/cluster/object"
	"github.com/ovis-storage/ovis/cluster/protocol"
	"github.com/ovis-storage/ovis/cluster/store"
)

// Epochs is the node's own knowledge of the membership epoch.
type Epochs interface {
	// Epoch is the newest epoch the node knows.
	Epoch() uint64
	// AwaitEpoch returns once the node knows epoch e or a newer one, or
	// with ctx's error.
	AwaitEpoch(ctx context.Context, e uint64) error
}

// Handler serves the node-to-node protocol from a local store. It checks
// every request's epoch against the node's and leaves fencing tokens to
// the store, which keeps the highest one per VDI durably.
type Handler struct {
	Store  *store.Store
	Epochs Epochs
	// CatchUp bounds how long a request from a newer epoch waits for
	// this node to learn that epoch before it is refused with
	// StatusNewEpoch. Zero means 2 s.
	CatchUp time.Duration
	// Metrics, when not nil, counts requests.
	Metrics *Metrics
	// Admin, when not nil, serves OpAdmin.
	Admin func(ctx context.Context, req *protocol.Request, resp *protocol.Response)
	// Authority, when not nil, says whether this node may take an object
	// it does not hold as never written: nil when it has been one of the
	// object's replicas in every epoch since its VDI was created, so that
	// every write of it reached this node. Otherwise the object may live
	// on nodes that held it before a membership change, which recovery
	// (not written yet) would bring here: the node refuses to create it
	// and does not answer "no such object" for it, so that neither a
	// partial new copy nor zeros are ever served in place of its data.
	Authority func(ctx context.Context, obj object.ID) error
	// Live, when not nil, says whether the node's membership lease still
	// holds by its own clock; a node whose lease may have expired serves
	// nothing but HELLO and admin requests.
	Live func(now time.Time) bool
}

// authoritative applies Authority to an object the store does not hold.
func (h *Handler) authoritative(ctx context.Context, obj object.ID) error {
	if h.Authority == nil {
		return nil
	}
	return h.Authority(ctx, obj)
}

// mayCreate checks, before a write, that an object this node lacks may
// be created here.
func (h *Handler) mayCreate(ctx context.Context, obj object.ID) error {
	if _, err := h.Store.Stat(obj); !errors.Is(err, store.ErrNotFound) {
		return nil // held here (or suspect, which the write reports)
	}
	return h.authoritative(ctx, obj)
}

// epochChecked says whether op carries an epoch that must match: every
// op on objects does; HELLO and admin requests do not.
func epochChecked(op protocol.Op) bool {
	return op != protocol.OpHello && op != protocol.OpAdmin
}

// Serve answers one request.
func (h *Handler) Serve(ctx context.Context, req *protocol.Request, resp *protocol.Response) {
	start := time.Now()
	h.serve(ctx, req, resp)
	if h.Metrics != nil {
		h.Metrics.observe(req, resp, time.Since(start))
	}
}

func (h *Handler) serve(ctx context.Context, req *protocol.Request, resp *protocol.Response) {
	cur := h.Epochs.Epoch()
	resp.Epoch = cur
	if epochChecked(req.Op) && h.Live != nil && !h.Live(time.Now()) {
		fail(resp, protocol.StatusShutdown, "this node's membership lease may have expired: it serves no object until it rejoins")
		return
	}
	if epochChecked(req.Op) {
		if req.Epoch < cur {
			fail(resp, protocol.StatusOldEpoch, fmt.Sprintf("request of epoch %d, node is at %d", req.Epoch, cur))
			return
		}
		if req.Epoch > cur {
			wait := h.CatchUp
			if wait == 0 {
				wait = 2 * time.Second
			}
			wctx, cancel := context.WithTimeout(ctx, wait)
			err := h.Epochs.AwaitEpoch(wctx, req.Epoch)
			cancel()
			if err != nil {
				fail(resp, protocol.StatusNewEpoch, fmt.Sprintf("request of epoch %d, node is still at %d", req.Epoch, h.Epochs.Epoch()))
				return
			}
			resp.Epoch = h.Epochs.Epoch()
		}
	}
	if req.Op != protocol.OpAdmin && req.Op != protocol.OpHello && req.Op != protocol.OpList {
		if err := checkRange(req); err != nil {
			fail(resp, protocol.StatusEINVAL, err.Error())
			return
		}
	}
	st := h.Store
	sync := req.Flags&protocol.FlagSync != 0
	var (
		ver uint64
		err error
	)
	switch req.Op {
	case protocol.OpWrite, protocol.OpWriteZeroes, protocol.OpDiscard:
		if err := h.mayCreate(ctx, req.Object); err != nil {
			fail(resp, protocol.StatusSuspect, err.Error())
			return
		}
	}
	switch req.Op {
	case protocol.OpHello:
	case protocol.OpAdmin:
		if h.Admin == nil {
			fail(resp, protocol.StatusUnsupported, "this node takes no admin requests")
			return
		}
		h.Admin(ctx, req, resp)
		return
	case protocol.OpRead:
		buf := resp.Payload[:0]
		if cap(buf) < int(req.Length) {
			buf = make([]byte, req.Length)
		}
		buf = buf[:req.Length]
		ver, err = st.ReadAt(req.Object, buf, int64(req.Offset))
		resp.Payload = buf
	case protocol.OpWrite:
		ver, err = st.WriteAt(req.Object, req.Token, req.Payload, int64(req.Offset), sync)
	case protocol.OpWriteZeroes:
		ver, err = st.WriteZeroes(req.Object, req.Token, int64(req.Offset), int64(req.Length), req.Flags&protocol.FlagNoUnmap != 0, sync)
	case protocol.OpDiscard:
		ver, err = st.Discard(req.Object, req.Token, int64(req.Offset), int64(req.Length), sync)
	case protocol.OpRemove:
		err = st.Remove(req.Object, req.Token)
	case protocol.OpFlush:
		err = st.Flush(req.Object.VDI())
	case protocol.OpFence:
		err = st.Fence(req.Object.VDI(), req.Token)
	case protocol.OpStat:
		var info store.Info
		info, err = st.Stat(req.Object)
		if err == nil {
			ver = info.Version
			resp.Payload = protocol.AppendObjectInfos(resp.Payload[:0], []protocol.ObjectInfo{infoOf(info)})
		}
	case protocol.OpList:
		var infos []store.Info
		infos, err = st.List(req.Object.VDI())
		if err == nil {
			// Offset is a cursor (the first ID to list), Length the most
			// entries (0: as many as a reply holds); List is sorted.
			limit := int(req.Length)
			if limit == 0 {
				limit = protocol.MaxListEntries
			}
			var out []protocol.ObjectInfo
			for _, in := range infos {
				if uint64(in.ID) >= req.Offset && len(out) < limit {
					out = append(out, infoOf(in))
				}
			}
			resp.Payload = protocol.AppendObjectInfos(resp.Payload[:0], out)
		}
	case protocol.OpChecksum:
		var crc uint32
		crc, ver, err = st.Checksum(req.Object)
		if err == nil {
			resp.Payload = protocol.AppendChecksumReply(resp.Payload[:0], crc, ver)
		}
	case protocol.OpExtents:
		var ext []store.Extent
		ext, err = st.Extents(req.Object, int64(req.Offset), int64(req.Length), nil)
		if err == nil {
			out := make([]protocol.Extent, len(ext))
			for i, e := range ext {
				out[i] = protocol.Extent{Offset: uint64(e.Offset), Length: uint64(e.Length), Hole: e.Hole}
			}
			resp.Payload = protocol.AppendExtents(resp.Payload[:0], out)
		}
	default:
		fail(resp, protocol.StatusUnsupported, fmt.Sprintf("op %s", req.Op))
		return
	}
	if errors.Is(err, store.ErrNotFound) && (req.Op == protocol.OpRead || req.Op == protocol.OpExtents || req.Op == protocol.OpChecksum) {
		if aerr := h.authoritative(ctx, req.Object); aerr != nil {
			fail(resp, protocol.StatusSuspect, aerr.Error())
			return
		}
	}
	if err != nil {
		fail(resp, statusOf(err), err.Error())
		return
	}
	resp.Status = protocol.StatusOK
	resp.Version = ver
}

func infoOf(in store.Info) protocol.ObjectInfo {
	return protocol.ObjectInfo{ID: in.ID, Version: in.Version, Allocated: in.Allocated}
}

// checkRange refuses a range outside any object before the store sees it.
func checkRange(req *protocol.Request) error {
	switch req.Op {
	case protocol.OpWrite:
		if uint64(len(req.Payload)) != uint64(req.Length) {
			return fmt.Errorf("object %s: payload of %d bytes, header says %d", req.Object, len(req.Payload), req.Length)
		}
	}
	if req.Offset > store.MaxObjectSize || uint64(req.Length) > store.MaxObjectSize-req.Offset {
		return fmt.Errorf("object %s: range %d+%d outside an object of %d bytes", req.Object, req.Offset, req.Length, int64(store.MaxObjectSize))
	}
	if req.Object.VDI() == 0 {
		return fmt.Errorf("object %s: VDI id 0", req.Object)
	}
	return nil
}

// statusOf maps a store error onto the protocol's status.
func statusOf(err error) protocol.Status {
	switch {
	case errors.Is(err, store.ErrNotFound):
		return protocol.StatusNoEnt
	case errors.Is(err, store.ErrSuspect):
		return protocol.StatusSuspect
	case errors.Is(err, store.ErrStaleToken):
		return protocol.StatusStaleToken
	case errors.Is(err, store.ErrNoSpace):
		return protocol.StatusENOSPC
	case errors.Is(err, store.ErrRange):
		return protocol.StatusEINVAL
	case errors.Is(err, store.ErrClosed):
		return protocol.StatusShutdown
	}
	return protocol.StatusEIO
}

func fail(resp *protocol.Response, s protocol.Status, msg string) {
	resp.Status = s
	if len(msg) > 1024 {
		msg = msg[:1024]
	}
	resp.Payload = append(resp.Payload[:0], msg...)
}

// vdiOf is the VDI a request about a whole VDI names.
func vdiOf(req *protocol.Request) object.VDI { return req.Object.VDI() }
