package node

import (
	"context"
	"errors"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/ovis-storage/ovis/cluster/object"
	"github.com/ovis-storage/ovis/cluster/protocol"
	"github.com/ovis-storage/ovis/cluster/store"
)

// movingEpoch is a node's epoch that the test moves.
type movingEpoch struct {
	mu sync.Mutex
	e  uint64
}

func (m *movingEpoch) Epoch() uint64                            { m.mu.Lock(); defer m.mu.Unlock(); return m.e }
func (m *movingEpoch) AwaitEpoch(context.Context, uint64) error { return nil }
func (m *movingEpoch) set(e uint64)                             { m.mu.Lock(); m.e = e; m.mu.Unlock() }

// TestRecoveryWaitsForOlderWrites: a write admitted in epoch 1 is still
// being applied when the node moves to epoch 2. Recovery's look at the
// copy in epoch 2 (a stat, a listing, a read as it is) waits for it, so
// that it sees the write: a new replica deciding from a look taken
// before would keep a copy without it. A write of epoch 1 that comes
// after the move is refused; when the older write does not end within
// CatchUp, recovery is refused (StatusNewEpoch) and tries again.
func TestRecoveryWaitsForOlderWrites(t *testing.T) {
	obj := object.Make(3, 0)
	for _, tc := range []struct {
		name    string
		release bool // the older write ends while recovery waits
		want    protocol.Status
	}{
		{"the write ends", true, protocol.StatusOK},
		{"the write hangs", false, protocol.StatusNewEpoch},
	} {
		t.Run(tc.name, func(t *testing.T) {
			st, err := store.Open(t.TempDir(), store.Options{})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { st.Close() })
			ep := &movingEpoch{e: 1}
			entered, release := make(chan struct{}), make(chan struct{})
			h := &Handler{Store: st, Epochs: ep, CatchUp: 500 * time.Millisecond,
				Ready: func(ctx context.Context, o object.ID, e uint64, write bool) (func(), error) {
					if e == 1 {
						// The write was admitted; the node is slow to apply it.
						close(entered)
						select {
						case <-release:
						case <-ctx.Done():
						}
					}
					return func() {}, nil
				}}
			wctx, cancel := context.WithCancel(ctx)
			defer cancel()
			wrote := make(chan protocol.Status, 1)
			go func() {
				var resp protocol.Response
				h.Serve(wctx, &protocol.Request{Op: protocol.OpWrite, Epoch: 1, Token: 1, Object: obj, Length: 4096, Payload: make([]byte, 4096)}, &resp)
				wrote <- resp.Status
			}()
			<-entered
			ep.set(2)

			var late protocol.Response
			h.Serve(ctx, &protocol.Request{Op: protocol.OpWrite, Epoch: 1, Token: 1, Object: obj, Offset: 4096, Length: 4096, Payload: make([]byte, 4096)}, &late)
			if late.Status != protocol.StatusOldEpoch {
				t.Fatalf("a write of epoch 1 after the move: %v, want %v", late.Status, protocol.StatusOldEpoch)
			}

			stat := make(chan protocol.Status, 1)
			start := time.Now()
			go func() {
				var resp protocol.Response
				h.Serve(ctx, &protocol.Request{Op: protocol.OpStat, Flags: protocol.FlagRecovery, Epoch: 2, Object: obj}, &resp)
				stat <- resp.Status
			}()
			select {
			case s := <-stat:
				t.Fatalf("recovery's stat answered %v while a write of epoch 1 was still being applied", s)
			case <-time.After(200 * time.Millisecond):
			}
			if tc.release {
				close(release)
				if s := <-wrote; s != protocol.StatusOK {
					t.Fatalf("the older write: %v", s)
				}
			}
			s := <-stat
			if s != tc.want {
				t.Fatalf("recovery's stat: %v after %v, want %v", s, time.Since(start).Round(time.Millisecond), tc.want)
			}
			if !tc.release {
				if d := time.Since(start); d < 500*time.Millisecond {
					t.Fatalf("refused after %v, before CatchUp", d)
				}
				cancel()
				<-wrote
			}
			// A request of the new epoch that is not recovery's does not wait.
			var plain protocol.Response
			h.Serve(ctx, &protocol.Request{Op: protocol.OpWrite, Epoch: 2, Token: 1, Object: obj, Offset: 8192, Length: 4096, Payload: make([]byte, 4096)}, &plain)
			if plain.Status != protocol.StatusOK {
				t.Fatalf("a write of epoch 2: %v", plain.Status)
			}
		})
	}
}

