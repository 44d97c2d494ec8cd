package admin

import (
	"context"
	"errors"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/ovis-storage/ovis/cluster/membership"
	"github.com/ovis-storage/ovis/cluster/object"
	"github.com/ovis-storage/ovis/cluster/protocol"
)

// fake is a Handler that records the request it was given and answers
// with the reply the test set for the verb.
type fake struct {
	got     any
	replies map[Verb]any
}

func answer[Req, Rep any](f *fake, k Call[Req, Rep], req Req) (Rep, error) {
	f.got = req
	rep, _ := f.replies[k.Verb].(Rep)
	return rep, nil
}

func (f *fake) Info(_ context.Context, r None) (Info, error) { return answer(f, GetInfo, r) }
func (f *fake) Format(_ context.Context, r FormatRequest) (membership.Format, error) {
	return answer(f, Format, r)
}
func (f *fake) NodeList(_ context.Context, r None) ([]NodeStatus, error) {
	return answer(f, NodeList, r)
}
func (f *fake) NodeRemove(_ context.Context, r NameRequest) (NodeRemoved, error) {
	return answer(f, NodeRemove, r)
}
func (f *fake) VDICreate(_ context.Context, r VDICreateRequest) (membership.VDI, error) {
	return answer(f, VDICreate, r)
}
func (f *fake) VDIList(_ context.Context, r None) ([]membership.VDI, error) {
	return answer(f, VDIList, r)
}
func (f *fake) VDIAllocated(_ context.Context, r NameRequest) ([]AllocChunk, error) {
	return answer(f, VDIAllocated, r)
}
func (f *fake) VDIDelete(_ context.Context, r NameRequest) (membership.VDI, error) {
	return answer(f, VDIDelete, r)
}
func (f *fake) VDIResize(_ context.Context, r VDIResizeRequest) (membership.VDI, error) {
	return answer(f, VDIResize, r)
}
func (f *fake) VDIAlterCopy(_ context.Context, r VDIAlterCopyRequest) (membership.VDI, error) {
	return answer(f, VDIAlterCopy, r)
}
func (f *fake) VDIRead(_ context.Context, r VDIReadRequest) (VDIReadReply, error) {
	return answer(f, VDIRead, r)
}
func (f *fake) VDIWrite(_ context.Context, r VDIWriteRequest) (VDIWriteReply, error) {
	return answer(f, VDIWrite, r)
}
func (f *fake) LockList(_ context.Context, r None) ([]membership.Lock, error) {
	return answer(f, LockList, r)
}
func (f *fake) LockBreak(_ context.Context, r NameRequest) (membership.Lock, error) {
	return answer(f, LockBreak, r)
}
func (f *fake) Check(_ context.Context, r None) (CheckReport, error) { return answer(f, Check, r) }
func (f *fake) LostMark(_ context.Context, r LostMarkRequest) ([]UnfoundObject, error) {
	return answer(f, LostMark, r)
}
func (f *fake) RecoverySet(_ context.Context, r RecoverySetRequest) (RecoveryStats, error) {
	return answer(f, RecoverySet, r)
}
func (f *fake) NodeSelf(_ context.Context, r None) (NodeStatus, error) { return answer(f, NodeSelf, r) }
func (f *fake) RecoveryUnfound(_ context.Context, r None) ([]UnfoundObject, error) {
	return answer(f, RecoveryUnfound, r)
}
func (f *fake) RecoveryKick(_ context.Context, r None) (Ack, error) {
	return answer(f, RecoveryKick, r)
}
func (f *fake) ObjectRecover(_ context.Context, r ObjectRequest) (Ack, error) {
	return answer(f, ObjectRecover, r)
}
func (f *fake) ObjectReplace(_ context.Context, r ObjectReplaceRequest) (Ack, error) {
	return answer(f, ObjectReplace, r)
}
func (f *fake) ObjectDrop(_ context.Context, r ObjectRequest) (Ack, error) {
	return answer(f, ObjectDrop, r)
}
func (f *fake) VDIPurge(_ context.Context, r ObjectRequest) (Ack, error) {
	return answer(f, VDIPurge, r)
}

var _ Handler = (*fake)(nil)

// loopback is a Caller that serves OpAdmin in process, refusing as a
// node does (admin.Status, the error's text as the message).
type loopback struct{ h Handler }

