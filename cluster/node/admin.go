package node

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/ovis-storage/ovis/cluster/admin"
	"github.com/ovis-storage/ovis/cluster/gateway"
	"github.com/ovis-storage/ovis/cluster/membership"
	"github.com/ovis-storage/ovis/cluster/object"
	"github.com/ovis-storage/ovis/cluster/protocol"
)

// The admin plane's verbs, types and wire are cluster/admin's; this
// file is the node's side of it: adminServer serves each verb, with the
// domain rules left to membership.

// RecoveryStats, RecoveryControl and UnfoundObject are the admin
// plane's types, named here for recovery's code.
type (
	RecoveryStats   = admin.RecoveryStats
	RecoveryControl = admin.RecoveryControl
	UnfoundObject   = admin.UnfoundObject
)

// admin serves OpAdmin: cluster/admin decodes the request and routes it
// by verb to adminServer; a refusal goes back as its text.
func (n *Node) admin(ctx context.Context, req *protocol.Request, resp *protocol.Response) {
	p, err := admin.Serve(ctx, adminServer{n}, req.Payload)
	if err != nil {
		fail(resp, admin.Status(err), err.Error())
		return
	}
	resp.Status = protocol.StatusOK
	resp.Payload = p
}

// peer is an admin client for the node at addr, through the node's own
// connections.
func (n *Node) peer(addr string) *admin.Client { return admin.Via(n.net, addr) }

// adminServer is the node's admin.Handler: each method serves the verb
// of its name.
type adminServer struct{ n *Node }

var _ admin.Handler = adminServer{}

func (a adminServer) Info(ctx context.Context, _ admin.None) (admin.Info, error) {
	n, mc := a.n, a.n.mc
	info := admin.Info{Node: n.id, Etcd: n.EtcdEndpoints()}
	if f, err := mc.GetFormat(ctx); err == nil {
		info.Format = &f
	} else if !errors.Is(err, membership.ErrNotFormatted) {
		return admin.Info{}, err
	}
	v, err := mc.View(ctx)
	if err != nil {
		return admin.Info{}, err
	}
	info.Epoch, info.Nodes = v.Epoch, v.Nodes
	for _, ni := range v.Nodes {
		if ni.Full {
			info.Full = append(info.Full, ni.ID)
		}
	}
	if info.Unreachable, err = mc.Reports(ctx, v.Epoch); err != nil {
		return admin.Info{}, err
	}
	if len(info.Unreachable) == 0 {
		info.Unreachable = nil
	}
	from := uint64(1)
	if v.Epoch > 20 {
		from = v.Epoch - 19
	}
	if info.History, err = mc.Epochs(ctx, from, v.Epoch); err != nil {
		return admin.Info{}, err
	}
	nodes, err := a.NodeList(ctx, admin.None{})
	if err != nil {
		return admin.Info{}, err
	}
	for _, ns := range nodes {
		info.Unfound += ns.Recovery.Unfound
		info.UnfoundOn = append(info.UnfoundOn, ns.Recovery.UnfoundOn...)
	}
	slices.Sort(info.UnfoundOn)
	info.UnfoundOn = slices.Compact(info.UnfoundOn)
	return info, nil
}

func (a adminServer) Format(ctx context.Context, r admin.FormatRequest) (membership.Format, error) {
	v, err := a.n.mc.View(ctx)
	if err != nil {
		return membership.Format{}, err
	}
	return a.n.mc.FormatIn(ctx, v, membership.Format{Copies: r.Copies, ObjectShift: r.ObjectShift, Strict: r.Strict}, r.Force)
}

func (a adminServer) NodeSelf(context.Context, admin.None) (admin.NodeStatus, error) {
	return a.n.self(), nil
}

func (a adminServer) NodeList(ctx context.Context, _ admin.None) ([]admin.NodeStatus, error) {
	return a.n.nodeList(ctx)
}

func (a adminServer) NodeRemove(ctx context.Context, r admin.NameRequest) (admin.NodeRemoved, error) {
	if err := a.n.mc.RemoveNode(ctx, r.Name); err != nil {
		return admin.NodeRemoved{}, err
	}
	return admin.NodeRemoved{Removed: r.Name}, nil
}

func (a adminServer) VDICreate(ctx context.Context, r admin.VDICreateRequest) (membership.VDI, error) {
	mc := a.n.mc
	v, err := mc.View(ctx)
	if err != nil {
		return membership.VDI{}, err
	}
	f, err := mc.GetFormat(ctx)
	if err != nil {
		return membership.VDI{}, err
	}
	// Checked here too, so that a refusal reads as the rule words it;
	// CreateVDI checks it again against the view it writes in.
	vd, err := membership.NewVDI(membership.VDI{Name: r.Name, Size: r.Size, Copies: r.Copies, ObjectShift: r.ObjectShift}, f, v.Zones())
	if err != nil {
		return membership.VDI{}, err
	}
	return mc.CreateVDI(ctx, vd)
}

