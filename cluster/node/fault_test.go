package node

import (
	"bytes"
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ovis-storage/ovis/block"
	"github.com/ovis-storage/ovis/cluster/object"
	"github.com/ovis-storage/ovis/cluster/store/vfs"
	"github.com/ovis-storage/ovis/cluster/store/vfs/errorfs"
)

// TestFailedSyncNotAcknowledged (issue 27): three in-process nodes on
// embedded etcd, copies 3, one node's store on errorfs. While that
// replica's fdatasync of object files fails, a FUA write and a flush
// through another node's gateway are never acknowledged; once its
// syncs work again the client's retry succeeds, the failed copy having
// been repaired from its peers, and every replica holds the data. When
// its journal's fdatasync fails, `node list` says the node failed.
func TestFailedSyncNotAcknowledged(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	fs := errorfs.New(vfs.Default, 1)
	nodes := startTestNodes(t, 3, func(i int, cfg *Config) {
		cfg.IOTimeout = 3 * time.Second
		if i == 2 {
			cfg.StoreFS = fs
		}
	})
	bad := nodes[2]
	vd, _ := formatDisk(ctx, t, nodes, 8<<20)
	exp, err := nodes[0].vdis.Lookup(ctx, "disk")
	if err != nil {
		t.Fatal(err)
	}
	dev := exp.Device
	if _, err := dev.WriteAt(ctx, bytes.Repeat([]byte{1}, 4096), 0, block.FUA); err != nil {
		t.Fatal(err)
	}

	// A write that went to every replica's page cache, then object
	// files that cannot be synced on one replica (not its journal).
	if _, err := dev.WriteAt(ctx, bytes.Repeat([]byte{3}, 4096), 4<<20, 0); err != nil {
		t.Fatal(err)
	}
	fs.Add(&errorfs.Rule{Kinds: []errorfs.Kind{errorfs.Sync}, Path: errorfs.Contains("/objects/objects/")})
	if err := dev.Flush(ctx); err == nil {
		t.Fatal("a flush was acknowledged while a replica's fdatasync failed")
	}
	if _, err := dev.WriteAt(ctx, bytes.Repeat([]byte{2}, 4096), 0, block.FUA); err == nil {
		t.Fatal("a FUA write was acknowledged while a replica's fdatasync failed")
	}
	if len(fs.Events()) == 0 {
		t.Fatal("no fault was injected: the test shows nothing")
	}

	fs.Clear()
	want := bytes.Repeat([]byte{4}, 4096)
	var werr error
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(200 * time.Millisecond) {
		if _, werr = dev.WriteAt(ctx, want, 0, block.FUA); werr == nil {
			break
		}
	}
	if werr != nil {
		t.Fatalf("the write still fails 30 s after the replica's syncs work again: %v", werr)
	}
	if _, err := dev.WriteAt(ctx, bytes.Repeat([]byte{3}, 4096), 4<<20, 0); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(200 * time.Millisecond) {
		if werr = dev.Flush(ctx); werr == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("flushes still fail 30 s after the replica's syncs work again: %v", werr)
		}
	}
	obj := object.Make(vd.ID, 0)
	for _, nd := range nodes {
		got := make([]byte, 4096)
		if _, err := nd.st.ReadAt(obj, got, 0); err != nil || !bytes.Equal(got, want) {
			t.Errorf("node %s's copy after the repair: %v, first byte %d; want %d", nd.ID(), err, got[0], want[0])
		}
	}

	// The journal's fdatasync fails: the store takes no change, and the
	// node says so.
	fs.Add(&errorfs.Rule{Kinds: []errorfs.Kind{errorfs.Sync}, Path: errorfs.Contains("journal")})
	_, _ = dev.WriteAt(ctx, bytes.Repeat([]byte{5}, 4096), 4<<20+8192, block.FUA)
	if st := bad.self(); st.State != "failed" {
		t.Errorf("node list says %q for a node whose journal cannot sync (store error %v), want failed", st.State, bad.st.Err())
	}
	if st := nodes[0].self(); st.State != "up" {
		t.Errorf("node list says %q for a healthy node", st.State)
	}
	// Its close reports the failure too (and writes no clean marker).
	if err := bad.Close(ctx); !errors.Is(err, errorfs.ErrInjected) {
		t.Errorf("closing the failed node: %v, want the journal's failure", err)
	}
}