func (l loopback) Call(ctx context.Context, _ string, req *protocol.Request, resp *protocol.Response) error {
	if req.Op != protocol.OpAdmin {
		return errors.New("loopback: not an admin request")
	}
	p, err := Serve(ctx, l.h, req.Payload)
	if err != nil {
		return &protocol.Error{Status: Status(err), Op: req.Op, Msg: err.Error()}
	}
	resp.Status, resp.Payload = protocol.StatusOK, p
	return nil
}

// roundTrip is one verb's case: req goes through the codec to the
// handler unchanged, and rep comes back unchanged.
type roundTrip struct {
	verb Verb
	run  func(t *testing.T, c *Client, f *fake)
}

func rt[Req, Rep any](k Call[Req, Rep], req Req, rep Rep) roundTrip {
	return roundTrip{k.Verb, func(t *testing.T, c *Client, f *fake) {
		f.replies[k.Verb] = rep
		got, err := k.Do(context.Background(), c, req)
		if err != nil {
			t.Fatalf("%s: %v", k.Verb, err)
		}
		if !reflect.DeepEqual(f.got, req) {
			t.Errorf("%s: the handler got %#v, want %#v", k.Verb, f.got, req)
		}
		if !reflect.DeepEqual(got, rep) {
			t.Errorf("%s: the client got %#v, want %#v", k.Verb, got, rep)
		}
	}}
}

func TestEveryVerbRoundTrips(t *testing.T) {
	when := time.Date(2026, 12, 6, 20, 0, 0, 0, time.UTC)
	vdi := membership.VDI{Name: "disk0", ID: 7, Size: 1 << 30, Copies: 2, ObjectShift: 22, State: membership.StateReady, Created: when}
	f := membership.Format{ClusterID: "c1", Copies: 3, ObjectShift: 22, Created: when, Strict: true}
	ns := NodeStatus{ID: "n1", Addr: "127.0.0.1:7000", State: "up", Epoch: 4, Recovery: RecoveryStats{Epoch: 4, Done: 3, UnfoundOn: []string{"n2"}}}
	unf := []UnfoundObject{{Object: "0000000700000001", VDI: "disk0", On: []string{"n2"}, Epoch: 4}}
	rate, paused := int64(1<<20), true
	obj := object.Make(7, 1)
	cases := []roundTrip{
		rt(GetInfo, None{}, Info{Node: "n1", Etcd: []string{"http://e"}, Format: &f, Epoch: 4, Nodes: []membership.NodeInfo{{ID: "n1", Addr: "a"}}, Unfound: 1, UnfoundOn: []string{"n2"}}),
		rt(Format, FormatRequest{Copies: 3, ObjectShift: 22, Force: true, Strict: true}, f),
		rt(NodeList, None{}, []NodeStatus{ns}),
		rt(NodeRemove, NameRequest{Name: "n9"}, NodeRemoved{Removed: "n9"}),
		rt(VDICreate, VDICreateRequest{Name: "disk0", Size: 1 << 30, Copies: 2, ObjectShift: 22}, vdi),
		rt(VDIList, None{}, []membership.VDI{vdi}),
		rt(VDIAllocated, NameRequest{Name: "disk0"}, []AllocChunk{{Chunk: 1, Bits: []byte{1, 2}}}),
		rt(VDIDelete, NameRequest{Name: "disk0"}, vdi),
		rt(VDIResize, VDIResizeRequest{Name: "disk0", Size: 1 << 20, Shrink: true}, vdi),
		rt(VDIAlterCopy, VDIAlterCopyRequest{Name: "disk0", Copies: 3}, vdi),
		rt(VDIRead, VDIReadRequest{Name: "disk0", Offset: 512, Length: 3}, VDIReadReply{Size: 1 << 30, Data: []byte("abc")}),
		rt(VDIWrite, VDIWriteRequest{Name: "disk0", Offset: 512, Data: []byte("xyz")}, VDIWriteReply{Written: 3}),
		rt(LockList, None{}, []membership.Lock{{Name: "disk0", Holder: "n1", Token: 5}}),
		rt(LockBreak, NameRequest{Name: "disk0"}, membership.Lock{Name: "disk0", Holder: "n1", Token: 5}),
		rt(Check, None{}, CheckReport{Objects: 2, Copies: 4, Bad: []CheckResult{{VDI: "disk0", Object: obj.String(), Problem: "p", Kind: "differ",
			Groups: []CheckGroup{{CRC: 9, Version: 2, Nodes: []string{"n1"}}}}}}),
		rt(LostMark, LostMarkRequest{Object: obj, All: true}, unf),
		rt(RecoverySet, RecoverySetRequest{Recovery: &RecoveryControl{MaxRate: &rate, Paused: &paused}}, RecoveryStats{Epoch: 4, Paused: true, MaxRate: rate}),
		rt(NodeSelf, None{}, ns),
		rt(RecoveryUnfound, None{}, unf),
		rt(RecoveryKick, None{}, Ack("kicked")),
		rt(ObjectRecover, ObjectRequest{Object: obj}, Ack("recovered")),
		rt(ObjectReplace, ObjectReplaceRequest{Object: obj, Source: "n2"}, Ack("replaced")),
		rt(ObjectDrop, ObjectRequest{Object: obj}, Ack("dropped")),
		rt(VDIPurge, ObjectRequest{Object: obj}, Ack("purged")),
	}
	h := &fake{replies: map[Verb]any{}}
	c := Via(loopback{h}, "node")
	seen := map[Verb]bool{}
	for _, tc := range cases {
		t.Run(string(tc.verb), func(t *testing.T) { tc.run(t, c, h) })
		seen[tc.verb] = true
	}
	for _, v := range Verbs() {
		if !seen[v] {
			t.Errorf("verb %q is routed but has no round-trip case", v)
		}
	}
	if len(seen) != len(Verbs()) {
		t.Errorf("%d cases for %d routed verbs", len(seen), len(Verbs()))
	}
}

