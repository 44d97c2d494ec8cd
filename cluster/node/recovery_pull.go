package node

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ovis-storage/ovis/cluster/object"
	"github.com/ovis-storage/ovis/cluster/protocol"
	"github.com/ovis-storage/ovis/cluster/recovery"
	"github.com/ovis-storage/ovis/cluster/store"
	"github.com/ovis-storage/ovis/cluster/view"
)

// pullAll carries out the pending steps with a few workers, until none
// is left or ctx ends. A step that fails is tried again after a pause.
func (r *recoverer) pullAll(ctx context.Context, v *view.View) error {
	for {
		r.mu.Lock()
		var todo []object.ID
		for _, obj := range r.objs.Pending() {
			if r.busy[obj] == nil {
				todo = append(todo, obj)
			}
		}
		left := r.objs.PendingCount()
		r.mu.Unlock()
		if left == 0 {
			return nil
		}
		work := make(chan object.ID)
		var wg sync.WaitGroup
		var failed atomic.Int64
		for range 4 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for obj := range work {
					if err := r.recoverPending(ctx, v, obj); err != nil {
						failed.Add(1)
						if ctx.Err() == nil {
							r.log.Warn("recovery: object", "object", obj.String(), "err", err)
						}
					}
				}
			}()
		}
	feed:
		for _, obj := range todo {
			select {
			case work <- obj:
			case <-ctx.Done():
				break feed
			}
		}
		close(work)
		wg.Wait()
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if failed.Load() > 0 || len(todo) == 0 {
			// Failures wait before another pass; with nothing to take,
			// on-demand recoveries hold the rest.
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(200 * time.Millisecond):
			}
		}
	}
}

// recoverPending carries out obj's pending step, unless a request got to
// it first.
func (r *recoverer) recoverPending(ctx context.Context, v *view.View, obj object.ID) error {
	r.mu.Lock()
	st, ok := r.objs.Step(obj, v.Epoch)
	if !ok || r.busy[obj] != nil {
		r.mu.Unlock()
		return nil
	}
	r.mu.Unlock()
	// The throttle counts whole objects: what a pull may move.
	size := int64(4 << 20)
	if vd, err := r.a.vdi(ctx, obj.VDI()); err == nil {
		size = 1 << vd.ObjectShift
	}
	if err := r.throttle(ctx, size); err != nil {
		return err
	}
	r.mu.Lock()
	st, ok = r.objs.Step(obj, v.Epoch)
	if !ok || r.busy[obj] != nil {
		r.mu.Unlock()
		return nil // recovered on demand meanwhile
	}
	ch := make(chan struct{})
	r.busy[obj] = ch
	r.mu.Unlock()
	err := r.settle(ctx, obj, v.Epoch)
	if err == nil {
		if live, lerr := r.liveHere(obj, v.Epoch); lerr != nil {
			err = lerr
		} else if !live {
			err = r.apply(ctx, v, obj, st)
		}
		// A copy that took writes of the epoch since the listing is
		// kept (recovery invariant 6): the step was decided without
		// them.
	}
	r.mu.Lock()
	delete(r.busy, obj)
	if err == nil {
		r.objs.Pulled(obj, v.Epoch)
	}
	r.mu.Unlock()
	close(ch)
	return err
}

