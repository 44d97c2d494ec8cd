package gateway_test

import (
	"bytes"
	"context"
	"sync"
	"testing"
	"time"

	"github.com/ovis-storage/ovis/block"
	"github.com/ovis-storage/ovis/cluster/gateway"
	"github.com/ovis-storage/ovis/cluster/object"
	"github.com/ovis-storage/ovis/cluster/protocol"
	"github.com/ovis-storage/ovis/cluster/view"
)

// slowFirst delays the writes to one node whose payload starts with the
// byte slow, so that a later write to the same range overtakes them
// there unless the gateway orders overlapping writes.
type slowFirst struct {
	next gateway.Caller
	addr string
	slow byte
}

func (s *slowFirst) Call(ctx context.Context, addr string, req *protocol.Request, resp *protocol.Response) error {
	if addr == s.addr && req.Op == protocol.OpWrite && len(req.Payload) > 0 && req.Payload[0] == s.slow {
		time.Sleep(100 * time.Millisecond)
	}
	return s.next.Call(ctx, addr, req, resp)
}

// Two overlapping writes in flight at once through one gateway end in
// the same order on every replica (issue 26: the history checker saw
// replicas disagree after two concurrent writes to one block): without
// the order, the replica that gets the first one late keeps it, the
// others the second.
func TestOverlappingWritesKeepOneOrder(t *testing.T) {
	c := newCluster(t, 3, 1)
	d, err := gateway.Open(ctx, gateway.Config{
		VDI: 7, Name: "test", Size: 4 << 20, Copies: 3, ObjectShift: object.MinSizeShift,
		Token: 1, Views: view.Static{V: c.view}, Net: &slowFirst{next: c.pool, addr: c.nodes[1].addr, slow: 1},
		Local: c.nodes[0].id, RetryTimeout: 5 * time.Second,
	})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	var wg sync.WaitGroup
	for i, b := range []byte{1, 2} {
		wg.Go(func() {
			time.Sleep(time.Duration(i) * 20 * time.Millisecond)
			// Overlapping, not equal: the second covers the first's
			// second half and the next 4 KiB.
			if _, err := d.WriteAt(ctx, bytes.Repeat([]byte{b}, 8192), int64(i)*4096, block.FUA); err != nil {
				t.Error(err)
			}
		})
	}
	wg.Wait()
	// Disjoint writes are not held up by each other: the write of 3,
	// started after the delayed write of 1, ends first.
	var ended [2]time.Time
	for i, b := range []byte{1, 3} {
		wg.Go(func() {
			time.Sleep(time.Duration(i) * 10 * time.Millisecond)
			if _, err := d.WriteAt(ctx, bytes.Repeat([]byte{b}, 4096), 1<<20+int64(i)*8192, block.FUA); err != nil {
				t.Error(err)
			}
			ended[i] = time.Now()
		})
	}
	wg.Wait()
	if !ended[1].Before(ended[0]) {
		t.Errorf("a write disjoint from one delayed 100 ms at one node ended %v after it: it waited for it", ended[1].Sub(ended[0]))
	}
	obj := object.Make(7, 0)
	var first []byte
	for i, n := range c.nodes {
		p := make([]byte, 12288)
		if _, err := n.st.ReadAt(obj, p, 0); err != nil {
			t.Fatal(err)
		}
		if i == 0 {
			first = p
			continue
		}
		if !bytes.Equal(p, first) {
			t.Errorf("replica %s holds %x %x %x (the first byte of each 4 KiB), replica %s %x %x %x",
				n.id, p[0], p[4096], p[8192], c.nodes[0].id, first[0], first[4096], first[8192])
		}
	}
}
