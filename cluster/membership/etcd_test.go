package membership

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ovis-storage/ovis/cluster/object"
	clientv3 "go.etcd.io/etcd/client/v3"
)

func TestFormat(t *testing.T) {
	t.Parallel()
	c := newClient(t, shared.Endpoints(), "")
	if _, err := c.GetFormat(ctx); !errors.Is(err, ErrNotFormatted) {
		t.Fatalf("GetFormat before Format: %v, want ErrNotFormatted", err)
	}
	if err := c.Format(ctx, Format{Copies: 0}, false); !errors.Is(err, ErrInvalid) {
		t.Fatalf("Format copies 0: %v, want ErrInvalid", err)
	}
	if err := c.Format(ctx, Format{Copies: 2}, false); err != nil {
		t.Fatal(err)
	}
	f, err := c.GetFormat(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if f.Copies != 2 || f.ObjectShift != object.DefaultSizeShift || f.ClusterID == "" || f.Created.IsZero() {
		t.Fatalf("format %+v: want copies 2, the default object size, an id and a time", f)
	}
	if err := c.Format(ctx, Format{Copies: 3}, false); !errors.Is(err, ErrFormatted) {
		t.Fatalf("second Format: %v, want ErrFormatted", err)
	}
	if g, _ := c.GetFormat(ctx); g != f {
		t.Fatalf("a refused Format changed the record: %+v, was %+v", g, f)
	}
	if err := c.Format(ctx, Format{Copies: 3, ObjectShift: 20}, true); err != nil {
		t.Fatal(err)
	}
	if g, _ := c.GetFormat(ctx); g.Copies != 3 || g.ObjectShift != 20 || g.ClusterID == f.ClusterID {
		t.Fatalf("forced format gave %+v", g)
	}
}

func TestConnectNowhere(t *testing.T) {
	t.Parallel()
	start := time.Now()
	_, err := Connect(ctx, Config{Endpoints: []string{"http://127.0.0.1:1"}, DialTimeout: 500 * time.Millisecond})
	if err == nil || !strings.Contains(err.Error(), "127.0.0.1:1") {
		t.Fatalf("Connect to a closed port: %v, want an error naming it", err)
	}
	if d := time.Since(start); d > 3*time.Second {
		t.Fatalf("Connect took %v to fail with a 500 ms dial timeout", d)
	}
}

func TestJoinDuplicate(t *testing.T) {
	t.Parallel()
	c1 := newClient(t, shared.Endpoints(), "")
	c2 := newClient(t, shared.Endpoints(), c1.k.prefix)
	r := join(t, c1, "n1", 0)
	_, err := c2.Join(ctx, NodeInfo{ID: "n1", Addr: "other:1"}, MinTTL)
	if !errors.Is(err, ErrDuplicateNode) || !strings.Contains(err.Error(), `"n1"`) || !strings.Contains(err.Error(), r.Node().Addr) {
		t.Fatalf("duplicate Join: %v; want ErrDuplicateNode naming n1 and its address", err)
	}
	if _, err := c2.Join(ctx, NodeInfo{ID: "bad/id", Addr: "x:1"}, MinTTL); !errors.Is(err, ErrInvalid) {
		t.Fatalf("Join with a bad id: %v", err)
	}
	if _, err := c2.Join(ctx, NodeInfo{ID: "n2", Addr: "x:1"}, time.Second); !errors.Is(err, ErrInvalid) {
		t.Fatalf("Join with a 1 s ttl: %v", err)
	}
	// Once n1 leaves, the id is free again.
	if err := r.Leave(ctx); err != nil {
		t.Fatal(err)
	}
	if err := r.Leave(ctx); !errors.Is(err, ErrClosed) {
		t.Fatalf("second Leave: %v", err)
	}
	select {
	case <-r.Fenced():
	default:
		t.Fatal("Fenced is open after Leave")
	}
	join(t, c2, "n1", 0)
}

// epochHistory returns the kept epochs and checks that they run 1..n
// with no gap and that the current one is the last.
func epochHistory(t testing.TB, c *Client) []View {
	t.Helper()
	vs, err := c.Epochs(ctx, 1, 0)
	if err != nil {
		t.Fatal(err)
	}
	for i, v := range vs {
		if v.Epoch != uint64(i+1) {
			t.Fatalf("history: epoch %d at place %d", v.Epoch, i)
		}
	}
	if cur, err := c.View(ctx); len(vs) > 0 && (err != nil || cur.Epoch != vs[len(vs)-1].Epoch) {
		t.Fatalf("current view %+v (%v) is not the last kept epoch %d", cur, err, len(vs))
	}
	return vs
}

func ids(v View) []string {
	var s []string
	for _, n := range v.Nodes {
		s = append(s, n.ID)
	}
	return s
}

// settle waits long enough for every bumper to have acted on the last
// change, and then checks the history has exactly want epochs, the
// last listing live.
func settle(t *testing.T, c *Client, want int, live ...string) {
	t.Helper()
	eventually(t, 5*time.Second, func() error {
		v, err := c.View(ctx)
		if err != nil {
			return err
		}
		if !slices.Equal(ids(v), live) {
			return fmt.Errorf("view %d lists %v, want %v", v.Epoch, ids(v), live)
		}
		return nil
	})
	// Bumpers that lost the race must not write another record.
	time.Sleep(300 * time.Millisecond)
	vs := epochHistory(t, c)
	if len(vs) != want {
		var s []string
		for _, v := range vs {
			s = append(s, fmt.Sprint(v.Epoch, ids(v)))
		}
		t.Fatalf("%d epochs, want %d: %v", len(vs), want, s)
	}
}

// TestEpochs checks that joins, a leave and a lease expiry each make
// exactly one epoch while five registrations race to write them.
func TestEpochs(t *testing.T) {
	t.Parallel()
	base := newClient(t, shared.Endpoints(), "")
	if _, err := base.View(ctx); !errors.Is(err, ErrNoEpoch) {
		t.Fatalf("View before any join: %v", err)
	}
	var regs []*Registration
	var clients []*Client
	var live []string
	for i := range 5 {
		c := newClient(t, shared.Endpoints(), base.k.prefix)
		id := fmt.Sprintf("n%d", i)
		regs = append(regs, join(t, c, id, uint32(i+1)))
		clients = append(clients, c)
		live = append(live, id)
		v, err := c.View(ctx)
		if err != nil || !v.Has(id) {
			t.Fatalf("after Join, view %+v (%v) lacks %s", v, err, id)
		}
		settle(t, base, i+1, live...)
	}
	if v, _ := base.EpochView(ctx, 2); !slices.Equal(ids(v), []string{"n0", "n1"}) {
		t.Fatalf("epoch 2 lists %v", ids(v))
	}
	if _, err := base.EpochView(ctx, 99); !errors.Is(err, ErrNoEpoch) {
		t.Fatalf("EpochView(99): %v", err)
	}

	// A leave: the others bump.
	if err := regs[1].Leave(ctx); err != nil {
		t.Fatal(err)
	}
	settle(t, base, 6, "n0", "n2", "n3", "n4")

	// A lease expiry: the client of n3 stops renewing without revoking.
	start := time.Now()
	clients[3].Close()
	settle(t, base, 7, "n0", "n2", "n4")
	if d := time.Since(start); d < testTTL/2 {
		t.Fatalf("n3 dropped out after %v, before its lease could expire", d)
	}
	t.Logf("lease expiry noticed after %v (ttl %v)", time.Since(start).Round(10*time.Millisecond), testTTL)

	// WaitEpoch returns at once for an old epoch and blocks for a new one.
	if v, err := base.WaitEpoch(ctx, 3); err != nil || v.Epoch != 7 {
		t.Fatalf("WaitEpoch(3) = %d, %v", v.Epoch, err)
	}
	done := make(chan View, 1)
	go func() { v, _ := base.WaitEpoch(ctx, 8); done <- v }()
	time.Sleep(100 * time.Millisecond)
	join(t, clients[0], "n9", 0)
	select {
	case v := <-done:
		if v.Epoch != 8 || !v.Has("n9") {
			t.Fatalf("WaitEpoch(8) = %+v", v)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("WaitEpoch(8) did not return after a join")
	}

	// Trimming keeps the current epoch and everything from below on.
	if n, err := base.TrimEpochs(ctx, 3); err != nil || n != 2 {
		t.Fatalf("TrimEpochs(3) = %d, %v; want 2 deleted", n, err)
	}
	if _, err := base.EpochView(ctx, 2); !errors.Is(err, ErrNoEpoch) {
		t.Fatalf("trimmed epoch 2: %v", err)
	}
	if v, err := base.EpochView(ctx, 3); err != nil || v.Epoch != 3 {
		t.Fatalf("kept epoch 3: %+v, %v", v, err)
	}
	if _, err := base.TrimEpochs(ctx, 1000); err != nil {
		t.Fatal(err)
	}
	if vs, err := base.Epochs(ctx, 1, 0); err != nil || len(vs) != 1 || vs[0].Epoch != 8 {
		t.Fatalf("after trimming everything, %+v, %v; want the current epoch 8 alone", vs, err)
	}
	if v, err := base.View(ctx); err != nil || v.Epoch != 8 {
		t.Fatalf("View after trimming: %+v, %v", v, err)
	}
}

// TestConcurrentJoins joins five nodes at once: the history has no gap
// and no duplicate, every epoch lists a live set that grows, and the
// last lists all five.
func TestConcurrentJoins(t *testing.T) {
	t.Parallel()
	base := newClient(t, shared.Endpoints(), "")
	var wg sync.WaitGroup
	errs := make(chan error, 5)
	for i := range 5 {
		c := newClient(t, shared.Endpoints(), base.k.prefix)
		wg.Go(func() {
			r, err := c.Join(ctx, NodeInfo{ID: fmt.Sprintf("n%d", i), Addr: "x:1"}, testTTL)
			if err != nil {
				errs <- err
				return
			}
			t.Cleanup(func() { r.Leave(ctx) })
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	time.Sleep(300 * time.Millisecond)
	vs := epochHistory(t, base)
	if len(vs) == 0 || len(vs) > 5 {
		t.Fatalf("%d epochs for 5 joins", len(vs))
	}
	for i := 1; i < len(vs); i++ {
		if len(vs[i].Nodes) <= len(vs[i-1].Nodes) {
			t.Fatalf("epoch %d lists %v after %v", vs[i].Epoch, ids(vs[i]), ids(vs[i-1]))
		}
	}
	if last := vs[len(vs)-1]; len(last.Nodes) != 5 {
		t.Fatalf("last epoch lists %v", ids(last))
	}
	t.Logf("5 concurrent joins made %d epochs", len(vs))
}

func TestWatch(t *testing.T) {
	t.Parallel()
	c := newClient(t, shared.Endpoints(), "")
	join(t, c, "a", 0)
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	w := c.Watch(wctx)
	next := func() View {
		t.Helper()
		select {
		case v, ok := <-w:
			if !ok {
				t.Fatal("watch closed")
			}
			return v
		case <-time.After(5 * time.Second):
			t.Fatal("no epoch from the watch")
		}
		return View{}
	}
	if v := next(); v.Epoch != 1 {
		t.Fatalf("watch began with epoch %d", v.Epoch)
	}
	b := join(t, c, "b", 0)
	if v := next(); v.Epoch != 2 || !v.Has("b") {
		t.Fatalf("after join: %+v", v)
	}
	b.Leave(ctx)
	if v := next(); v.Epoch != 3 || v.Has("b") {
		t.Fatalf("after leave: %+v", v)
	}
	cancel()
	for range w {
	}
}

// TestWatchCompacted starts a watch at a revision etcd has compacted
// away: it must reload the history and deliver every epoch in order.
func TestWatchCompacted(t *testing.T) {
	t.Parallel()
	c := newClient(t, shared.Endpoints(), "")
	resp, err := c.cli.Get(ctx, c.k.epoch())
	if err != nil {
		t.Fatal(err)
	}
	from := resp.Header.Revision + 1
	join(t, c, "a", 0)
	join(t, c, "b", 0)
	join(t, c, "c", 0)
	last, err := c.cli.Put(ctx, c.k.prefix+"filler", "x")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.cli.Compact(ctx, last.Header.Revision); err != nil {
		t.Fatal(err)
	}
	// The compaction is real: the old revision can no longer be read.
	if _, err := c.cli.Get(ctx, c.k.epoch(), clientv3.WithRev(from)); err == nil {
		t.Fatal("read at a compacted revision succeeded")
	}
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	out := make(chan View, 10)
	done := make(chan struct{})
	go func() {
		defer close(done)
		c.watchEpochs(wctx, out, 0, from)
	}()
	for want := uint64(1); want <= 3; want++ {
		select {
		case v := <-out:
			if v.Epoch != want {
				t.Fatalf("got epoch %d, want %d", v.Epoch, want)
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("no epoch %d after the compacted watch", want)
		}
	}
	// And it keeps watching after the reload.
	join(t, c, "d", 0)
	select {
	case v := <-out:
		if v.Epoch != 4 || !v.Has("d") {
			t.Fatalf("after reload: %+v", v)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("no epoch 4 after the reload")
	}
	cancel()
	<-done
}

func TestFencedOnRevoke(t *testing.T) {
	t.Parallel()
	c := newClient(t, shared.Endpoints(), "")
	other := newClient(t, shared.Endpoints(), c.k.prefix)
	r := join(t, c, "a", 0)
	if err := r.Err(); err != nil {
		t.Fatalf("fresh registration: %v", err)
	}
	// Stays live across several renewals.
	select {
	case <-r.Fenced():
		t.Fatalf("fenced while etcd is up: %v", r.Err())
	case <-time.After(MinTTL + 500*time.Millisecond):
	}
	start := time.Now()
	if _, err := other.cli.Revoke(ctx, r.LeaseID()); err != nil {
		t.Fatal(err)
	}
	select {
	case <-r.Fenced():
	case <-time.After(MinTTL):
		t.Fatal("not fenced within the ttl after its lease was revoked behind its back")
	}
	t.Logf("fenced %v after the revoke", time.Since(start).Round(time.Millisecond))
	if err := r.Err(); !errors.Is(err, ErrFenced) {
		t.Fatalf("Err after fence: %v", err)
	}
	if _, err := c.Lock(ctx, r, "x", "me"); !errors.Is(err, ErrFenced) {
		t.Fatalf("Lock with a fenced registration: %v", err)
	}
}

// TestFencedOnEtcdStop stops etcd under a registration: it must fence
// itself before its lease's ttl passes.
func TestFencedOnEtcdStop(t *testing.T) {
	t.Parallel()
	e, err := StartEmbedded(ctx, EmbedConfig{Dir: t.TempDir(), ClientURL: "http://127.0.0.1:0", PeerURL: "http://127.0.0.1:0"})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	c := newClient(t, e.Endpoints(), "")
	r, err := c.Join(ctx, NodeInfo{ID: "a", Addr: "a:1"}, MinTTL)
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(MinTTL / 2)
	start := time.Now()
	if err := e.Close(); err != nil {
		t.Fatal(err)
	}
	if err := e.Close(); !errors.Is(err, ErrClosed) {
		t.Fatalf("second Close: %v", err)
	}
	select {
	case <-r.Fenced():
	case <-time.After(r.TTL()):
		t.Fatal("not fenced within the ttl after etcd stopped")
	}
	d := time.Since(start)
	t.Logf("fenced %v after etcd stopped (ttl %v, margin %v)", d.Round(time.Millisecond), r.TTL(), fenceMargin(r.TTL()))
	if !strings.Contains(r.Err().Error(), "not renewed") {
		t.Fatalf("fence reason: %v", r.Err())
	}
}

func formatted(t *testing.T, copies int, zones ...uint32) (*Client, []*Registration) {
	t.Helper()
	c := newClient(t, shared.Endpoints(), "")
	if err := c.Format(ctx, Format{Copies: copies}, false); err != nil {
		t.Fatal(err)
	}
	var regs []*Registration
	for i, z := range zones {
		regs = append(regs, join(t, c, fmt.Sprintf("n%d", i), z))
	}
	return c, regs
}

func TestVDITable(t *testing.T) {
	t.Parallel()
	c0 := newClient(t, shared.Endpoints(), "")
	if _, err := c0.CreateVDI(ctx, VDI{Name: "a", Size: 1 << 20}); !errors.Is(err, ErrNotFormatted) {
		t.Fatalf("CreateVDI before Format: %v", err)
	}
	c, _ := formatted(t, 2, 1, 2, 2)
	a, err := c.CreateVDI(ctx, VDI{Name: "a", Size: 1 << 30})
	if err != nil {
		t.Fatal(err)
	}
	if a.ID == 0 || a.Copies != 2 || a.ObjectShift != object.DefaultSizeShift || a.State != StateReady || a.Created.IsZero() {
		t.Fatalf("created %+v", a)
	}
	b, err := c.CreateVDI(ctx, VDI{Name: "b", Size: 512, Copies: 1, ObjectShift: 20})
	if err != nil {
		t.Fatal(err)
	}
	if b.ID <= a.ID {
		t.Fatalf("ids %d then %d", a.ID, b.ID)
	}
	// Bad input changes nothing.
	for _, v := range []VDI{
		{Name: "a", Size: 512},            // duplicate
		{Name: "c", Size: 512, Copies: 3}, // 2 zones
		{Name: "c/d", Size: 512},          // slash
		{Name: "c", Size: 100},            // unaligned
		{Name: "c", Size: 512, ObjectShift: 30},
	} {
		if _, err := c.CreateVDI(ctx, v); err == nil {
			t.Errorf("CreateVDI(%+v) succeeded", v)
		}
	}
	if _, err := c.CreateVDI(ctx, VDI{Name: "a", Size: 512}); !errors.Is(err, ErrVDIExists) {
		t.Fatalf("duplicate: %v", err)
	}
	list, err := c.ListVDIs(ctx)
	if err != nil || len(list) != 2 || !reflect.DeepEqual(list, []VDI{a, b}) {
		t.Fatalf("ListVDIs = %+v, %v", list, err)
	}
	if g, err := c.GetVDI(ctx, "a"); err != nil || !reflect.DeepEqual(g, a) {
		t.Fatalf("GetVDI = %+v, %v", g, err)
	}
	if g, err := c.GetVDIByID(ctx, b.ID); err != nil || !reflect.DeepEqual(g, b) {
		t.Fatalf("GetVDIByID = %+v, %v", g, err)
	}
	if _, err := c.GetVDI(ctx, "zz"); !errors.Is(err, ErrNoVDI) || !strings.Contains(err.Error(), `"zz"`) {
		t.Fatalf("GetVDI unknown: %v", err)
	}
	if _, err := c.GetVDIByID(ctx, 999); !errors.Is(err, ErrNoVDI) {
		t.Fatalf("GetVDIByID unknown: %v", err)
	}

	// Resize. The record's revision rises with it, so a node can tell
	// the newer of two reads.
	_, rev0, err := c.GetVDIRevision(ctx, "a")
	if err != nil {
		t.Fatal(err)
	}
	if g, err := c.ResizeVDI(ctx, "a", 2<<30, false); err != nil || g.Size != 2<<30 {
		t.Fatalf("grow: %+v, %v", g, err)
	}
	if g, rev1, err := c.GetVDIRevision(ctx, "a"); err != nil || g.Size != 2<<30 || rev1 <= rev0 {
		t.Fatalf("after grow: %+v at revision %d (was %d), %v", g, rev1, rev0, err)
	}
	if _, err := c.ResizeVDI(ctx, "a", 1<<30, false); !errors.Is(err, ErrInvalid) {
		t.Fatalf("shrink without leave: %v", err)
	}
	if _, err := c.ResizeVDI(ctx, "a", 1000, true); !errors.Is(err, ErrInvalid) {
		t.Fatalf("unaligned resize: %v", err)
	}
	if g, err := c.ResizeVDI(ctx, "a", 1<<20, true); err != nil || g.Size != 1<<20 {
		t.Fatalf("shrink: %+v, %v", g, err)
	}
	if _, err := c.ResizeVDI(ctx, "nope", 1<<20, false); !errors.Is(err, ErrNoVDI) {
		t.Fatalf("resize unknown: %v", err)
	}

	// Delete, tombstone, and the id is never reused.
	d, err := c.DeleteVDI(ctx, "b")
	if err != nil || d.ID != b.ID {
		t.Fatalf("DeleteVDI = %+v, %v", d, err)
	}
	if _, err := c.GetVDIByID(ctx, b.ID); !errors.Is(err, ErrNoVDI) {
		t.Fatalf("deleted vdi by id: %v", err)
	}
	if _, err := c.DeleteVDI(ctx, "b"); !errors.Is(err, ErrNoVDI) {
		t.Fatalf("second delete: %v", err)
	}
	ts, err := c.ListTombstones(ctx)
	if err != nil || len(ts) != 1 || ts[0].ID != b.ID || ts[0].Name != "b" || ts[0].Deleted.IsZero() {
		t.Fatalf("tombstones %+v, %v", ts, err)
	}
	b2, err := c.CreateVDI(ctx, VDI{Name: "b", Size: 512})
	if err != nil {
		t.Fatal(err)
	}
	if b2.ID <= b.ID {
		t.Fatalf("recreated vdi got id %d, not above the deleted %d", b2.ID, b.ID)
	}
}

// TestCreateVDIConcurrent creates VDIs from several clients at once:
// every id is distinct.
func TestCreateVDIConcurrent(t *testing.T) {
	t.Parallel()
	c, _ := formatted(t, 1, 0)
	var wg sync.WaitGroup
	const n = 4
	const each = 5
	errs := make(chan error, n*each)
	for i := range n {
		cc := newClient(t, shared.Endpoints(), c.k.prefix)
		wg.Go(func() {
			for j := range each {
				if _, err := cc.CreateVDI(ctx, VDI{Name: fmt.Sprintf("v%d-%d", i, j), Size: 512}); err != nil {
					errs <- err
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	list, err := c.ListVDIs(ctx)
	if err != nil {
		t.Fatal(err)
	}
	seen := map[object.VDI]string{}
	for _, v := range list {
		if o, dup := seen[v.ID]; dup {
			t.Fatalf("id %d given to %q and %q", v.ID, o, v.Name)
		}
		seen[v.ID] = v.Name
	}
	if len(seen) != n*each {
		t.Fatalf("%d vdis, want %d", len(seen), n*each)
	}
}

func TestLocks(t *testing.T) {
	t.Parallel()
	c, regs := formatted(t, 1, 0, 0)
	other := newClient(t, shared.Endpoints(), c.k.prefix)
	r3, err := other.Join(ctx, NodeInfo{ID: "n2", Addr: "n2:1"}, testTTL)
	if err != nil {
		t.Fatal(err)
	}
	v, err := c.CreateVDI(ctx, VDI{Name: "disk", Size: 1 << 20})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Lock(ctx, regs[0], "nope", "g0"); !errors.Is(err, ErrNoVDI) {
		t.Fatalf("Lock of an unknown vdi: %v", err)
	}
	l1, err := c.Lock(ctx, regs[0], "disk", "gw-n0")
	if err != nil {
		t.Fatal(err)
	}
	if l1.VDI != v.ID || l1.Name != "disk" || l1.Holder != "gw-n0" || l1.Token == 0 || l1.Lease != int64(regs[0].LeaseID()) {
		t.Fatalf("lock %+v", l1)
	}
	// The same holder again gets the same lock.
	if again, err := c.Lock(ctx, regs[0], "disk", "gw-n0"); err != nil || again != l1 {
		t.Fatalf("relock: %+v, %v", again, err)
	}
	// A second holder is refused, by name.
	_, err = c.Lock(ctx, regs[1], "disk", "gw-n1")
	var le *LockedError
	if !errors.As(err, &le) || le.Holder != "gw-n0" || le.Name != "disk" || !strings.Contains(err.Error(), `vdi "disk" is locked by gw-n0`) {
		t.Fatalf("second holder: %v", err)
	}
	if _, err := c.DeleteVDI(ctx, "disk"); !errors.As(err, &le) {
		t.Fatalf("delete of a locked vdi: %v", err)
	}
	if ls, err := c.Locks(ctx); err != nil || len(ls) != 1 || ls[0] != l1 {
		t.Fatalf("Locks = %+v, %v", ls, err)
	}

	// Break: the holder hears of it, the next lock gets a higher token
	// and the old holder can no longer unlock.
	lost := c.LockLost(ctx, l1)
	select {
	case <-lost:
		t.Fatal("LockLost closed while the lock is held")
	case <-time.After(100 * time.Millisecond):
	}
	broken, err := c.BreakLock(ctx, "disk")
	if err != nil || broken != l1 {
		t.Fatalf("BreakLock = %+v, %v", broken, err)
	}
	select {
	case <-lost:
	case <-time.After(5 * time.Second):
		t.Fatal("LockLost did not close after BreakLock")
	}
	if _, err := c.BreakLock(ctx, "disk"); !errors.Is(err, ErrNotLocked) {
		t.Fatalf("BreakLock of an unlocked vdi: %v", err)
	}
	l2, err := c.Lock(ctx, regs[1], "disk", "gw-n1")
	if err != nil {
		t.Fatal(err)
	}
	if l2.Token <= l1.Token {
		t.Fatalf("token %d after break, not above %d", l2.Token, l1.Token)
	}
	if err := c.Unlock(ctx, l1); !errors.Is(err, ErrNotLocked) {
		t.Fatalf("Unlock by the broken holder: %v", err)
	}
	if err := c.Unlock(ctx, l2); err != nil {
		t.Fatal(err)
	}
	select {
	case <-c.LockLost(ctx, l2):
	case <-time.After(2 * time.Second):
		t.Fatal("LockLost of a released lock did not close")
	}

	// A lock goes with its holder's lease: n2's client stops renewing.
	l3, err := other.Lock(ctx, r3, "disk", "gw-n2")
	if err != nil {
		t.Fatal(err)
	}
	if l3.Token <= l2.Token {
		t.Fatalf("token %d, not above %d", l3.Token, l2.Token)
	}
	lost3 := c.LockLost(ctx, l3)
	other.Close()
	select {
	case <-lost3:
	case <-time.After(2 * testTTL):
		t.Fatal("LockLost did not close when the holder's lease expired")
	}
	eventually(t, 2*testTTL, func() error {
		ls, err := c.Locks(ctx)
		if err != nil || len(ls) != 0 {
			return fmt.Errorf("locks %+v, %v", ls, err)
		}
		return nil
	})
	l4, err := c.Lock(ctx, regs[0], "disk", "gw-n0")
	if err != nil || l4.Token <= l3.Token {
		t.Fatalf("takeover after expiry: %+v, %v", l4, err)
	}
	// Leave revokes the lease, and the lock goes at once.
	if err := regs[0].Leave(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := c.LockOf(ctx, "disk"); !errors.Is(err, ErrNotLocked) {
		t.Fatalf("lock after its holder left: %v", err)
	}
	if _, err := c.DeleteVDI(ctx, "disk"); err != nil {
		t.Fatalf("delete after unlock: %v", err)
	}
}

// TestCompactor runs the compactor with a small window under many
// writes: the history etcd keeps stays bounded.
func TestCompactor(t *testing.T) {
	t.Parallel()
	e, err := StartEmbedded(ctx, EmbedConfig{Dir: t.TempDir(), ClientURL: "http://127.0.0.1:0", PeerURL: "http://127.0.0.1:0", CompactionRetention: -1})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	c := newClient(t, e.Endpoints(), "")
	cctx, cancel := context.WithCancel(ctx)
	defer cancel()
	const keep = 100
	c.StartCompactor(cctx, keep, 100*time.Millisecond)
	var first, rev int64
	for i := range 300 {
		resp, err := c.cli.Put(ctx, c.k.prefix+"k", fmt.Sprint(i))
		if err != nil {
			t.Fatal(err)
		}
		if first == 0 {
			first = resp.Header.Revision
		}
		rev = resp.Header.Revision
	}
	// Within a few intervals, everything older than keep (plus what one
	// interval of writes adds) is gone, and the newest keep are there.
	eventually(t, 3*time.Second, func() error {
		if _, err := c.cli.Get(ctx, c.k.prefix+"k", clientv3.WithRev(rev-keep-1)); err == nil {
			return fmt.Errorf("revision %d of %d still readable", rev-keep-1, rev)
		}
		return nil
	})
	if resp, err := c.cli.Get(ctx, c.k.prefix+"k", clientv3.WithRev(rev-keep/2)); err != nil || len(resp.Kvs) != 1 {
		t.Fatalf("revision %d, within the kept window, unreadable: %v", rev-keep/2, err)
	}
	if _, err := c.cli.Get(ctx, c.k.prefix+"k", clientv3.WithRev(first)); err == nil {
		t.Fatal("first revision still readable")
	}
}

// TestSetFull: a node that says its disk is full makes a new epoch that
// lists it Full, and one that says it has room again another; its
// registration's Node says what the key holds. A registration that is
// no longer the key's (it left) cannot change it.
func TestSetFull(t *testing.T) {
	t.Parallel()
	c := newClient(t, shared.Endpoints(), "")
	a := join(t, c, "a", 0)
	join(t, c, "b", 0)
	v0, err := c.View(ctx)
	if err != nil {
		t.Fatal(err)
	}
	fullIn := func(v View) []bool {
		var f []bool
		for _, n := range v.Nodes {
			f = append(f, n.Full)
		}
		return f
	}
	for i, full := range []bool{true, false} {
		if err := a.SetFull(ctx, full); err != nil {
			t.Fatal(err)
		}
		if a.Node().Full != full {
			t.Fatalf("Node().Full %v after SetFull(%v)", a.Node().Full, full)
		}
		want := v0.Epoch + uint64(i) + 1
		eventually(t, 5*time.Second, func() error {
			v, err := c.View(ctx)
			if err != nil {
				return err
			}
			if v.Epoch != want || !slices.Equal(fullIn(v), []bool{full, false}) {
				return fmt.Errorf("epoch %d, full %v; want epoch %d, full [%v false]", v.Epoch, fullIn(v), want, full)
			}
			return nil
		})
	}
	if err := a.Leave(ctx); err != nil {
		t.Fatal(err)
	}
	if err := a.SetFull(ctx, true); err == nil {
		t.Fatal("a registration that left set its node full")
	}
}
