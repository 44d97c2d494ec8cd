package node

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/ovis-storage/ovis/cluster/gateway"
	"github.com/ovis-storage/ovis/cluster/membership"
	"github.com/ovis-storage/ovis/cluster/object"
	"github.com/ovis-storage/ovis/cluster/protocol"
)

// Admin requests ride the node-to-node protocol as OpAdmin, so that
// `ovis … -a HOST:PORT` needs nothing but a node's address, as Sheepdog's
// dog does. The payload is a 4-byte big-endian length, a JSON
// AdminRequest of that length, and raw bytes (the data of vdi.write); the
// reply's payload is framed the same way, with the command's JSON result
// and raw bytes (the data of vdi.read). A refused command is a non-OK
// status whose payload is the error's text.

// AdminRequest is one admin command.
type AdminRequest struct {
	Cmd  string `json:"cmd"`
	Name string `json:"name,omitempty"`
	// Size is a VDI's size (vdi.create, vdi.resize).
	Size int64 `json:"size,omitempty"`
	// Copies and ObjectShift are a format's or a VDI's.
	Copies      int   `json:"copies,omitempty"`
	ObjectShift uint8 `json:"object_shift,omitempty"`
	Force       bool  `json:"force,omitempty"`
	Shrink      bool  `json:"shrink,omitempty"`
	Offset      int64 `json:"offset,omitempty"`
	Length      int64 `json:"length,omitempty"`
	Strict      bool  `json:"strict,omitempty"`
	// Object and Source name an object and the node to copy it from
	// (object.recover, object.replace, object.drop, vdi.purge).
	Object uint64 `json:"object,omitempty"`
	Source string `json:"source,omitempty"`
	// All: every object some node reports unfound (lost.mark).
	All bool `json:"all,omitempty"`
	// Recovery changes a node's recovery (recovery.set).
	Recovery *RecoveryControl `json:"recovery,omitempty"`
}

// RecoveryControl is `ovis node recovery`'s request: a field left nil
// is left as it is.
type RecoveryControl struct {
	// MaxRate bounds the bytes per second recovery pulls; 0 is no bound.
	MaxRate *int64 `json:"max_rate,omitempty"`
	// Paused stops (true) or resumes (false) the background pulls. A
	// request's own object is still recovered first, paused or not.
	Paused *bool `json:"paused,omitempty"`
}

// MaxAdminData bounds the bytes one vdi.read or vdi.write carries.
const MaxAdminData = 4 << 20

// EncodeAdmin frames a JSON value and raw bytes as an admin payload.
func EncodeAdmin(v any, data []byte) ([]byte, error) {
	j, err := json.Marshal(v)
	if err != nil {
		return nil, err
	}
	out := binary.BigEndian.AppendUint32(make([]byte, 0, 4+len(j)+len(data)), uint32(len(j)))
	out = append(out, j...)
	return append(out, data...), nil
}

// DecodeAdmin splits an admin payload into its JSON (decoded into v) and
// its raw bytes.
func DecodeAdmin(p []byte, v any) ([]byte, error) {
	if len(p) < 4 {
		return nil, fmt.Errorf("admin payload of %d bytes: too short for its length word", len(p))
	}
	n := binary.BigEndian.Uint32(p)
	if uint64(n) > uint64(len(p)-4) {
		return nil, fmt.Errorf("admin payload: JSON of %d bytes in a payload of %d", n, len(p))
	}
	if v != nil {
		if err := json.Unmarshal(p[4:4+n], v); err != nil {
			return nil, fmt.Errorf("admin payload: %w", err)
		}
	}
	return p[4+n:], nil
}

// NodeStatus is one node as `ovis node list` shows it.
type NodeStatus struct {
	ID        string `json:"id"`
	Addr      string `json:"addr"`
	Zone      uint32 `json:"zone"`
	Weight    uint32 `json:"weight"`
	State     string `json:"state"`
	Epoch     uint64 `json:"epoch"`
	Objects   int    `json:"objects"`
	Allocated int64  `json:"used"`
	Free      int64  `json:"free"`
	// Recovery is the node's recovery progress.
	Recovery RecoveryStats `json:"recovery"`
	Error    string        `json:"error,omitempty"`
}

// RecoveryState says in a few words where a node's recovery stands.
func (s NodeStatus) RecoveryState() string {
	r := s.Recovery
	switch {
	case r.Done >= s.Epoch:
		return "done"
	case !r.Listed:
		return "listing"
	case r.Unfound > 0 && r.Pending > 0:
		return fmt.Sprintf("%d left, %d unfound (on %s)", r.Pending, r.Unfound, strings.Join(r.UnfoundOn, ","))
	case r.Unfound > 0:
		return fmt.Sprintf("%d unfound (on %s)", r.Unfound, strings.Join(r.UnfoundOn, ","))
	}
	return fmt.Sprintf("%d left", r.Pending)
}