// apply carries out one step for obj.
func (r *recoverer) apply(ctx context.Context, v *view.View, obj object.ID, st recovery.Step) error {
	switch st.Action {
	case recovery.Keep:
		return nil
	case recovery.Trust:
		// Every copy is suspect (every holder crashed with writes to it
		// not yet durable): this one was chosen, and the others copy it.
		r.log.Warn("recovery: every copy is suspect; keeping this node's", "object", obj.String(), "version", st.Version)
		return r.st.ClearSuspect(obj)
	case recovery.Drop:
		// Nodes of a higher rank hold nothing: this copy holds only
		// writes never acknowledged (a cut-off writer's).
		r.log.Info("recovery: dropping a copy the nodes that went on never had", "object", obj.String(), "version", st.Version)
		if err := r.st.Drop(obj, st.Version); err != nil {
			return err
		}
		r.count(0)
		return nil
	case recovery.PullTombstone:
		unhide := r.hide(obj, v.Epoch, st)
		var err error
		if st.Replace {
			err = r.st.ReplaceTombstone(obj, st.Version)
		} else {
			err = putTombstone(r.st, obj, st.Version)
		}
		if err == nil {
			r.count(0)
		} else {
			unhide()
		}
		return err
	case recovery.Pull:
		if st.Verify {
			same, err := r.sameBytes(ctx, v, obj, st)
			if err != nil {
				return err
			}
			if same {
				// This copy is the source's: kept, and withheld as a
				// pulled one would be when a copy served as current
				// lacks its version (recovery.Step.Hide).
				r.hide(obj, v.Epoch, st)
				r.mu.Lock()
				r.stats.Verified++
				r.mu.Unlock()
				return nil
			}
		}
		data, ver, err := r.fetch(ctx, v, obj, st)
		if err != nil {
			return err
		}
		if err := r.st.CheckSpace(int64(len(data))); err != nil {
			// Recovery never fills a disk past its reserve: the object
			// stays pending (its other copies serve it) until space is
			// freed or the placement moves it.
			return fmt.Errorf("object %s: recovery: %w", obj, err)
		}
		install := func(id object.ID, ver uint64, data []byte) error { return putIfNewer(r.st, id, ver, data) }
		if st.Replace {
			// This node's copy, of a lower rank, holds writes never
			// acknowledged: it goes although its version is higher. The
			// object is busy or pending meanwhile, so no write races.
			r.log.Info("recovery: replacing a copy of a lower rank", "object", obj.String(), "source", st.Source, "version", ver)
			install = r.st.Replace
		}
		unhide := r.hide(obj, v.Epoch, st)
		if err := install(obj, ver, data); err != nil {
			unhide()
			return fmt.Errorf("object %s: storing the copy from %s: %w", obj, st.Source, err)
		}
		r.count(int64(len(data)))
		return nil
	}
	return fmt.Errorf("object %s: unknown recovery step %v", obj, st.Action)
}

// sameBytes reports whether this node's copy of obj and st.Source's
// hold the same bytes at st.Version (recovery.Step.Verify): each
// checksummed where it is, so that only two checksums cross the network.
// A copy that moved on meanwhile, or went, is not the same.
func (r *recoverer) sameBytes(ctx context.Context, v *view.View, obj object.ID, st recovery.Step) (bool, error) {
	crc, ver, err := r.st.Checksum(obj)
	switch {
	case errors.Is(err, store.ErrNotFound) || errors.Is(err, store.ErrSuspect):
		return false, nil
	case err != nil:
		return false, fmt.Errorf("object %s: checksum of this copy: %w", obj, err)
	case ver != st.Version:
		return false, nil
	}
	scrc, sver, none, err := r.peerChecksum(ctx, v, st.Source, obj)
	if err != nil {
		return false, fmt.Errorf("object %s: checksum on %s: %w", obj, st.Source, err)
	}
	return !none && scrc == crc && sver == ver, nil
}

// peerChecksum asks node id of v for the checksum of its copy of obj as
// it is (protocol.FlagRecovery: gated writes included) and its version;
// none when it holds nothing of obj, or a tombstone.
func (r *recoverer) peerChecksum(ctx context.Context, v *view.View, id string, obj object.ID) (crc uint32, version uint64, none bool, err error) {
	addr, ok := v.Addr[id]
	if !ok {
		return 0, 0, false, fmt.Errorf("node %s is not in epoch %d", id, v.Epoch)
	}
	var resp protocol.Response
	req := &protocol.Request{Op: protocol.OpChecksum, Flags: protocol.FlagRecovery, Epoch: v.Epoch, Object: obj, Length: protocol.MaxObjectSpan}
	err = r.net.Call(ctx, addr, req, &resp)
	switch {
	case protocol.StatusOf(err) == protocol.StatusNoEnt:
		return 0, 0, true, nil
	case err != nil:
		return 0, 0, false, err
	}
	crc, version, err = protocol.ParseChecksumReply(resp.Payload)
	return crc, version, false, err
}

