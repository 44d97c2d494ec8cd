package node

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/ovis-storage/ovis/block"
	"github.com/ovis-storage/ovis/cluster/gateway"
	"github.com/ovis-storage/ovis/cluster/membership"
	"github.com/ovis-storage/ovis/cluster/protocol"
	promtest "github.com/prometheus/client_golang/prometheus/testutil"
)

// startTestNode starts one node in process, embedding etcd, with the
// cluster formatted (copies 1) and a 4 MiB VDI "disk".
func startTestNode(t *testing.T) *Node {
	t.Helper()
	ctx := context.Background()
	dir := t.TempDir()
	n, err := Start(ctx, Config{Dir: dir, Listen: "127.0.0.1:0", EtcdListen: "http://127.0.0.1:0", EtcdPeer: "http://127.0.0.1:0",
		LeaseTTL: 4 * time.Second, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := n.Close(cctx); err != nil {
			t.Errorf("close: %v", err)
		}
	})
	if err := n.mc.Format(ctx, membership.Format{Copies: 1}, false); err != nil {
		t.Fatal(err)
	}
	if _, err := n.mc.CreateVDI(ctx, membership.VDI{Name: "disk", Size: 4 << 20}); err != nil {
		t.Fatal(err)
	}
	return n
}

// TestNodeDropsBrokenLock: a VDI open writable on a node whose lock is
// broken while the node's lease holds is dropped without any write: the
// device it had refuses writes at once (EPERM) and keeps reading, the
// next open gets the VDI read-only from the new holder, or writable
// again under a new token when nobody took it.
func TestNodeDropsBrokenLock(t *testing.T) {
	ctx := context.Background()
	n := startTestNode(t)
	exp, err := n.vdis.Lookup(ctx, "disk")
	if err != nil {
		t.Fatal(err)
	}
	if exp.ReadOnly {
		t.Fatal("the first open is read-only")
	}
	old := exp.Device
	if _, err := old.WriteAt(ctx, []byte("before"), 0, block.FUA); err != nil {
		t.Fatal(err)
	}
	first, err := n.mc.LockOf(ctx, "disk")
	if err != nil {
		t.Fatal(err)
	}

	// Broken, and taken by another holder under a live lease.
	if _, err := n.mc.BreakLock(ctx, "disk"); err != nil {
		t.Fatal(err)
	}
	// (Under this node's lease, which lives on: a holder elsewhere.)
	taken, err := n.mc.Lock(ctx, n.registration(), "disk", "someone else")
	if err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		exp, err := n.vdis.Lookup(ctx, "disk")
		if err != nil {
			t.Fatal(err)
		}
		if exp.ReadOnly {
			if !strings.Contains(exp.Description, "someone else") {
				t.Errorf("read-only export says %q, want the holder", exp.Description)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the VDI is still open writable 10 s after its lock was broken and taken")
		}
		time.Sleep(20 * time.Millisecond)
	}
	start := time.Now()
	if _, err := old.WriteAt(ctx, []byte("after!"), 0, block.FUA); !errors.Is(err, gateway.ErrRevoked) || !errors.Is(err, block.ErrReadOnly) {
		t.Fatalf("a write through the dropped device: %v, want ErrRevoked", err)
	}
	if d := time.Since(start); d > 100*time.Millisecond {
		t.Errorf("the refused write took %v", d)
	}
	buf := make([]byte, 6)
	if _, err := old.ReadAt(ctx, buf, 0); err != nil || string(buf) != "before" {
		t.Fatalf("a read through the dropped device: %q, %v", buf, err)
	}

	// Released by the other holder: the next open takes it afresh.
	if err := n.mc.Unlock(ctx, taken); err != nil {
		t.Fatal(err)
	}
	exp, err = n.vdis.Lookup(ctx, "disk")
	if err != nil || exp.ReadOnly {
		t.Fatalf("open after the other holder let go: %+v, %v", exp, err)
	}
	l, err := n.mc.LockOf(ctx, "disk")
	if err != nil || l.Token <= taken.Token || l.Token <= first.Token {
		t.Fatalf("lock after reopening: %+v, %v; want a token above %d", l, err, taken.Token)
	}
	if _, err := exp.Device.WriteAt(ctx, []byte("again!"), 0, block.FUA); err != nil {
		t.Fatalf("a write through the new device: %v", err)
	}
	if _, err := old.WriteAt(ctx, []byte("stale!"), 0, 0); !errors.Is(err, gateway.ErrRevoked) {
		t.Fatalf("the dropped device wrote after the VDI was opened again: %v", err)
	}
}

// TestNodeDropsOnStaleToken: with the etcd watch out of the way, the
// first write refused for a stale token drops the VDI at once: that
// write fails with ErrRevoked (EPERM), and the next open is read-only.
func TestNodeDropsOnStaleToken(t *testing.T) {
	ctx := context.Background()
	n := startTestNode(t)
	exp, err := n.vdis.Lookup(ctx, "disk")
	if err != nil || exp.ReadOnly {
		t.Fatalf("first open: %+v, %v", exp, err)
	}
	n.vdis.mu.Lock()
	o := n.vdis.open["disk"]
	o.unwatch() // only the refusal can tell now
	n.vdis.mu.Unlock()
	if _, err := n.mc.BreakLock(ctx, "disk"); err != nil {
		t.Fatal(err)
	}
	taken, err := n.mc.Lock(ctx, n.registration(), "disk", "someone else")
	if err != nil {
		t.Fatal(err)
	}
	// The new owner's fence reaching this node's store.
	if err := n.st.Fence(o.vdi.ID, taken.Token); err != nil {
		t.Fatal(err)
	}
	if again, err := n.vdis.Lookup(ctx, "disk"); err != nil || again.ReadOnly || again.Device != exp.Device {
		t.Fatalf("before any write the node should still serve its device: %+v, %v", again, err)
	}
	_, err = exp.Device.WriteAt(ctx, []byte{1}, 0, block.FUA)
	if !errors.Is(err, gateway.ErrRevoked) || protocol.StatusOf(err) != protocol.StatusStaleToken {
		t.Fatalf("the refused write: %v, want ErrRevoked wrapping the stale-token refusal", err)
	}
	ro, err := n.vdis.Lookup(ctx, "disk")
	if err != nil || !ro.ReadOnly || !strings.Contains(ro.Description, "someone else") {
		t.Fatalf("open after the refusal: %+v, %v; want read-only, locked by someone else", ro, err)
	}
	if got := promtest.ToFloat64(n.m.Locks); got != 0 {
		t.Errorf("locks held gauge %v after the drop, want 0", got)
	}
}
