package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/ovis-storage/ovis/cluster/admin"
	"github.com/ovis-storage/ovis/cluster/node"
	"github.com/ovis-storage/ovis/cluster/protocol"
	"github.com/ovis-storage/ovis/internal/netns"
	"github.com/ovis-storage/ovis/internal/nodeproc"
)

// Ports every node uses on its own namespace's address.
const (
	nodePort = "7000"
	nbdPort  = "10809"
)

// member is one incarnation of a node: a data directory served by
// successive processes in one namespace slot. A node that leaves is a
// member that never comes back; a join is a new member.
type member struct {
	name string // n1, n2, … in the order they joined
	slot int
	dir  string

	// Guarded by cluster.mu.
	state     string         // up, killed, stopped, cut, exited, left
	id        string         // the node's ID, from its first start
	proc      *nodeproc.Proc // the node process of its latest start
	expect    bool           // the driver ended the process (a signal)
	fenceable bool           // cut since the last settle: an exit is a fence
	disturbed int            // counts the outages of this member (kill, stop, cut, leave, exit)
}

// cluster is the nodes, their namespaces and the etcd they share.
type cluster struct {
	ovis   string
	base   string
	nt     *netns.Net
	etcd   *exec.Cmd
	etcdEx chan struct{}
	rep    *report

	mu      sync.Mutex
	members []*member // every member ever, in order
	slots   []*member // the member in each slot, nil when free
	joined  int
	deaths  int            // processes that ended on their own, not after a partition
	wg      sync.WaitGroup // process watchers
}

func (c *cluster) etcdURL() string { return "http://" + net.JoinHostPort(c.nt.HostAddr(), "2379") }

func (c *cluster) nodeAddr(m *member) string { return net.JoinHostPort(c.nt.Addr(m.slot), nodePort) }

func (c *cluster) nbdURI(m *member, vdi string) string {
	return "nbd://" + net.JoinHostPort(c.nt.Addr(m.slot), nbdPort) + "/" + vdi
}

// startEtcd runs Debian's etcd in the root namespace on the bridge
// address, so that a cut namespace loses it too.
func (c *cluster) startEtcd(ctx context.Context) error {
	peer, err := freePort()
	if err != nil {
		return err
	}
	dir := filepath.Join(c.base, "etcd")
	log, err := os.Create(filepath.Join(c.base, "etcd.log"))
	if err != nil {
		return err
	}
	c.etcd = exec.Command("etcd", "--name", "chaos", "--data-dir", dir,
		"--listen-client-urls", c.etcdURL(), "--advertise-client-urls", c.etcdURL(),
		"--listen-peer-urls", "http://127.0.0.1:"+peer, "--initial-advertise-peer-urls", "http://127.0.0.1:"+peer,
		"--initial-cluster", "chaos=http://127.0.0.1:"+peer, "--initial-cluster-state", "new",
		"--heartbeat-interval", "100", "--election-timeout", "1000", "--auto-compaction-retention", "1")
	c.etcd.Stdout, c.etcd.Stderr = log, log
	if err := c.etcd.Start(); err != nil {
		log.Close()
		return fmt.Errorf("starting etcd: %w", err)
	}
	c.etcdEx = make(chan struct{})
	go func() { c.etcd.Wait(); log.Close(); close(c.etcdEx) }()
	deadline := time.Now().Add(30 * time.Second)
	for {
		resp, err := http.Get(c.etcdURL() + "/health")
		if err == nil {
			ok := resp.StatusCode == 200
			resp.Body.Close()
			if ok {
				return nil
			}
		}
		select {
		case <-c.etcdEx:
			return fmt.Errorf("etcd exited at its start; see %s", filepath.Join(c.base, "etcd.log"))
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("etcd at %s not healthy in 30 s: %v", c.etcdURL(), err)
		}
	}
}

func freePort() (string, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer l.Close()
	_, p, _ := net.SplitHostPort(l.Addr().String())
	return p, nil
}

// newMember makes a member in a free slot, with a fresh directory.
// Called with c.mu held.
func (c *cluster) newMemberLocked() (*member, error) {
	for i, s := range c.slots {
		if s == nil {
			c.joined++
			m := &member{name: fmt.Sprintf("n%d", c.joined), slot: i, state: "stopped"}
			m.dir = filepath.Join(c.base, m.name)
			c.slots[i] = m
			c.members = append(c.members, m)
			return m, nil
		}
	}
	return nil, errors.New("no free namespace slot")
}

