package gateway_test

import (
	"context"
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ovis-storage/ovis/block"
	"github.com/ovis-storage/ovis/cluster/gateway"
	"github.com/ovis-storage/ovis/cluster/object"
	"github.com/ovis-storage/ovis/cluster/protocol"
	"github.com/ovis-storage/ovis/cluster/view"
	"github.com/ovis-storage/ovis/internal/histcheck"
)

// slowWrites delays every write to one node, as a replica that is far
// away or busy.
type slowWrites struct {
	next  gateway.Caller
	addr  string
	delay time.Duration
}

func (s *slowWrites) Call(ctx context.Context, addr string, req *protocol.Request, resp *protocol.Response) error {
	if addr == s.addr && req.Op == protocol.OpWrite {
		time.Sleep(s.delay)
	}
	return s.next.Call(ctx, addr, req, resp)
}

// TestReadsNeverGoBackInTime (issue 26): one gateway writes 1, 2, 3, …
// to a block, each write reaching one of the three replicas 20 ms late,
// while one reader goes back and forth between two other gateways, one
// that reads the fast replica first and one that reads the slow one.
// With gates no read returns less than a read before it. Ungated (the
// behaviour before gates) the reader goes back in time: the harness
// requires that it does, so that it can catch the fault it is for.
func TestReadsNeverGoBackInTime(t *testing.T) {
	for _, tc := range []struct {
		name    string
		ungated bool
	}{{"gated", false}, {"ungated", true}} {
		t.Run(tc.name, func(t *testing.T) {
			c := newCluster(t, 3, 1)
			fast, slow := c.nodes[0], c.nodes[2]
			open := func(token uint64, local string, net gateway.Caller) *gateway.Device {
				d, err := gateway.Open(ctx, gateway.Config{
					VDI: 7, Name: "test", Size: 4 << 20, Copies: 3, ObjectShift: object.MinSizeShift,
					Token: token, Views: view.Static{V: c.view}, Net: net, Local: local, RetryTimeout: 5 * time.Second,
				})
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { d.Close() })
				return d
			}
			w := open(1, c.nodes[1].id, &slowWrites{next: c.pool, addr: slow.addr, delay: 20 * time.Millisecond})
			if tc.ungated {
				gateway.Ungate(w)
			}
			readers := []*gateway.Device{open(0, fast.id, c.pool), open(0, slow.id, c.pool)}

			const writes = 30
			wrote := make(chan error, 1)
			go func() {
				p := make([]byte, 4096)
				for v := uint64(1); v <= writes; v++ {
					binary.BigEndian.PutUint64(p, v)
					if _, err := w.WriteAt(ctx, p, 0, 0); err != nil {
						wrote <- err
						return
					}
				}
				wrote <- nil
			}()
			var (
				seen, reads, back int
				p                 = make([]byte, 4096)
			)
			for done := false; !done; reads++ {
				select {
				case err := <-wrote:
					if err != nil {
						t.Fatal(err)
					}
					done = true
				default:
				}
				if _, err := readers[reads%2].ReadAt(ctx, p, 0); err != nil {
					t.Fatal(err)
				}
				v := int(binary.BigEndian.Uint64(p))
				if v < seen {
					back++
					if !tc.ungated {
						t.Errorf("read %d through the gateway on %s returned %d after a read returned %d", reads, []string{"the fast replica", "the slow replica"}[reads%2], v, seen)
					}
				}
				seen = max(seen, v)
			}
			t.Logf("%d reads, %d went back in time", reads, back)
			if tc.ungated && back == 0 {
				t.Fatalf("ungated, no read of %d went back in time: the harness cannot catch the fault", reads)
			}
		})
	}
}