func (a adminServer) VDIList(ctx context.Context, _ admin.None) ([]membership.VDI, error) {
	return a.n.mc.ListVDIs(ctx)
}

func (a adminServer) VDIAllocated(ctx context.Context, r admin.NameRequest) ([]admin.AllocChunk, error) {
	vd, err := a.n.mc.GetVDI(ctx, r.Name)
	if err != nil {
		return nil, err
	}
	s, err := a.n.allocatedForCheck(ctx, vd)
	if err != nil {
		return nil, err
	}
	return admin.Chunks(s), nil
}

func (a adminServer) VDIDelete(ctx context.Context, r admin.NameRequest) (membership.VDI, error) {
	vd, err := a.n.mc.DeleteVDI(ctx, r.Name)
	if err != nil {
		return membership.VDI{}, err
	}
	// The objects go in the background: a node that misses the
	// removal keeps them until recovery reads the tombstone.
	a.n.removeObjects(ctx, vd)
	return vd, nil
}

func (a adminServer) VDIResize(ctx context.Context, r admin.VDIResizeRequest) (membership.VDI, error) {
	return a.n.mc.ResizeVDI(ctx, r.Name, r.Size, r.Shrink)
}

func (a adminServer) VDIAlterCopy(ctx context.Context, r admin.VDIAlterCopyRequest) (membership.VDI, error) {
	return a.n.mc.AlterCopies(ctx, r.Name, r.Copies)
}

func (a adminServer) VDIRead(ctx context.Context, r admin.VDIReadRequest) (admin.VDIReadReply, error) {
	return a.n.adminRead(ctx, r)
}

func (a adminServer) VDIWrite(ctx context.Context, r admin.VDIWriteRequest) (admin.VDIWriteReply, error) {
	return a.n.adminWrite(ctx, r)
}

func (a adminServer) LockList(ctx context.Context, _ admin.None) ([]membership.Lock, error) {
	return a.n.mc.Locks(ctx)
}

func (a adminServer) LockBreak(ctx context.Context, r admin.NameRequest) (membership.Lock, error) {
	return a.n.mc.BreakLock(ctx, r.Name)
}

func (a adminServer) Check(ctx context.Context, _ admin.None) (admin.CheckReport, error) {
	r, err := a.n.check(ctx)
	if err != nil {
		return admin.CheckReport{}, err
	}
	return *r, nil
}

func (a adminServer) LostMark(ctx context.Context, r admin.LostMarkRequest) ([]admin.UnfoundObject, error) {
	return a.n.markLost(ctx, r)
}

func (a adminServer) RecoverySet(_ context.Context, r admin.RecoverySetRequest) (admin.RecoveryStats, error) {
	if r.Recovery != nil {
		a.n.rec.control(*r.Recovery)
	}
	return a.n.rec.Stats(), nil
}

func (a adminServer) RecoveryUnfound(context.Context, admin.None) ([]admin.UnfoundObject, error) {
	return a.n.rec.unfoundObjects(), nil
}

func (a adminServer) RecoveryKick(context.Context, admin.None) (admin.Ack, error) {
	a.n.rec.kick()
	return "kicked", nil
}

func (a adminServer) ObjectRecover(ctx context.Context, r admin.ObjectRequest) (admin.Ack, error) {
	return a.n.recoverObject(ctx, r.Object)
}

func (a adminServer) ObjectReplace(ctx context.Context, r admin.ObjectReplaceRequest) (admin.Ack, error) {
	return a.n.replaceObject(ctx, r.Object, r.Source)
}

func (a adminServer) ObjectDrop(ctx context.Context, r admin.ObjectRequest) (admin.Ack, error) {
	return a.n.dropObject(ctx, r.Object)
}

func (a adminServer) VDIPurge(ctx context.Context, r admin.ObjectRequest) (admin.Ack, error) {
	return a.n.purgeVDI(ctx, r.Object)
}

