package membership

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ovis-storage/ovis/internal/testutil"
)

// TestExternalCluster runs against three members of Debian's etcd,
// kills the leader, and checks that views, joins and locks work on
// after the election, and that the registration was not fenced.
func TestExternalCluster(t *testing.T) {
	t.Parallel()
	ms := testutil.StartEtcd(t, 3)
	var eps []string
	for _, m := range ms {
		eps = append(eps, m.ClientURL)
	}
	var c *Client
	eventually(t, 10*time.Second, func() error {
		cc, err := Connect(ctx, Config{Endpoints: eps, DialTimeout: time.Second, Logger: testLogger()})
		if err != nil {
			return err
		}
		c = cc
		return nil
	})
	t.Cleanup(func() { c.Close() })
	if err := c.Format(ctx, Format{Copies: 1}, false); err != nil {
		t.Fatal(err)
	}
	// A 5 s lease rides out an election; renewals go to any member.
	r, err := c.Join(ctx, NodeInfo{ID: "a", Addr: "a:1"}, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Leave(ctx)
	for _, name := range []string{"d0", "d1"} {
		if _, err := c.CreateVDI(ctx, VDI{Name: name, Size: 1 << 20}); err != nil {
			t.Fatal(err)
		}
	}
	l0, err := c.Lock(ctx, r, "d0", "gw-a")
	if err != nil {
		t.Fatal(err)
	}

	leader := -1
	var leaderID uint64
	for i, m := range ms {
		st, err := c.cli.Status(ctx, m.ClientURL)
		if err != nil {
			t.Fatal(err)
		}
		if st.Leader == st.Header.MemberId {
			leader, leaderID = i, st.Leader
		}
	}
	if leader < 0 {
		t.Fatal("no member says it leads")
	}
	start := time.Now()
	ms[leader].Stop()

	// Everything works on once a new leader is elected.
	var l1 Lock
	eventually(t, 10*time.Second, func() error {
		tctx, cancel := context.WithTimeout(ctx, time.Second)
		defer cancel()
		var err error
		l1, err = c.Lock(tctx, r, "d1", "gw-a")
		return err
	})
	t.Logf("leader %s killed; lock taken again after %v", ms[leader].Name, time.Since(start).Round(time.Millisecond))
	if l1.Token <= l0.Token {
		t.Fatalf("token %d after the election, not above %d", l1.Token, l0.Token)
	}
	newLeader := false
	for i, m := range ms {
		if i == leader {
			continue
		}
		if st, err := c.cli.Status(ctx, m.ClientURL); err == nil && st.Leader != 0 && st.Leader != leaderID {
			newLeader = true
		}
	}
	if !newLeader {
		t.Fatal("no surviving member knows a new leader")
	}
	var le *LockedError
	if _, err := c.Lock(ctx, r, "d0", "gw-b"); !errors.As(err, &le) || le.Holder != "gw-a" {
		t.Fatalf("the lock taken before the election: %v", err)
	}
	c2, err := Connect(ctx, Config{Endpoints: eps, DialTimeout: time.Second, Logger: testLogger()})
	if err != nil {
		t.Fatal(err)
	}
	defer c2.Close()
	r2, err := c2.Join(ctx, NodeInfo{ID: "b", Addr: "b:1"}, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer r2.Leave(ctx)
	v, err := c.View(ctx)
	if err != nil || v.Epoch != 2 || !v.Has("a") || !v.Has("b") {
		t.Fatalf("view after the election: %+v, %v", v, err)
	}
	// Renewals go on through the surviving members.
	select {
	case <-r.Fenced():
		t.Fatalf("the registration was fenced by the election: %v", r.Err())
	case <-time.After(r.TTL() / 2):
	}
}
