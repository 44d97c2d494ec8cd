package node

import (
	"bytes"
	"context"
	"slices"
	"testing"
	"time"

	"github.com/ovis-storage/ovis/cluster/object"
	"github.com/ovis-storage/ovis/cluster/protocol"
)

// TestOnDemandRecoveryOncePerEpoch (issue 26, found by
// TestClusterEtcdTrouble): a node that is not yet known current for an
// object in a new epoch (a new replica, its run's listing not done)
// recovers it on the first request, and the copy is then current for the
// rest of the epoch. Each later request must not recover it again: while
// the epoch's writes are in flight, the replicas take disjoint writes in
// different orders, so a second decision by versions would pull another
// replica's copy over this one and lose a write this one took first.
//
// Here T replaces a replica that left, with its runs held. A first read
// recovers the object on T. Then a write reaches T only (in flight to
// the others), and two writes reach P only (in flight to T), so that P's
// version is above T's. A read of T must still show T's write.
func TestOnDemandRecoveryOncePerEpoch(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	nodes := startTestNodes(t, 4)
	mc := nodes[0].mc
	vd, _ := formatDisk(ctx, t, nodes, 4<<20)
	obj := object.Make(vd.ID, 0)
	reps, tn := placedNodes(t, nodes, obj, vd)
	p, s := reps[0], reps[2]
	exp, err := p.vdis.Lookup(ctx, "disk")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := exp.Device.WriteAt(ctx, bytes.Repeat([]byte{1}, 4096), 0, 0); err != nil {
		t.Fatal(err)
	}
	if err := exp.Device.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	lk, err := mc.LockOf(ctx, "disk")
	if err != nil {
		t.Fatal(err)
	}

	// T's runs wait: its copy is current only by recovery on demand.
	hold := make(chan struct{})
	defer close(hold)
	tn.rec.holdRuns.Store(&hold)
	if err := s.Close(ctx); err != nil {
		t.Fatal(err)
	}
	rest := []*Node{p, reps[1], tn}
	e2 := awaitView(t, rest, 3)
	if now, err := placeIn(tn.views.View(), obj, vd, nil); err != nil || !slices.Contains(now, tn.ID()) {
		t.Fatalf("T is not a replica in epoch %d: %v %v", e2, now, err)
	}
	if ok, err := tn.rec.known(ctx, obj, e2); ok || err != nil {
		t.Fatalf("T's copy is known current before any recovery (%v, %v): the test needs it not to be", ok, err)
	}
	pool := protocol.NewPool(nil)
	defer pool.Close()
	call := func(nd *Node, req protocol.Request) []byte {
		t.Helper()
		var resp protocol.Response
		if err := pool.Call(ctx, nd.Addr(), &req, &resp); err != nil {
			t.Fatalf("%s to %s: %v", req.Op, nd.ID(), err)
		}
		return resp.Payload
	}
	read := func(nd *Node, off uint64) byte {
		return call(nd, protocol.Request{Op: protocol.OpRead, Epoch: e2, Object: obj, Offset: off, Length: 4096})[0]
	}
	if got := read(tn, 0); got != 1 {
		t.Fatalf("T read %d after recovering on demand, want 1", got)
	}
	if ok, err := tn.rec.known(ctx, obj, e2); !ok || err != nil {
		t.Errorf("after recovering on demand, T's copy is not known current in epoch %d (%v)", e2, err)
	}

	write := func(nd *Node, off uint64, b byte) {
		call(nd, protocol.Request{Op: protocol.OpWrite, Epoch: e2, Token: lk.Token, Object: obj, Offset: off, Length: 4096, Payload: bytes.Repeat([]byte{b}, 4096)})
	}
	write(tn, 8192, 7) // reached T; in flight to P
	write(p, 16384, 8) // reached P; in flight to T
	write(p, 24576, 9) // reached P; in flight to T
	inT, err := tn.st.Stat(obj)
	if err != nil {
		t.Fatal(err)
	}
	inP, err := p.st.Stat(obj)
	if err != nil {
		t.Fatal(err)
	}
	if inP.Version <= inT.Version {
		t.Fatalf("P's version %#x is not above T's %#x: the test needs it", inP.Version, inT.Version)
	}
	if got := read(tn, 8192); got != 7 {
		t.Fatalf("T lost the write it took: it reads %d at 8192, want 7 (recovered again, from P's copy)", got)
	}
}
