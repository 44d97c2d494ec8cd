package membership

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ovis-storage/ovis/cluster/recovery"
)

// TestRemoveNode: a live node is refused, naming its address; an ID the
// cluster never knew is refused; a dead node's recovered and clean
// records go (so the lowest clean epoch, which bounds the tombstones
// that may be forgotten, no longer counts it); its ID may not join
// again, with an error that says what to do; a second removal changes
// nothing.
func TestRemoveNode(t *testing.T) {
	t.Parallel()
	c := newClient(t, shared.Endpoints(), "")
	live := join(t, c, "live", 0)
	gone := join(t, c, "gone", 0)
	for id, e := range map[string]uint64{"live": 10, "gone": 3} {
		if err := c.SetRecovered(ctx, id, e); err != nil {
			t.Fatal(err)
		}
		if err := c.SetClean(ctx, id, e); err != nil {
			t.Fatal(err)
		}
	}

	for _, tc := range []struct {
		id   string
		want error
		text string
	}{
		{"live", ErrNodeLive, live.Node().Addr},
		{"gone", ErrNodeLive, gone.Node().Addr},
		{"never", ErrNoNode, `"never"`},
		{"bad/id", ErrInvalid, "bad/id"},
	} {
		err := c.RemoveNode(ctx, tc.id)
		if !errors.Is(err, tc.want) || !strings.Contains(err.Error(), tc.text) {
			t.Errorf("RemoveNode(%q): %v; want %v naming %s", tc.id, err, tc.want, tc.text)
		}
	}
	if rm, err := c.Removed(ctx); err != nil || len(rm) != 0 {
		t.Fatalf("removed after refusals: %v, %v", rm, err)
	}
	if f := cleanFloor(t, c); f != 3 {
		t.Fatalf("lowest clean epoch %d before the removal, want 3 (gone's)", f)
	}

	// The node dies for good: its lease ends, then it is removed.
	if err := gone.Leave(ctx); err != nil {
		t.Fatal(err)
	}
	eventually(t, 5*time.Second, func() error {
		if v, err := c.View(ctx); err != nil || v.Has("gone") {
			return fmt.Errorf("view %v (%v) still lists gone", ids(v), err)
		}
		return nil
	})
	before, err := c.View(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := c.RemoveNode(ctx, "gone"); err != nil {
		t.Fatal(err)
	}
	// A new epoch with the same nodes: every node recovers it, and so
	// becomes clean past the tombstones made before.
	after, err := c.View(ctx)
	if err != nil || after.Epoch != before.Epoch+1 || !slices.Equal(after.Nodes, before.Nodes) {
		t.Fatalf("epoch after the removal: %d %v (%v), want %d with the nodes of %d", after.Epoch, ids(after), err, before.Epoch+1, before.Epoch)
	}
	rec, err := c.Recovered(ctx)
	if err != nil {
		t.Fatal(err)
	}
	clean, err := c.Clean(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := rec["gone"]; ok || rec["live"] != 10 {
		t.Fatalf("recovered epochs after removing gone: %v", rec)
	}
	if _, ok := clean["gone"]; ok || clean["live"] != 10 {
		t.Fatalf("clean epochs after removing gone: %v", clean)
	}
	if f := recovery.TombstoneFloor(rec, clean); f != 10 {
		t.Fatalf("lowest clean epoch %d after the removal, want 10: tombstones still wait for the removed node", f)
	}
	rm, err := c.Removed(ctx)
	if err != nil || len(rm) != 1 || rm["gone"].ID != "gone" || rm["gone"].Removed.IsZero() {
		t.Fatalf("removed: %+v, %v", rm, err)
	}

	_, err = c.Join(ctx, NodeInfo{ID: "gone", Addr: "127.0.0.1:9"}, testTTL)
	if !errors.Is(err, ErrRemovedNode) || !strings.Contains(err.Error(), `"gone"`) || !strings.Contains(err.Error(), "empty data directory") {
		t.Fatalf("Join of a removed node: %v; want ErrRemovedNode naming it and saying to start on an empty directory", err)
	}
	time.Sleep(300 * time.Millisecond) // a bumper would have acted on a key
	if v, err := c.View(ctx); err != nil || v.Has("gone") {
		t.Fatalf("a refused Join made an epoch with the node: %v (%v)", ids(v), err)
	}

	// Again: nothing changes, the time of the first removal stays.
	if err := c.RemoveNode(ctx, "gone"); err != nil {
		t.Fatalf("second RemoveNode: %v", err)
	}
	if again, err := c.Removed(ctx); err != nil || !again["gone"].Removed.Equal(rm["gone"].Removed) {
		t.Fatalf("second removal: %+v, %v; want the first's record", again, err)
	}
	if v, err := c.View(ctx); err != nil || v.Epoch != after.Epoch {
		t.Fatalf("second removal wrote epoch %d (%v), want none after %d", v.Epoch, err, after.Epoch)
	}
	// Other IDs still join.
	join(t, c, "new", 0)
}

// cleanFloor is the floor recovery forgets tombstones below
// (recovery.TombstoneFloor) over the records in etcd.
func cleanFloor(t *testing.T, c *Client) uint64 {
	t.Helper()
	rec, err := c.Recovered(ctx)
	if err != nil {
		t.Fatal(err)
	}
	clean, err := c.Clean(ctx)
	if err != nil {
		t.Fatal(err)
	}
	return recovery.TombstoneFloor(rec, clean)
}