// Info is what `ovis cluster info` shows.
type Info struct {
	Node    string                `json:"node"`
	Etcd    []string              `json:"etcd"`
	Format  *membership.Format    `json:"format,omitempty"`
	Epoch   uint64                `json:"epoch"`
	Nodes   []membership.NodeInfo `json:"nodes"`
	History []membership.View     `json:"history"`
	// Unfound counts the objects the nodes report unfound (their newest
	// copy may be on nodes that are away: nobody serves them), and
	// UnfoundOn the nodes they may be on.
	Unfound   int      `json:"unfound"`
	UnfoundOn []string `json:"unfound_on,omitempty"`
}

// CheckReport is what `ovis cluster check` finds.
type CheckReport struct {
	Objects int           `json:"objects"`
	Copies  int           `json:"copies"`
	Bad     []CheckResult `json:"problems,omitempty"`
	// VDIs are the VDIs the check knew, for a check again after repair.
	VDIs []membership.VDI `json:"-"`
}

// CheckResult is one object with a missing, extra or diverging copy.
type CheckResult struct {
	VDI     string   `json:"vdi"`
	Object  string   `json:"object"`
	Problem string   `json:"problem"`
	Nodes   []string `json:"nodes,omitempty"`
	// Kind is the problem in one word, for repair: missing, differ,
	// extra, orphan or error.
	Kind string `json:"kind"`
	// Groups are the copies of a differ, one per distinct checksum.
	Groups []CheckGroup `json:"groups,omitempty"`
}

// CheckGroup is the copies of an object that share one checksum.
type CheckGroup struct {
	CRC     uint32   `json:"crc"`
	Version uint64   `json:"version"` // the highest among them
	Nodes   []string `json:"nodes"`
}

// admin serves OpAdmin.
func (n *Node) admin(ctx context.Context, req *protocol.Request, resp *protocol.Response) {
	var ar AdminRequest
	data, err := DecodeAdmin(req.Payload, &ar)
	var out any
	var raw []byte
	if err == nil {
		out, raw, err = n.adminCmd(ctx, ar, data)
	}
	if err != nil {
		st := protocol.StatusEINVAL
		if errors.Is(err, membership.ErrNoVDI) {
			st = protocol.StatusNoEnt
		}
		fail(resp, st, err.Error())
		return
	}
	p, err := EncodeAdmin(out, raw)
	if err != nil {
		fail(resp, protocol.StatusEIO, err.Error())
		return
	}
	resp.Status = protocol.StatusOK
	resp.Payload = p
}

