package admin

import (
	"context"
	"fmt"
	"slices"

	"github.com/ovis-storage/ovis/cluster/membership"
)

// Verb names an admin request on the wire ("info", "vdi.create", …).
type Verb string

// Call declares one verb with its request type Req and its reply type
// Rep. Every verb has exactly one Call, below; the client sends with it
// (Do) and the server routes with it (routes), so both sides take their
// types from the same place.
type Call[Req, Rep any] struct {
	Verb Verb
}

// The operator's verbs: the command line's.
var (
	GetInfo      = Call[None, Info]{"info"}
	Format       = Call[FormatRequest, membership.Format]{"format"}
	NodeList     = Call[None, []NodeStatus]{"node.list"}
	NodeRemove   = Call[NameRequest, NodeRemoved]{"node.remove"}
	VDICreate    = Call[VDICreateRequest, membership.VDI]{"vdi.create"}
	VDIList      = Call[None, []membership.VDI]{"vdi.list"}
	VDIAllocated = Call[NameRequest, []AllocChunk]{"vdi.allocated"}
	VDIDelete    = Call[NameRequest, membership.VDI]{"vdi.delete"}
	VDIResize    = Call[VDIResizeRequest, membership.VDI]{"vdi.resize"}
	VDIAlterCopy = Call[VDIAlterCopyRequest, membership.VDI]{"vdi.alter-copy"}
	VDIRead      = Call[VDIReadRequest, VDIReadReply]{"vdi.read"}
	VDIWrite     = Call[VDIWriteRequest, VDIWriteReply]{"vdi.write"}
	LockList     = Call[None, []membership.Lock]{"lock.list"}
	LockBreak    = Call[NameRequest, membership.Lock]{"lock.break"}
	Check        = Call[None, CheckReport]{"check"}
	LostMark     = Call[LostMarkRequest, []UnfoundObject]{"lost.mark"}
	RecoverySet  = Call[RecoverySetRequest, RecoveryStats]{"recovery.set"}
)

// The peer verbs: what nodes ask of each other, and what repair asks of
// the node that holds a copy (see the package doc for why they stay on
// this plane).
var (
	NodeSelf        = Call[None, NodeStatus]{"node.self"}
	RecoveryUnfound = Call[None, []UnfoundObject]{"recovery.unfound"}
	RecoveryKick    = Call[None, Ack]{"recovery.kick"}
	ObjectRecover   = Call[ObjectRequest, Ack]{"object.recover"}
	ObjectReplace   = Call[ObjectReplaceRequest, Ack]{"object.replace"}
	ObjectDrop      = Call[ObjectRequest, Ack]{"object.drop"}
	VDIPurge        = Call[ObjectRequest, Ack]{"vdi.purge"}
)

// Handler serves every verb: one method per Call, named after it, with
// the Call's request and reply. A node implements it; Serve routes to
// it. An error refuses the request, with its text as the node's answer.
type Handler interface {
	Info(context.Context, None) (Info, error)
	Format(context.Context, FormatRequest) (membership.Format, error)
	NodeList(context.Context, None) ([]NodeStatus, error)
	NodeRemove(context.Context, NameRequest) (NodeRemoved, error)
	VDICreate(context.Context, VDICreateRequest) (membership.VDI, error)
	VDIList(context.Context, None) ([]membership.VDI, error)
	VDIAllocated(context.Context, NameRequest) ([]AllocChunk, error)
	VDIDelete(context.Context, NameRequest) (membership.VDI, error)
	VDIResize(context.Context, VDIResizeRequest) (membership.VDI, error)
	VDIAlterCopy(context.Context, VDIAlterCopyRequest) (membership.VDI, error)
	VDIRead(context.Context, VDIReadRequest) (VDIReadReply, error)
	VDIWrite(context.Context, VDIWriteRequest) (VDIWriteReply, error)
	LockList(context.Context, None) ([]membership.Lock, error)
	LockBreak(context.Context, NameRequest) (membership.Lock, error)
	Check(context.Context, None) (CheckReport, error)
	LostMark(context.Context, LostMarkRequest) ([]UnfoundObject, error)
	RecoverySet(context.Context, RecoverySetRequest) (RecoveryStats, error)

	NodeSelf(context.Context, None) (NodeStatus, error)
	RecoveryUnfound(context.Context, None) ([]UnfoundObject, error)
	RecoveryKick(context.Context, None) (Ack, error)
	ObjectRecover(context.Context, ObjectRequest) (Ack, error)
	ObjectReplace(context.Context, ObjectReplaceRequest) (Ack, error)
	ObjectDrop(context.Context, ObjectRequest) (Ack, error)
	VDIPurge(context.Context, ObjectRequest) (Ack, error)
}