// TestDeadWriterNotSeen (issue 26, after a writer's gateway dies
// mid-write): a gated write reached one replica of three and its
// gateway died before the others, so nobody settles it. Until the
// epoch changes every gateway reads the old data, whichever replica it
// reads first: the one that holds the write withholds it, and the read
// goes to another replica. Ungated, the gateway whose local replica
// took the write reads it, and the others do not.
func TestDeadWriterNotSeen(t *testing.T) {
	for _, tc := range []struct {
		name  string
		flags protocol.Flags
	}{{"gated", protocol.FlagGated}, {"ungated", 0}} {
		t.Run(tc.name, func(t *testing.T) {
			c := newCluster(t, 3, 1)
			w := c.open(t, nil, 1, 4<<20, 3)
			old := make([]byte, 4096)
			old[0] = 1
			if _, err := w.WriteAt(ctx, old, 0, 0); err != nil {
				t.Fatal(err)
			}
			// The dying writer's last write, to the second replica only.
			req := protocol.Request{Op: protocol.OpWrite, Flags: tc.flags, Epoch: 1, Token: 1, Object: object.Make(7, 0), Payload: make([]byte, 4096)}
			req.Payload[0] = 2
			if tc.flags != 0 {
				req.Gate = 99
			}
			var resp protocol.Response
			if err := c.pool.Call(ctx, c.nodes[1].addr, &req, &resp); err != nil {
				t.Fatal(err)
			}
			got := map[string]byte{}
			for _, n := range c.nodes {
				d, err := gateway.Open(ctx, gateway.Config{
					VDI: 7, Name: "test", Size: 4 << 20, Copies: 3, ObjectShift: object.MinSizeShift,
					Views: view.Static{V: c.view}, Net: c.pool, Local: n.id, RetryTimeout: 5 * time.Second,
				})
				if err != nil {
					t.Fatal(err)
				}
				p := make([]byte, 4096)
				if _, err := d.ReadAt(ctx, p, 0); err != nil {
					t.Fatal(err)
				}
				d.Close()
				got[n.id] = p[0]
			}
			agree := got[c.nodes[0].id] == got[c.nodes[1].id] && got[c.nodes[1].id] == got[c.nodes[2].id]
			switch {
			case tc.flags != 0 && (!agree || got[c.nodes[0].id] != 1):
				t.Fatalf("gated: the gateways read %v, want the old byte 1 everywhere", got)
			case tc.flags == 0 && agree:
				t.Fatalf("ungated: the gateways agree (%v): the test cannot tell gates from none", got)
			}
			t.Logf("first byte read through each node's gateway: %v", got)
		})
	}
}

// jitter delays every write to every node by a random 0–8 ms, so that
// replicas take each write at different times.
type jitter struct {
	next gateway.Caller
	mu   sync.Mutex
	r    *rand.Rand
}

func (j *jitter) Call(ctx context.Context, addr string, req *protocol.Request, resp *protocol.Response) error {
	if req.Op.Writes() {
		j.mu.Lock()
		d := time.Duration(j.r.IntN(8000)) * time.Microsecond
		j.mu.Unlock()
		time.Sleep(d)
	}
	return j.next.Call(ctx, addr, req, resp)
}