// start runs m's node process and waits until it serves NBD.
func (c *cluster) start(ctx context.Context, m *member) error {
	logf, err := os.OpenFile(filepath.Join(c.base, m.name+".log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	fmt.Fprintf(logf, "=== %s start in namespace %d\n", time.Now().UTC().Format(time.RFC3339Nano), m.slot)
	cmd := c.nt.Cmd(m.slot, c.ovis, "node", "--dir", m.dir, "--listen", c.nodeAddr(m),
		"--nbd", net.JoinHostPort(c.nt.Addr(m.slot), nbdPort), "--etcd", c.etcdURL(), "--log-level", "info",
		"--reserve", "16M")
	cmd.Stderr = logf
	p, err := nodeproc.Start(cmd, func(l string) { fmt.Fprintln(logf, "stdout:", l) })
	if err != nil {
		logf.Close()
		return fmt.Errorf("%s: %w", m.name, err)
	}
	c.mu.Lock()
	m.proc, m.expect, m.state = p, false, "starting"
	c.mu.Unlock()
	c.wg.Add(1)
	go func() {
		defer c.wg.Done()
		<-p.Exited()
		fmt.Fprintf(logf, "=== %s exit: %v\n", time.Now().UTC().Format(time.RFC3339Nano), p.Err())
		logf.Close()
		c.exitedProc(m, p)
	}()
	sctx, cancel := context.WithTimeout(ctx, 90*time.Second)
	defer cancel()
	if err := p.Ready(sctx); err != nil {
		select {
		case <-p.Exited():
			return fmt.Errorf("%s exited before serving: %s", m.name, c.logTail(m, 1500))
		default:
		}
		c.signal(m, syscall.SIGKILL)
		if ctx.Err() != nil {
			return ctx.Err()
		}
		return fmt.Errorf("%s did not serve in 90 s: %s", m.name, c.logTail(m, 1500))
	}
	c.mu.Lock()
	m.id = p.ID
	if m.proc == p && m.state == "starting" {
		m.state = "up"
	}
	c.mu.Unlock()
	return nil
}

// exitedProc records the end of one of m's processes: expected when the
// driver signalled it, a fence when m was cut since the last settle, a
// failure otherwise.
func (c *cluster) exitedProc(m *member, p *nodeproc.Proc) {
	err := p.Err()
	c.mu.Lock()
	if m.proc != p {
		c.mu.Unlock()
		return
	}
	expect, fenced, state := m.expect, m.fenceable, m.state
	if !expect {
		if state != "cut" && state != "healing" {
			m.state = "exited" // afterHeal restarts a node cut off
		}
		m.disturbed++
	}
	c.mu.Unlock()
	switch {
	case expect:
	case fenced:
		c.rep.expected("node-exit-after-partition", "%s (%s) exited after its partition (%v), state %s: %s", m.name, m.id, err, state, c.lastLogLine(m, "lost the membership lease"))
	default:
		c.mu.Lock()
		c.deaths++
		c.mu.Unlock()
		c.rep.check("node-alive", false, "%s (%s) died on its own (%v), state %s; log tail:\n%s", m.name, m.id, err, state, c.logTail(m, 3000))
	}
}

// signal sends sig to m's process and waits for its end (up to 60 s).
func (c *cluster) signal(m *member, sig syscall.Signal) error {
	c.mu.Lock()
	p := m.proc
	if p == nil {
		c.mu.Unlock()
		return nil
	}
	m.expect = true
	c.mu.Unlock()
	if err := p.Stop(sig, 60*time.Second); err != nil {
		return fmt.Errorf("%s did not end in 60 s after %v: %w", m.name, sig, err)
	}
	return nil
}

// logSize returns the size of m's log now, for logSince.
func (c *cluster) logSize(m *member) int64 {
	fi, err := os.Stat(filepath.Join(c.base, m.name+".log"))
	if err != nil {
		return 0
	}
	return fi.Size()
}

// logSince returns the first line of m's log past offset mark that
// contains s, "" when there is none.
func (c *cluster) logSince(m *member, mark int64, s string) string {
	b, _ := os.ReadFile(filepath.Join(c.base, m.name+".log"))
	if int64(len(b)) < mark {
		return ""
	}
	for _, l := range strings.Split(string(b[mark:]), "\n") {
		if strings.Contains(l, s) {
			return strings.TrimSpace(l)
		}
	}
	return ""
}

func (c *cluster) logTail(m *member, n int) string {
	b, _ := os.ReadFile(filepath.Join(c.base, m.name+".log"))
	if len(b) > n {
		b = b[len(b)-n:]
	}
	return string(b)
}

// lastLogLine returns the last line of m's log containing s.
func (c *cluster) lastLogLine(m *member, s string) string {
	b, _ := os.ReadFile(filepath.Join(c.base, m.name+".log"))
	last := ""
	for _, l := range strings.Split(string(b), "\n") {
		if strings.Contains(l, s) {
			last = l
		}
	}
	return strings.TrimSpace(last)
}

// adminBytes runs ovis with args against the node at addr from the root
// namespace and returns its stdout as bytes (a VDI read).
func (c *cluster) adminBytes(ctx context.Context, addr string, args ...string) ([]byte, error) {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, c.ovis, append(args, "-a", addr)...)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return nil, fmt.Errorf("ovis %s -a %s: %v: %s", strings.Join(args, " "), addr, err, strings.TrimSpace(stderr.String()))
	}
	return out, nil
}