func (n *Node) adminCmd(ctx context.Context, ar AdminRequest, data []byte) (any, []byte, error) {
	mc := n.mc
	switch ar.Cmd {
	case "info":
		info := Info{Node: n.id, Etcd: n.EtcdEndpoints()}
		if f, err := mc.GetFormat(ctx); err == nil {
			info.Format = &f
		} else if !errors.Is(err, membership.ErrNotFormatted) {
			return nil, nil, err
		}
		v, err := mc.View(ctx)
		if err != nil {
			return nil, nil, err
		}
		info.Epoch, info.Nodes = v.Epoch, v.Nodes
		from := uint64(1)
		if v.Epoch > 20 {
			from = v.Epoch - 19
		}
		if info.History, err = mc.Epochs(ctx, from, v.Epoch); err != nil {
			return nil, nil, err
		}
		nodes, _, err := n.nodeList(ctx)
		if err != nil {
			return nil, nil, err
		}
		for _, ns := range nodes.([]NodeStatus) {
			info.Unfound += ns.Recovery.Unfound
			info.UnfoundOn = append(info.UnfoundOn, ns.Recovery.UnfoundOn...)
		}
		slices.Sort(info.UnfoundOn)
		info.UnfoundOn = slices.Compact(info.UnfoundOn)
		return info, nil, nil
	case "format":
		f := membership.Format{Copies: ar.Copies, ObjectShift: ar.ObjectShift, Strict: ar.Strict}
		if f.Copies == 0 {
			f.Copies = 1
		}
		v, err := mc.View(ctx)
		if err != nil {
			return nil, nil, err
		}
		if f.Copies > v.Zones() {
			return nil, nil, fmt.Errorf("copies %d: the cluster has %d nodes (failure domains); start more nodes first", f.Copies, v.Zones())
		}
		if err := mc.Format(ctx, f, ar.Force); err != nil {
			return nil, nil, err
		}
		f, err = mc.GetFormat(ctx)
		return f, nil, err
	case "node.self":
		return n.self(), nil, nil
	case "node.list":
		return n.nodeList(ctx)
	case "vdi.create":
		v, err := mc.View(ctx)
		if err != nil {
			return nil, nil, err
		}
		f, err := mc.GetFormat(ctx)
		if err != nil {
			return nil, nil, err
		}
		vd := membership.VDI{Name: ar.Name, Size: ar.Size, Copies: ar.Copies, ObjectShift: ar.ObjectShift}
		if vd.Copies == 0 {
			vd.Copies = f.Copies
		}
		if vd.ObjectShift == 0 {
			vd.ObjectShift = f.ObjectShift
		}
		if err := membership.ValidateVDI(vd, f, v.Zones()); err != nil {
			return nil, nil, err
		}
		vd, err = mc.CreateVDI(ctx, vd)
		return vd, nil, err
	case "vdi.list":
		vs, err := mc.ListVDIs(ctx)
		return vs, nil, err
	case "vdi.allocated":
		vd, err := mc.GetVDI(ctx, ar.Name)
		if err != nil {
			return nil, nil, err
		}
		s, err := n.allocatedForCheck(ctx, vd)
		if err != nil {
			return nil, nil, err
		}
		return allocChunks(s), nil, nil
	case "vdi.delete":
		vd, err := mc.DeleteVDI(ctx, ar.Name)
		if err != nil {
			return nil, nil, err
		}
		// The objects go in the background: a node that misses the
		// removal keeps them until recovery reads the tombstone.
		n.removeObjects(ctx, vd)
		return vd, nil, nil
	case "vdi.resize":
		vd, err := mc.ResizeVDI(ctx, ar.Name, ar.Size, ar.Shrink)
		return vd, nil, err
	case "vdi.alter-copy":
		vd, err := mc.AlterCopies(ctx, ar.Name, ar.Copies)
		return vd, nil, err
	case "node.remove":
		if err := mc.RemoveNode(ctx, ar.Name); err != nil {
			return nil, nil, err
		}
		return map[string]string{"removed": ar.Name}, nil, nil
	case "vdi.read":
		return n.adminRead(ctx, ar)
	case "vdi.write":
		return n.adminWrite(ctx, ar, data)
	case "lock.list":
		ls, err := mc.Locks(ctx)
		return ls, nil, err
	case "lock.break":
		l, err := mc.BreakLock(ctx, ar.Name)
		return l, nil, err
	case "check":
		r, err := n.check(ctx)
		return r, nil, err
	case "object.recover", "object.replace", "object.drop", "vdi.purge":
		msg, err := n.repairCmd(ctx, ar)
		return msg, nil, err
	case "recovery.unfound":
		return n.rec.unfoundObjects(), nil, nil
	case "recovery.kick":
		n.rec.kick()
		return "kicked", nil, nil
	case "lost.mark":
		l, err := n.markLost(ctx, ar)
		return l, nil, err
	case "recovery.set":
		if ar.Recovery != nil {
			n.rec.control(*ar.Recovery)
		}
		return n.rec.Stats(), nil, nil
	}
	return nil, nil, fmt.Errorf("unknown admin command %q", ar.Cmd)
}

// UnfoundObject is an object a node's recovery found unfound, and the
// nodes that may hold its newest copy.
type UnfoundObject struct {
	Object string   `json:"object"`
	VDI    string   `json:"vdi,omitempty"`
	On     []string `json:"may_be_on"`
	// Epoch is the epoch of a mark-lost: the object's copies unfound up
	// to it are given up.
	Epoch uint64 `json:"epoch,omitempty"`
}

