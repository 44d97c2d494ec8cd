package membership

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// etcdMember is one process of an external etcd cluster.
type etcdMember struct {
	name, client, peer string
	cmd                *exec.Cmd
	done               chan struct{}
}

// freePorts returns n loopback ports that were free a moment ago.
func freePorts(t *testing.T, n int) []int {
	t.Helper()
	var ls []net.Listener
	var ports []int
	for range n {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		ls = append(ls, l)
		ports = append(ports, l.Addr().(*net.TCPAddr).Port)
	}
	for _, l := range ls {
		l.Close()
	}
	return ports
}

// startEtcdCluster runs Debian's etcd (etcd-server, 3.4) as a cluster
// of n members on loopback, and kills them at the end of the test.
func startEtcdCluster(t *testing.T, n int) []*etcdMember {
	t.Helper()
	bin, err := exec.LookPath("etcd")
	if err != nil {
		t.Fatalf("etcd is not installed (%v); run scripts/test.sh, which installs etcd-server", err)
	}
	ports := freePorts(t, 2*n)
	var ms []*etcdMember
	var initial []string
	for i := range n {
		m := &etcdMember{
			name:   fmt.Sprintf("m%d", i),
			client: fmt.Sprintf("http://127.0.0.1:%d", ports[2*i]),
			peer:   fmt.Sprintf("http://127.0.0.1:%d", ports[2*i+1]),
			done:   make(chan struct{}),
		}
		ms = append(ms, m)
		initial = append(initial, m.name+"="+m.peer)
	}
	dir := t.TempDir()
	for _, m := range ms {
		logf, err := os.Create(filepath.Join(dir, m.name+".log"))
		if err != nil {
			t.Fatal(err)
		}
		m.cmd = exec.Command(bin,
			"--name", m.name,
			"--data-dir", filepath.Join(dir, m.name),
			"--listen-client-urls", m.client, "--advertise-client-urls", m.client,
			"--listen-peer-urls", m.peer, "--initial-advertise-peer-urls", m.peer,
			"--initial-cluster", strings.Join(initial, ","),
			"--initial-cluster-state", "new", "--initial-cluster-token", "ovis-test",
			// Elections in a few hundred ms keep the test short.
			"--heartbeat-interval", "50", "--election-timeout", "500",
		)
		m.cmd.Stdout, m.cmd.Stderr = logf, logf
		if err := m.cmd.Start(); err != nil {
			t.Fatal(err)
		}
		go func() {
			m.cmd.Wait()
			logf.Close()
			close(m.done)
		}()
		t.Cleanup(func() {
			m.cmd.Process.Kill()
			<-m.done
			if t.Failed() {
				b, _ := os.ReadFile(logf.Name())
				if len(b) > 3000 {
					b = b[len(b)-3000:]
				}
				t.Logf("%s log tail:\n%s", m.name, b)
			}
		})
	}
	return ms
}

// TestExternalCluster runs against three members of Debian's etcd,
// kills the leader, and checks that views, joins and locks work on
// after the election, and that the registration was not fenced.
func TestExternalCluster(t *testing.T) {
	t.Parallel()
	ms := startEtcdCluster(t, 3)
	var eps []string
	for _, m := range ms {
		eps = append(eps, m.client)
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
		st, err := c.cli.Status(ctx, m.client)
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
	ms[leader].cmd.Process.Kill()
	<-ms[leader].done

	// Everything works on once a new leader is elected.
	var l1 Lock
	eventually(t, 10*time.Second, func() error {
		tctx, cancel := context.WithTimeout(ctx, time.Second)
		defer cancel()
		var err error
		l1, err = c.Lock(tctx, r, "d1", "gw-a")
		return err
	})
	t.Logf("leader %s killed; lock taken again after %v", ms[leader].name, time.Since(start).Round(time.Millisecond))
	if l1.Token <= l0.Token {
		t.Fatalf("token %d after the election, not above %d", l1.Token, l0.Token)
	}
	newLeader := false
	for i, m := range ms {
		if i == leader {
			continue
		}
		if st, err := c.cli.Status(ctx, m.client); err == nil && st.Leader != 0 && st.Leader != leaderID {
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