// route serves one verb: it decodes the request's JSON (and raw bytes)
// into the Call's request type, calls the Handler's method and returns
// the reply with its raw bytes.
type route func(ctx context.Context, h Handler, body, raw []byte) (reply any, replyRaw []byte, err error)

// handle binds a Call to the Handler method that serves it; the compiler
// checks that the method takes and returns the Call's types.
func handle[Req, Rep any](c Call[Req, Rep], m func(Handler, context.Context, Req) (Rep, error)) binding {
	return binding{c.Verb, func(ctx context.Context, h Handler, body, raw []byte) (any, []byte, error) {
		var req Req
		if err := decodeBody(c.Verb, body, raw, &req); err != nil {
			return nil, nil, err
		}
		rep, err := m(h, ctx, req)
		if err != nil {
			return nil, nil, err
		}
		return rep, rawOf(rep), nil
	}}
}

// binding is a verb and its route.
type binding struct {
	verb  Verb
	serve route
}

// routes is every verb's route, the only dispatch of the plane.
var routes = index(
	handle(GetInfo, Handler.Info),
	handle(Format, Handler.Format),
	handle(NodeList, Handler.NodeList),
	handle(NodeRemove, Handler.NodeRemove),
	handle(VDICreate, Handler.VDICreate),
	handle(VDIList, Handler.VDIList),
	handle(VDIAllocated, Handler.VDIAllocated),
	handle(VDIDelete, Handler.VDIDelete),
	handle(VDIResize, Handler.VDIResize),
	handle(VDIAlterCopy, Handler.VDIAlterCopy),
	handle(VDIRead, Handler.VDIRead),
	handle(VDIWrite, Handler.VDIWrite),
	handle(LockList, Handler.LockList),
	handle(LockBreak, Handler.LockBreak),
	handle(Check, Handler.Check),
	handle(LostMark, Handler.LostMark),
	handle(RecoverySet, Handler.RecoverySet),
	handle(NodeSelf, Handler.NodeSelf),
	handle(RecoveryUnfound, Handler.RecoveryUnfound),
	handle(RecoveryKick, Handler.RecoveryKick),
	handle(ObjectRecover, Handler.ObjectRecover),
	handle(ObjectReplace, Handler.ObjectReplace),
	handle(ObjectDrop, Handler.ObjectDrop),
	handle(VDIPurge, Handler.VDIPurge),
)

// index builds the routing table. A verb bound twice is a programming
// error: it panics when the package is initialized, so no build with it
// passes a test.
func index(bs ...binding) map[Verb]route {
	m := make(map[Verb]route, len(bs))
	for _, b := range bs {
		if _, dup := m[b.verb]; dup || b.verb == "" {
			panic(fmt.Sprintf("admin: verb %q bound twice or empty", b.verb))
		}
		m[b.verb] = b.serve
	}
	return m
}

// Verbs returns every verb Serve routes, sorted.
func Verbs() []Verb {
	out := make([]Verb, 0, len(routes))
	for v := range routes {
		out = append(out, v)
	}
	slices.Sort(out)
	return out
}