// markLost gives up unfound objects (`ovis cluster mark-lost`): the one
// r.Object names, or with r.All every object some node of the epoch
// reports unfound. It marks them lost up to the current epoch
// (membership.MarkLost), kicks every node's recovery, and returns them;
// each node's next run decides them from the copies that answer.
func (n *Node) markLost(ctx context.Context, r admin.LostMarkRequest) ([]admin.UnfoundObject, error) {
	v, err := n.mc.View(ctx)
	if err != nil {
		return nil, err
	}
	var objs []admin.UnfoundObject
	if r.Object != 0 {
		objs = []admin.UnfoundObject{{Object: r.Object.String()}}
	} else if !r.All {
		return nil, errors.New("mark-lost: name an object, or give them all up (--all-unfound)")
	} else {
		// Objects given up already in this epoch are still unfound on
		// the nodes until their next run: not given up twice.
		lost, err := n.mc.Lost(ctx)
		if err != nil {
			return nil, err
		}
		seen := map[string]bool{}
		for id, e := range lost {
			if e >= v.Epoch {
				seen[id.String()] = true
			}
		}
		for _, ni := range v.Nodes {
			var some []admin.UnfoundObject
			if ni.ID == n.id {
				some = n.rec.unfoundObjects()
			} else if some, err = admin.RecoveryUnfound.Do(ctx, n.peer(ni.Addr), admin.None{}); err != nil {
				return nil, fmt.Errorf("mark-lost: asking node %s for its unfound objects: %w", ni.ID, err)
			}
			for _, u := range some {
				if !seen[u.Object] {
					seen[u.Object] = true
					objs = append(objs, u)
				}
			}
		}
	}
	ids := make([]object.ID, len(objs))
	for i := range objs {
		id, err := object.Parse(objs[i].Object)
		if err != nil {
			return nil, fmt.Errorf("mark-lost: %w", err)
		}
		if vd, err := n.mc.GetVDIByID(ctx, id.VDI()); err == nil {
			objs[i].VDI = vd.Name
		} else if errors.Is(err, membership.ErrNoVDI) {
			return nil, fmt.Errorf("mark-lost: object %s: no VDI has it", id)
		} else {
			return nil, err
		}
		ids[i] = id
		objs[i].Epoch = v.Epoch
	}
	if err := n.mc.MarkLost(ctx, ids, v.Epoch); err != nil {
		return nil, err
	}
	for _, u := range objs {
		n.log.Warn("an operator gave an unfound object up (mark-lost)", "object", u.Object, "vdi", u.VDI, "may_be_on", u.On, "epoch", v.Epoch)
	}
	// Every node runs again now rather than at its next retry.
	for _, ni := range v.Nodes {
		if ni.ID == n.id {
			n.rec.kick()
			continue
		}
		if _, err := admin.RecoveryKick.Do(ctx, n.peer(ni.Addr), admin.None{}); err != nil {
			n.log.Warn("mark-lost: node did not take the kick; it runs again at its next retry", "node", ni.ID, "err", err)
		}
	}
	return objs, nil
}

func (n *Node) self() admin.NodeStatus {
	s := admin.NodeStatus{ID: n.id, Addr: n.Addr(), Zone: n.cfg.Zone, Weight: n.cfg.Weight, State: "up", Epoch: n.views.Epoch(), Recovery: n.rec.Stats()}
	if u, err := n.st.Usage(); err == nil {
		s.Objects, s.Allocated, s.Free = u.Objects, u.Allocated, u.Free
		if u.Free-(1<<object.DefaultSizeShift) < u.Reserve {
			// A new object of the default size would be refused
			// (ENOSPC), and recovery pulls none here, until space is
			// freed.
			s.State = "full"
		}
	} else {
		s.Error = err.Error()
	}
	if !n.live(time.Now()) {
		// Its lease ran out (etcd unreachable from here, or a pause
		// longer than the lease): it serves nothing until it has
		// rejoined.
		s.State = "rejoining"
	}
	if err := n.st.Err(); err != nil {
		// The store's journal could not be made durable: it takes no
		// change, so every write placed here fails until the node is
		// restarted on a working disk (or removed).
		s.State, s.Error = "failed", err.Error()
	}
	return s
}

// nodeList is every node of the current view as it says it is, or
// "unreachable" with the error of asking it.
func (n *Node) nodeList(ctx context.Context) ([]admin.NodeStatus, error) {
	v, err := n.mc.View(ctx)
	if err != nil {
		return nil, err
	}
	out := make([]admin.NodeStatus, len(v.Nodes))
	var wg sync.WaitGroup
	for i, ni := range v.Nodes {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if ni.ID == n.id {
				out[i] = n.self()
				return
			}
			cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
			defer cancel()
			s, err := admin.NodeSelf.Do(cctx, n.peer(ni.Addr), admin.None{})
			if err != nil {
				s = admin.NodeStatus{ID: ni.ID, Addr: ni.Addr, Zone: ni.Zone, Weight: ni.Weight, State: "unreachable", Error: err.Error()}
			}
			out[i] = s
		}()
	}
	wg.Wait()
	return out, nil
}