// markLost gives up unfound objects (`ovis cluster mark-lost`): the one
// ar.Object names, or with ar.All every object some node of the epoch
// reports unfound. It marks them lost up to the current epoch
// (membership.MarkLost), kicks every node's recovery, and returns them;
// each node's next run decides them from the copies that answer.
func (n *Node) markLost(ctx context.Context, ar AdminRequest) ([]UnfoundObject, error) {
	v, err := n.mc.View(ctx)
	if err != nil {
		return nil, err
	}
	var objs []UnfoundObject
	if ar.Object != 0 {
		objs = []UnfoundObject{{Object: object.ID(ar.Object).String()}}
	} else if !ar.All {
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
			var some []UnfoundObject
			if ni.ID == n.id {
				some = n.rec.unfoundObjects()
			} else if _, err := callAdmin(ctx, n.pool, ni.Addr, AdminRequest{Cmd: "recovery.unfound"}, nil, &some, nil); err != nil {
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
		if _, err := callAdmin(ctx, n.pool, ni.Addr, AdminRequest{Cmd: "recovery.kick"}, nil, nil, nil); err != nil {
			n.log.Warn("mark-lost: node did not take the kick; it runs again at its next retry", "node", ni.ID, "err", err)
		}
	}
	return objs, nil
}

func (n *Node) self() NodeStatus {
	s := NodeStatus{ID: n.id, Addr: n.Addr(), Zone: n.cfg.Zone, Weight: n.cfg.Weight, State: "up", Epoch: n.views.Epoch(), Recovery: n.rec.Stats()}
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
	return s
}

func (n *Node) nodeList(ctx context.Context) (any, []byte, error) {
	v, err := n.mc.View(ctx)
	if err != nil {
		return nil, nil, err
	}
	out := make([]NodeStatus, len(v.Nodes))
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
			var s NodeStatus
			if _, err := callAdmin(cctx, n.pool, ni.Addr, AdminRequest{Cmd: "node.self"}, nil, &s, nil); err != nil {
				s = NodeStatus{ID: ni.ID, Addr: ni.Addr, Zone: ni.Zone, Weight: ni.Weight, State: "unreachable", Error: err.Error()}
			}
			out[i] = s
		}()
	}
	wg.Wait()
	return out, nil, nil
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

func (n *Node) adminRead(ctx context.Context, ar AdminRequest) (any, []byte, error) {
	d, err := n.readDevice(ctx, ar.Name)
	if err != nil {
		return nil, nil, err
	}
	defer d.Close()
	l := ar.Length
	if l < 0 || l > MaxAdminData {
		return nil, nil, fmt.Errorf("read of %d bytes: at most %d per request", l, MaxAdminData)
	}
	if ar.Offset < 0 || ar.Offset > d.Size() {
		return nil, nil, fmt.Errorf("vdi %q: offset %d outside its %d bytes", ar.Name, ar.Offset, d.Size())
	}
	l = min(l, d.Size()-ar.Offset)
	p := make([]byte, l)
	if _, err := d.ReadAt(ctx, p, ar.Offset); err != nil {
		return nil, nil, err
	}
	return map[string]int64{"size": d.Size()}, p, nil
}

func (n *Node) adminWrite(ctx context.Context, ar AdminRequest, data []byte) (any, []byte, error) {
	o, err := n.vdis.get(ctx, ar.Name)
	if err != nil {
		return nil, nil, err
	}
	if o.lock == nil {
		return nil, nil, &membership.LockedError{Name: ar.Name, Holder: o.holder}
	}
	if _, err := o.dev.WriteAt(ctx, data, ar.Offset, 0); err != nil {
		return nil, nil, err
	}
	if err := o.dev.Flush(ctx); err != nil {
		return nil, nil, err
	}
	return map[string]int64{"written": int64(len(data))}, nil, nil
}

// removeObjects asks every node to remove a deleted VDI's objects.
func (n *Node) removeObjects(ctx context.Context, vd membership.VDI) {
	v := n.views.View()
	for id, addr := range v.Addr {
		// Each node removes the VDI's directory at once (store.RemoveVDI),
		// tombstones and all: IDs are never reused, so nothing needs to
		// remember the objects. A node that misses this removes them when
		// it next recovers (it finds no VDI for them).
		var msg string
		if err := adminVia(ctx, n.net, addr, AdminRequest{Cmd: "vdi.purge", Object: uint64(object.Make(vd.ID, 0))}, &msg); err != nil {
			n.log.Warn("removing a deleted VDI's objects", "vdi", vd.Name, "on", id, "err", err)
		}
	}
}

// allocatedForCheck is vd's allocation map without the objects an
// operator gave up (ovis cluster mark-lost): reading as zeros is what
// was chosen for those, so their absence is no problem of check's.
func (n *Node) allocatedForCheck(ctx context.Context, vd membership.VDI) (*object.Set, error) {
	s, err := n.mc.Allocated(ctx, vd.ID)
	if err != nil {
		return nil, err
	}
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
func (n *Node) check(ctx context.Context) (*CheckReport, error) {
	// The view first: a table read after it has every change of copies
	// its epoch was made with (VDI.CopiesAt).
	v := n.views.View()
	vs, err := n.mc.ListVDIs(ctx)
	if err != nil {
		return nil, err
	}
	return Check(ctx, n.net, v, vs, n.allocatedForCheck, nil)
}