// byState returns the members in one of the states, in join order.
func (c *cluster) byState(states ...string) []*member {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []*member
	for _, m := range c.members {
		for _, s := range states {
			if m.state == s {
				out = append(out, m)
			}
		}
	}
	return out
}

// adminNode returns the address of a member that is up.
func (c *cluster) adminNode() (string, error) {
	up := c.byState("up")
	if len(up) == 0 {
		return "", errors.New("no node is up")
	}
	return c.nodeAddr(up[0]), nil
}

// call runs one admin call against the node at addr, from the root
// namespace, with the typed client the command line uses.
func call[Req, Rep any](ctx context.Context, addr string, k admin.Call[Req, Rep], req Req) (Rep, error) {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	c := admin.Dial(addr, nil)
	defer c.Close()
	rep, err := k.Do(ctx, c, req)
	if err != nil {
		return rep, fmt.Errorf("%s at %s: %w", k.Verb, addr, err)
	}
	return rep, nil
}

// settled reports whether the membership is exactly the members that
// are up, each of them up and recovered and clean at its epoch; why
// says what is missing.
func (c *cluster) settled(ctx context.Context) (ok bool, why string, epoch uint64) {
	addr, err := c.adminNode()
	if err != nil {
		return false, err.Error(), 0
	}
	ns, err := call(ctx, addr, admin.NodeList, admin.None{})
	if err != nil {
		return false, err.Error(), 0
	}
	up := c.byState("up")
	want := map[string]bool{}
	for _, m := range up {
		want[c.nodeAddr(m)] = true
	}
	if len(ns) != len(up) {
		b, _ := json.Marshal(ns)
		return false, fmt.Sprintf("%d nodes listed, %d up: %s", len(ns), len(up), b), 0
	}
	for _, n := range ns {
		if !want[n.Addr] || n.State != "up" || n.Recovery.Done < n.Epoch || n.Recovery.Clean < n.Epoch {
			return false, fmt.Sprintf("node %s at %s: state %s epoch %d done %d clean %d pending %d", n.ID, n.Addr, n.State, n.Epoch, n.Recovery.Done, n.Recovery.Clean, n.Recovery.Pending), 0
		}
		epoch = max(epoch, n.Epoch)
	}
	return true, "", epoch
}

// clusterCheck runs the check of ovis cluster check (node.CheckVia,
// from the root namespace) and wants every object with copies copies,
// all equal.
func (c *cluster) clusterCheck(ctx context.Context, copies int) (string, error) {
	addr, err := c.adminNode()
	if err != nil {
		return "", err
	}
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	ac := admin.Dial(addr, nil)
	defer ac.Close()
	pool := protocol.NewPool(nil)
	defer pool.Close()
	r, _, err := node.CheckVia(ctx, ac, pool, false, nil)
	if err != nil {
		return "", fmt.Errorf("cluster check: %w", err)
	}
	sum := fmt.Sprintf("%d objects, %d copies, %d problems", r.Objects, r.Copies, len(r.Bad))
	if len(r.Bad) > 0 {
		b, _ := json.Marshal(r.Bad)
		return sum, fmt.Errorf("%s: %s", sum, b)
	}
	if r.Copies != r.Objects*copies {
		return sum, fmt.Errorf("%s: want %d copies of each object", sum, copies)
	}
	return sum, nil
}

// close ends every node process and etcd.
func (c *cluster) close() {
	c.mu.Lock()
	ms := append([]*member(nil), c.members...)
	c.mu.Unlock()
	for _, m := range ms {
		c.signal(m, syscall.SIGKILL)
	}
	c.wg.Wait()
	if c.etcd != nil && c.etcd.Process != nil {
		c.etcd.Process.Kill()
		<-c.etcdEx
	}
}