// hide withholds obj from readers before a pull of st stores it, when
// st says the copy holds a write that another copy served as current
// lacks (recovery.Step.Hide); the gate table releases it once the
// copies agree. It returns what undoes it when the pull stores nothing.
func (r *recoverer) hide(obj object.ID, e uint64, st recovery.Step) (unhide func()) {
	if !st.Hide || r.h == nil || r.noHide.Load() {
		return func() {}
	}
	r.log.Info("recovery: withholding a pulled copy until its peers have it: it holds a write never acknowledged", "object", obj.String(), "source", st.Source, "version", st.Version)
	r.h.gates.hide(obj, e, r.clock())
	return func() { r.h.gates.unhide(obj) }
}

func (r *recoverer) count(bytes int64) {
	r.mu.Lock()
	r.stats.Recovered++
	r.stats.Bytes += bytes
	r.mu.Unlock()
}

// fetch reads obj's copy from the step's source as it is: its extents,
// then its data ranges. The version is the one the source reported
// first; writes that land on the source meanwhile reach this node too
// (it is placed for obj, and holds them back until obj is recovered), so
// they are applied again on top.
func (r *recoverer) fetch(ctx context.Context, v *view.View, obj object.ID, st recovery.Step) ([]byte, uint64, error) {
	addr := v.Addr[st.Source]
	if addr == "" {
		return nil, 0, fmt.Errorf("object %s: source %s left the epoch", obj, st.Source)
	}
	vd, err := r.a.vdi(ctx, obj.VDI())
	if err != nil {
		return nil, 0, fmt.Errorf("object %s: its VDI: %w", obj, err)
	}
	size := uint32(1) << vd.ObjectShift
	var ver uint64
	// A suspect source cannot map its extents: read it whole (Put makes
	// holes of its zeros again).
	ext := []protocol.Extent{{Offset: 0, Length: uint64(size)}}
	if !st.FromSuspect {
		var resp protocol.Response
		req := &protocol.Request{Op: protocol.OpExtents, Flags: protocol.FlagRecovery, Epoch: v.Epoch, Object: obj, Length: size}
		if err := r.net.Call(ctx, addr, req, &resp); err != nil {
			return nil, 0, fmt.Errorf("object %s: extents on %s: %w", obj, st.Source, err)
		}
		ver = resp.Version
		if ext, err = protocol.ParseExtents(nil, resp.Payload); err != nil {
			return nil, 0, fmt.Errorf("object %s: extents on %s: %w", obj, st.Source, err)
		}
	}
	var end uint64
	for _, e := range ext {
		if !e.Hole {
			end = max(end, min(e.Offset+e.Length, uint64(size)))
		}
	}
	data := make([]byte, end)
	const chunk = 4 << 20
	for _, e := range ext {
		if e.Hole {
			continue
		}
		for off := e.Offset; off < min(e.Offset+e.Length, end); off += chunk {
			n := min(chunk, min(e.Offset+e.Length, end)-off)
			var rr protocol.Response
			rr.Payload = data[off : off : off+n]
			req := &protocol.Request{Op: protocol.OpRead, Flags: protocol.FlagRecovery, Epoch: v.Epoch, Object: obj, Offset: off, Length: uint32(n)}
			if err := r.net.Call(ctx, addr, req, &rr); err != nil {
				return nil, 0, fmt.Errorf("object %s: read %d+%d on %s: %w", obj, off, n, st.Source, err)
			}
			if uint64(len(rr.Payload)) != n {
				return nil, 0, fmt.Errorf("object %s: read %d+%d on %s: %d bytes", obj, off, n, st.Source, len(rr.Payload))
			}
			if &rr.Payload[0] != &data[off] {
				copy(data[off:], rr.Payload)
			}
			if ver == 0 {
				ver = rr.Version
			}
		}
	}
	if ver == 0 {
		ver = st.Version
	}
	return data, ver, nil
}
