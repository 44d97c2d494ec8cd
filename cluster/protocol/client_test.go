package protocol

import (
	"context"
	"encoding/binary"
	"errors"
	"net"
	"testing"
	"time"

	"github.com/ovis-storage/ovis/cluster/object"
	"pgregory.net/rapid"
)

// TestClientModel: a scripted server answers n calls in a random order,
// some after their caller cancelled, some with errors, and may die
// before answering the rest. Every call ends as the model says: its own
// reply, its context's error, its status, or ErrConnection.
func TestClientModel(t *testing.T) {
	rapid.Check(t, func(rt *rapid.T) {
		n := rapid.IntRange(1, 20).Draw(rt, "calls")
		order := rapid.Permutation(seq(n)).Draw(rt, "order")
		answered := rapid.IntRange(0, n).Draw(rt, "answered") // replies before the server dies
		cancel := make([]bool, n)
		status := make([]Status, n)
		for i := range n {
			cancel[i] = rapid.IntRange(0, 4).Draw(rt, "cancel") == 0
			if rapid.IntRange(0, 4).Draw(rt, "fail") == 0 {
				status[i] = StatusNoEnt
			}
		}

		a, b := net.Pipe()
		c := NewClient(a)
		defer c.Close()
		type result struct {
			resp Response
			err  error
		}
		results := make([]chan result, n)
		cancels := make([]context.CancelFunc, n)
		for i := range n {
			results[i] = make(chan result, 1)
			cctx, cf := context.WithCancel(ctx)
			cancels[i] = cf
			go func() {
				var r result
				r.err = c.Call(cctx, &Request{Op: OpStat, Object: object.ID(i)}, &r.resp)
				results[i] <- r
			}()
		}
		// The server side: read the n requests (in whatever order the
		// callers queued them), then answer as scripted.
		handles := make([]uint64, n)
		var req Request
		for range n {
			if err := ReadRequest(b, &req); err != nil {
				rt.Fatalf("server read: %v", err)
			}
			handles[req.Object] = req.Handle
		}
		for k, i := range order {
			if k == answered {
				break
			}
			if cancel[i] {
				cancels[i]()
				if r := waitResult(rt, results[i]); !errors.Is(r.err, context.Canceled) {
					rt.Fatalf("call %d cancelled: %v", i, r.err)
				}
			}
			p := binary.BigEndian.AppendUint64(nil, uint64(i))
			if err := WriteResponse(b, &Response{Status: status[i], Handle: handles[i], Version: uint64(i), Payload: p}); err != nil {
				rt.Fatalf("server write: %v", err)
			}
			if cancel[i] {
				continue
			}
			r := waitResult(rt, results[i])
			switch {
			case status[i] != StatusOK:
				if StatusOf(r.err) != status[i] {
					rt.Fatalf("call %d: %v, want %s", i, r.err, status[i])
				}
			case r.err != nil:
				rt.Fatalf("call %d: %v", i, r.err)
			case r.resp.Version != uint64(i) || binary.BigEndian.Uint64(r.resp.Payload) != uint64(i):
				rt.Fatalf("call %d got the reply of %d", i, r.resp.Version)
			}
		}
		b.Close()
		for _, i := range order[answered:] {
			if cancel[i] {
				cancels[i]()
			}
			r := waitResult(rt, results[i])
			if !errors.Is(r.err, ErrConnection) && !(cancel[i] && errors.Is(r.err, context.Canceled)) {
				rt.Fatalf("call %d after the server died: %v", i, r.err)
			}
		}
		for _, cf := range cancels {
			cf()
		}
	})
}

func seq(n int) []int {
	s := make([]int, n)
	for i := range s {
		s[i] = i
	}
	return s
}

func waitResult[T any](t *rapid.T, ch chan T) T {
	select {
	case r := <-ch:
		return r
	case <-time.After(10 * time.Second):
		t.Fatalf("call did not return")
		panic("unreachable")
	}
}