// TestGatewayHistory runs two writers through the VDI's writable
// gateway, every write reaching the three replicas at random times,
// and four readers through three other gateways (each reading its own
// node's replica first) on six blocks of two objects, for 1.5 s (longer
// on a loaded machine, until 50 writes and 200 reads), and
// has internal/histcheck judge the history: linearizable per block, so
// no stale or inverted read. Ungated, the checker must find reads that
// go back in time, so that the test can fail.
func TestGatewayHistory(t *testing.T) {
	for _, tc := range []struct {
		name    string
		ungated bool
	}{{"gated", false}, {"ungated", true}} {
		t.Run(tc.name, func(t *testing.T) {
			c := newCluster(t, 3, 1)
			open := func(token uint64, local string, net gateway.Caller) *gateway.Device {
				d, err := gateway.Open(ctx, gateway.Config{
					VDI: 7, Name: "test", Size: 4 << 20, Copies: 3, ObjectShift: object.MinSizeShift,
					Token: token, Views: view.Static{V: c.view}, Net: net, Local: local, RetryTimeout: 5 * time.Second,
				})
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { d.Close() })
				return d
			}
			w := open(1, c.nodes[0].id, &jitter{next: c.pool, r: rand.New(rand.NewPCG(1, 2))})
			if tc.ungated {
				gateway.Ungate(w)
			}
			var readers []*gateway.Device
			for _, n := range c.nodes {
				readers = append(readers, open(0, n.id, c.pool))
			}
			// Blocks 0–2 in object 0, 3–5 in object 1 (1 MiB objects).
			blockOff := func(reg int) int64 { return int64(reg/3)<<object.MinSizeShift + int64(reg%3)*8192 }
			var (
				rec   histcheck.Recorder
				next  atomic.Uint64
				start = time.Now()
				wg    sync.WaitGroup
			)
			// 1.5 s, or up to 10 s on a loaded machine until enough was
			// done to tell anything.
			var wrote, read atomic.Int64
			more := func() bool {
				el := time.Since(start)
				return el < 1500*time.Millisecond || el < 10*time.Second && (wrote.Load() < 50 || read.Load() < 200)
			}
			for cl := range 6 {
				wg.Go(func() {
					r := rand.New(rand.NewPCG(uint64(cl), 7))
					for more() {
						reg := r.IntN(6)
						if cl < 2 {
							v := next.Add(1)
							op := histcheck.Op{Kind: histcheck.Write, Register: reg, Value: v, Client: cl, Gateway: 0, Mode: "fua", Start: time.Since(start)}
							_, err := w.WriteAt(ctx, histcheck.Encode(reg, v), blockOff(reg), block.FUA)
							op.End, op.Outcome = time.Since(start), histcheck.OK
							if err != nil {
								op.Outcome, op.Err = histcheck.Failed, err.Error()
							} else {
								wrote.Add(1)
							}
							rec.Add(op)
							continue
						}
						g := r.IntN(len(readers))
						p := make([]byte, histcheck.BlockSize)
						op := histcheck.Op{Kind: histcheck.Read, Register: reg, Client: cl, Gateway: 1 + g, Start: time.Since(start)}
						_, err := readers[g].ReadAt(ctx, p, blockOff(reg))
						op.End, op.Outcome, op.Data = time.Since(start), histcheck.OK, p
						if err != nil {
							op.Outcome, op.Err, op.Data = histcheck.Failed, err.Error(), nil
						} else {
							read.Add(1)
						}
						rec.Add(op)
					}
				})
			}
			wg.Wait()
			rep, err := histcheck.Check(rec.Ops())
			if err != nil {
				t.Fatal(err)
			}
			by := rep.ByKind()
			t.Logf("%+v; violations %v", rep.Counts, by)
			if rep.Counts.WritesOK < 50 || rep.Counts.ReadsOK < 200 {
				t.Fatalf("too little done to tell anything: %+v", rep.Counts)
			}
			switch {
			case !tc.ungated && len(rep.Violations) > 0:
				t.Fatalf("%d violations:\n%s", len(rep.Violations), rep.Summary(10))
			case tc.ungated && by[histcheck.InvertedRead]+by[histcheck.StaleRead] == 0:
				t.Fatalf("ungated, no read went back in time: the test cannot catch the fault")
			}
		})
	}
}

// settleCounter counts the gate ids settled per node, and the writes'
// gate ids.
type settleCounter struct {
	next  gateway.Caller
	mu    sync.Mutex
	gates map[string]map[uint64]int // by address: gate id → writes sent
	settl map[string]map[uint64]int // by address: gate id → settles
}

func (s *settleCounter) Call(ctx context.Context, addr string, req *protocol.Request, resp *protocol.Response) error {
	s.mu.Lock()
	switch {
	case req.Op.Writes():
		if req.Flags&protocol.FlagGated == 0 {
			s.mu.Unlock()
			return fmt.Errorf("an ungated %s", req.Op)
		}
		s.gates[addr][req.Gate]++
	case req.Op == protocol.OpSettle:
		ids, err := protocol.ParseSettleIDs(nil, req.Payload)
		if err != nil {
			s.mu.Unlock()
			return err
		}
		for _, id := range ids {
			s.settl[addr][id]++
		}
	}
	s.mu.Unlock()
	return s.next.Call(ctx, addr, req, resp)
}

// TestSettles: every gated write is settled once on every replica it
// reached, off the acknowledgement, in batches; every write piece has
// its own gate id; Close waits for the settles owed.
func TestSettles(t *testing.T) {
	c := newCluster(t, 3, 1)
	sc := &settleCounter{next: c.pool, gates: map[string]map[uint64]int{}, settl: map[string]map[uint64]int{}}
	for _, n := range c.nodes {
		sc.gates[n.addr], sc.settl[n.addr] = map[uint64]int{}, map[uint64]int{}
	}
	d, err := gateway.Open(ctx, gateway.Config{
		VDI: 7, Name: "test", Size: 4 << 20, Copies: 3, ObjectShift: object.MinSizeShift,
		Token: 1, Views: view.Static{V: c.view}, Net: sc, Local: c.nodes[0].id, RetryTimeout: 5 * time.Second,
	})
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	pieces := 0
	for i := range 15 {
		// Writes within objects (1 MiB) and across their boundaries
		// (every fourth).
		off := int64(i+1)*(256<<10) - 4096
		pieces += int((off+8192-1)>>object.MinSizeShift - off>>object.MinSizeShift + 1)
		wg.Go(func() {
			if _, err := d.WriteAt(ctx, make([]byte, 8192), off, 0); err != nil {
				t.Error(err)
			}
		})
	}
	wg.Wait()
	if err := d.Discard(ctx, 0, 1<<20, 0); err != nil {
		t.Fatal(err)
	}
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	if pieces != 18 {
		t.Fatalf("%d pieces: the writes do not cross objects as meant", pieces)
	}
	sc.mu.Lock()
	defer sc.mu.Unlock()
	for _, n := range c.nodes {
		if got := len(sc.gates[n.addr]); got != pieces+1 {
			t.Errorf("node %s got %d gate ids, want %d (one per write piece, one for the remove)", n.id, got, pieces+1)
		}
		for id := range sc.gates[n.addr] {
			if sc.settl[n.addr][id] != 1 {
				t.Errorf("node %s: gate %#x settled %d times", n.id, id, sc.settl[n.addr][id])
			}
		}
		if len(sc.settl[n.addr]) != len(sc.gates[n.addr]) {
			t.Errorf("node %s: %d gates settled, %d sent", n.id, len(sc.settl[n.addr]), len(sc.gates[n.addr]))
		}
	}
}