// readDevice opens a VDI read-only for one admin request.
func (n *Node) readDevice(ctx context.Context, name string) (*gateway.Device, error) {
	v, err := n.mc.GetVDI(ctx, name)
	if err != nil {
		return nil, err
	}
	return gateway.Open(ctx, gateway.Config{VDI: v.ID, Name: v.Name, Size: v.Size, Copies: v.Copies, CopiesAt: copiesAt(v),
		ObjectShift: v.ObjectShift, Views: n.views, Net: n.net, Local: n.id})
}

// adminRead serves vdi.read through a read-only device of its own.
func (n *Node) adminRead(ctx context.Context, r admin.VDIReadRequest) (admin.VDIReadReply, error) {
	d, err := n.readDevice(ctx, r.Name)
	if err != nil {
		return admin.VDIReadReply{}, err
	}
	defer d.Close()
	l := r.Length
	if l < 0 || l > admin.MaxData {
		return admin.VDIReadReply{}, fmt.Errorf("read of %d bytes: at most %d per request", l, admin.MaxData)
	}
	if r.Offset < 0 || r.Offset > d.Size() {
		return admin.VDIReadReply{}, fmt.Errorf("vdi %q: offset %d outside its %d bytes", r.Name, r.Offset, d.Size())
	}
	l = min(l, d.Size()-r.Offset)
	p := make([]byte, l)
	if _, err := d.ReadAt(ctx, p, r.Offset); err != nil {
		return admin.VDIReadReply{}, err
	}
	return admin.VDIReadReply{Size: d.Size(), Data: p}, nil
}

// adminWrite serves vdi.write through the VDI's device here, which
// must hold its lock, and flushes it before answering.
func (n *Node) adminWrite(ctx context.Context, r admin.VDIWriteRequest) (admin.VDIWriteReply, error) {
	o, err := n.vdis.get(ctx, r.Name)
	if err != nil {
		return admin.VDIWriteReply{}, err
	}
	if o.lock == nil {
		return admin.VDIWriteReply{}, &membership.LockedError{Name: r.Name, Holder: o.holder}
	}
	if _, err := o.dev.WriteAt(ctx, r.Data, r.Offset, 0); err != nil {
		return admin.VDIWriteReply{}, err
	}
	if err := o.dev.Flush(ctx); err != nil {
		return admin.VDIWriteReply{}, err
	}
	return admin.VDIWriteReply{Written: int64(len(r.Data))}, nil
}

// removeObjects asks every node to remove a deleted VDI's objects.
func (n *Node) removeObjects(ctx context.Context, vd membership.VDI) {
	v := n.views.View()
	for id, addr := range v.Addr {
		// Each node removes the VDI's directory at once (store.RemoveVDI),
		// tombstones and all: IDs are never reused, so nothing needs to
		// remember the objects. A node that misses this removes them when
		// it next recovers (it finds no VDI for them).
		if _, err := admin.VDIPurge.Do(ctx, n.peer(addr), admin.ObjectRequest{Object: object.Make(vd.ID, 0)}); err != nil {
			n.log.Warn("removing a deleted VDI's objects", "vdi", vd.Name, "on", id, "err", err)
		}
	}
}

// allocatedForCheck is vd's allocation map without the objects an
// operator gave up (ovis cluster mark-lost): reading as zeros is what
// was chosen for those, so their absence is no problem of check's; nor
// the unsynced ones (membership.Client.Unsynced), which read as zeros
// too.
func (n *Node) allocatedForCheck(ctx context.Context, vd membership.VDI) (*object.Set, error) {
	s, err := n.mc.Allocated(ctx, vd.ID)
	if err != nil {
		return nil, err
	}
	// An unsynced object without a copy lost only writes never
	// acknowledged durable: no loss.
	unsynced, err := n.mc.Unsynced(ctx, vd.ID)
	if err != nil {
		return nil, err
	}
	unsynced.Each(func(i uint32) { s.Remove(i) })
	lost, err := n.mc.Lost(ctx)
	if err != nil {
		return nil, err
	}
	for obj := range lost {
		if obj.VDI() == vd.ID {
			s.Remove(obj.Index())
		}
	}
	return s, nil
}

// check compares every replica of every object, for the admin command.
func (n *Node) check(ctx context.Context) (*admin.CheckReport, error) {
	// The view first: a table read after it has every change of copies
	// its epoch was made with (VDI.CopiesAt).
	v := n.views.View()
	vs, err := n.mc.ListVDIs(ctx)
	if err != nil {
		return nil, err
	}
	return Check(ctx, n.net, v, vs, n.allocatedForCheck, nil)
}
