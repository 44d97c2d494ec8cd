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
	"github.com/ovis-storage/ovis/internal/testutil"
	"github.com/ovis-storage/ovis/nbd"
	promtest "github.com/prometheus/client_golang/prometheus/testutil"
)

// startTestNode starts one node in process, embedding etcd (or on the
// external etcd given), with the cluster formatted (copies 1) and a
// 4 MiB VDI "disk".
func startTestNode(t *testing.T, etcd ...string) *Node {
	t.Helper()
	ctx := context.Background()
	cfg := Config{Dir: t.TempDir(), Listen: "127.0.0.1:0", Etcd: etcd, LeaseTTL: 4 * time.Second, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}
	if len(etcd) == 0 {
		cfg.EtcdListen, cfg.EtcdPeer = "http://127.0.0.1:0", "http://127.0.0.1:0"
	}
	n, err := Start(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := n.Close(cctx); err != nil && len(etcd) == 0 {
			t.Errorf("close: %v", err) // an external etcd may be gone: closing says so
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

// TestNodeServesKnownSizeWithoutEtcd: a VDI open writable here is handed
// to a new client within a short wait when etcd does not answer (the
// node serves the size it knows), not after the handshake's whole
// timeout, by which time the NBD server has hung up on the client: the
// TestClusterEtcdTrouble failure where fio connected just as etcd's
// quorum went.
func TestNodeServesKnownSizeWithoutEtcd(t *testing.T) {
	ctx := context.Background()
	members := testutil.StartEtcd(t, 1)
	n := startTestNode(t, members[0].ClientURL)
	if exp, err := n.vdis.Lookup(ctx, "disk"); err != nil || exp.ReadOnly {
		t.Fatalf("first open: %v (read-only %v)", err, exp != nil && exp.ReadOnly)
	}

	members[0].Stop()
	hctx, cancel := context.WithTimeout(ctx, nbd.DefaultHandshakeTimeout)
	defer cancel()
	start := time.Now()
	exp, err := n.vdis.Lookup(hctx, "disk")
	took := time.Since(start)
	if err != nil {
		t.Fatalf("open without etcd: %v", err)
	}
	if exp.ReadOnly || exp.Device.Size() != 4<<20 {
		t.Fatalf("open without etcd: read-only %v, size %d; want writable, %d", exp.ReadOnly, exp.Device.Size(), 4<<20)
	}
	if took > nbd.DefaultHandshakeTimeout/2 {
		t.Fatalf("open without etcd took %v; want well inside the handshake's %v", took, nbd.DefaultHandshakeTimeout)
	}
	members[0].Restart(t)
}