// TestFailedWriteSettles: a write refused for good (a stale token) is
// settled on every replica it was sent to all the same.
func TestFailedWriteSettles(t *testing.T) {
	c := newCluster(t, 3, 1)
	sc := &settleCounter{next: c.pool, gates: map[string]map[uint64]int{}, settl: map[string]map[uint64]int{}}
	for _, n := range c.nodes {
		sc.gates[n.addr], sc.settl[n.addr] = map[uint64]int{}, map[uint64]int{}
	}
	d, err := gateway.Open(ctx, gateway.Config{
		VDI: 7, Name: "test", Size: 4 << 20, Copies: 3, ObjectShift: object.MinSizeShift,
		Token: 1, Views: view.Static{V: c.view}, Net: sc, Local: c.nodes[0].id, RetryTimeout: 5 * time.Second,
	})
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range c.nodes {
		var resp protocol.Response
		if err := c.pool.Call(ctx, n.addr, &protocol.Request{Op: protocol.OpFence, Epoch: 1, Token: 5, Object: object.Make(7, 0)}, &resp); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := d.WriteAt(ctx, make([]byte, 4096), 0, 0); err == nil {
		t.Fatal("a write with a stale token succeeded")
	}
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	sc.mu.Lock()
	defer sc.mu.Unlock()
	for _, n := range c.nodes {
		if len(sc.gates[n.addr]) != 1 || len(sc.settl[n.addr]) != 1 {
			t.Errorf("node %s: %d gates sent, %d settled; want 1 and 1", n.id, len(sc.gates[n.addr]), len(sc.settl[n.addr]))
		}
	}
}

// TestGatedEverywhereFails: a write gated on every replica and never
// settled (its gateway died after every acknowledgement, before its
// settles; no epoch change yet) makes reads of its range fail once the
// gateway's retries are over: an error, never zeros, never a hang.
// Reads elsewhere in the object are served.
func TestGatedEverywhereFails(t *testing.T) {
	c := newCluster(t, 3, 1)
	for _, n := range c.nodes {
		req := protocol.Request{Op: protocol.OpWrite, Flags: protocol.FlagGated, Gate: 1, Epoch: 1, Token: 1, Object: object.Make(7, 0), Payload: []byte("gated, never settled")}
		var resp protocol.Response
		if err := c.pool.Call(ctx, n.addr, &req, &resp); err != nil {
			t.Fatal(err)
		}
	}
	d, err := gateway.Open(ctx, gateway.Config{
		VDI: 7, Name: "test", Size: 4 << 20, Copies: 3, ObjectShift: object.MinSizeShift,
		Views: view.Static{V: c.view}, Net: c.pool, Local: c.nodes[0].id, RetryTimeout: time.Second,
	})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	p := make([]byte, 4096)
	if _, err := d.ReadAt(ctx, p, 4096); err != nil {
		t.Fatalf("a read beside the gate: %v", err)
	}
	start := time.Now()
	_, err = d.ReadAt(ctx, p, 0)
	took := time.Since(start)
	t.Logf("after %v: %v", took.Round(time.Millisecond), err)
	if err == nil {
		t.Fatalf("a read of a range gated everywhere returned %q", p[:20])
	}
	if took > 10*time.Second {
		t.Fatalf("the read took %v to fail", took)
	}
}