func TestUnknownVerbIsRefusedByName(t *testing.T) {
	p, err := encodeRequest("vdi.frobnicate", None{})
	if err != nil {
		t.Fatal(err)
	}
	_, err = Serve(context.Background(), &fake{}, p)
	var uv *UnknownVerbError
	if !errors.As(err, &uv) || uv.Verb != "vdi.frobnicate" {
		t.Fatalf("Serve: %v, want an UnknownVerbError for vdi.frobnicate", err)
	}
	// Through a client, the refusal reads as the node worded it and
	// keeps its status.
	_, err = Call[None, None]{"vdi.frobnicate"}.Do(context.Background(), Via(loopback{&fake{}}, "node"), None{})
	if err == nil || !strings.Contains(err.Error(), `"vdi.frobnicate"`) || protocol.StatusOf(err) != protocol.StatusEINVAL {
		t.Fatalf("client: %v (status %v), want a refusal naming the verb with EINVAL", err, protocol.StatusOf(err))
	}
}

// The wire keeps the field names of the untyped plane, so that nodes
// and command lines of both sides of the change understand each other.
func TestRequestWire(t *testing.T) {
	for _, tc := range []struct {
		verb Verb
		req  any
		want string
	}{
		{"info", None{}, `{"cmd":"info"}`},
		{"vdi.create", VDICreateRequest{Name: "a", Size: 512, Copies: 2}, `{"cmd":"vdi.create","name":"a","size":512,"copies":2}`},
		{"recovery.set", RecoverySetRequest{Recovery: &RecoveryControl{}}, `{"cmd":"recovery.set","recovery":{}}`},
		{"object.replace", ObjectReplaceRequest{Object: 1 << 32, Source: "n2"}, `{"cmd":"object.replace","object":4294967296,"source":"n2"}`},
		{"vdi.write", VDIWriteRequest{Name: "a", Data: []byte("raw")}, `{"cmd":"vdi.write","name":"a"}raw`},
	} {
		p, err := encodeRequest(tc.verb, tc.req)
		if err != nil {
			t.Fatal(err)
		}
		if got := string(p[4:]); got != tc.want {
			t.Errorf("%s: %s, want %s", tc.verb, got, tc.want)
		}
	}
}

func TestMalformedPayloadsAreRefused(t *testing.T) {
	for _, p := range [][]byte{nil, {0, 0}, {0, 0, 0, 9, '{'}, frame([]byte("not json"), nil), frame([]byte(`{"cmd":"info"}`), []byte("raw"))} {
		if _, err := Serve(context.Background(), &fake{replies: map[Verb]any{}}, p); err == nil {
			t.Errorf("payload %q: served", p)
		}
	}
}