// TestSameRefusalLocalAndRemote: a malformed request gets the same
// refusal, status and message, whether the node's own gateway serves it
// in process (localCaller) or it comes over TCP (protocol.Server): both
// paths apply the one op table.
func TestSameRefusalLocalAndRemote(t *testing.T) {
	st, err := store.Open(t.TempDir(), store.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	h := &Handler{Store: st, Epochs: fixedEpoch(1)}
	srv := protocol.NewServer(h, protocol.ServerOptions{})
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go srv.Serve(lis)
	t.Cleanup(func() { srv.Shutdown(context.Background()) })
	pool := protocol.NewPool(nil)
	t.Cleanup(func() { pool.Close() })
	local := &localCaller{self: "self", h: h, pool: pool}
	obj := object.Make(3, 1)
	for _, tc := range []struct {
		name string
		req  protocol.Request
		want protocol.Status
	}{
		{"unknown op", protocol.Request{Op: 99, Epoch: 1, Object: obj}, protocol.StatusUnsupported},
		{"a gated stat", protocol.Request{Op: protocol.OpStat, Flags: protocol.FlagGated, Epoch: 1, Object: obj}, protocol.StatusEINVAL},
		{"a read past the largest object", protocol.Request{Op: protocol.OpRead, Epoch: 1, Object: obj, Offset: protocol.MaxObjectSpan, Length: 4096}, protocol.StatusEINVAL},
		{"a read too big for a reply", protocol.Request{Op: protocol.OpRead, Epoch: 1, Object: obj, Length: protocol.MaxPayload + 1}, protocol.StatusTooBig},
		{"a read of VDI 0", protocol.Request{Op: protocol.OpRead, Epoch: 1, Object: object.Make(0, 1), Length: 4096}, protocol.StatusEINVAL},
		{"a flush with an offset", protocol.Request{Op: protocol.OpFlush, Epoch: 1, Object: obj, Offset: 5}, protocol.StatusEINVAL},
		{"a settle of 3 bytes", protocol.Request{Op: protocol.OpSettle, Object: obj, Payload: []byte{1, 2, 3}, Length: 3}, protocol.StatusEINVAL},
		{"a list too long", protocol.Request{Op: protocol.OpList, Epoch: 1, Length: protocol.MaxListEntries + 1}, protocol.StatusEINVAL},
		{"a stat with a payload", protocol.Request{Op: protocol.OpStat, Epoch: 1, Object: obj, Payload: []byte{1}, Length: 1}, protocol.StatusEINVAL},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var lresp, rresp protocol.Response
			lreq, rreq := tc.req, tc.req
			lerr := local.Call(ctx, "self", &lreq, &lresp)
			rerr := pool.Call(ctx, lis.Addr().String(), &rreq, &rresp)
			var le, re *protocol.Error
			if !errors.As(lerr, &le) || !errors.As(rerr, &re) {
				t.Fatalf("local: %v; remote: %v; want both refused", lerr, rerr)
			}
			if le.Status != tc.want || re.Status != tc.want || le.Msg != re.Msg {
				t.Errorf("local: %s %q; remote: %s %q; want %s from both, the same message", le.Status, le.Msg, re.Status, re.Msg, tc.want)
			}
		})
	}
}
