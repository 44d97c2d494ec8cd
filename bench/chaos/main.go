// Command chaos runs an ovis cluster under random kills, restarts,
// joins, leaves and partitions for a while, with several clients
// writing and verifying through it, and reports every event it caused
// and every check it made (bench/chaos.sh builds and runs it).
//
// Every node runs in its own network namespace (internal/netns), with
// Debian's etcd in the root namespace on the bridge: a partitioned node
// loses the other nodes and etcd alike. Each client has its own VDI and
// runs fio (ioengine=nbd, crc32c verification) in the namespace of the
// node that serves it, in rounds that rewrite and verify one region of
// the VDI.
//
// Rules that keep a copy of every object reachable: at most copies-1
// nodes are down (killed, stopped or cut) at once, and at least copies
// are up; joins and leaves happen only when no node is down, and a leave
// keeps copies+1 members. After every event the driver waits for the
// cluster to settle (every member up, recovered and clean at its
// epoch), pauses the clients and runs ovis cluster check, which must
// find every object with copies equal copies.
//
// A client whose own node went down (killed, stopped, cut, fenced) sees
// I/O errors: that is counted apart, the region it was writing is
// forgotten, and once its node is back it re-verifies every region it
// completed before. Any verify mismatch, any other client error, a node
// that dies on its own (not after a partition), a settle that does not
// come or a check that finds a problem is a failure; the exit code is 1
// when there was one.
package main

import (
	"bytes"
	"context"
	"flag"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"os/signal"
	"sync"
	"syscall"
	"time"

	"github.com/ovis-storage/ovis/cluster/admin"
	"github.com/ovis-storage/ovis/internal/netns"
)

type config struct {
	ovis     string
	minutes  float64
	seed     uint64
	nodes    int
	copies   int
	clients  int
	slots    int
	dir      string
	minGap   time.Duration
	maxGap   time.Duration
	settleTO time.Duration
	sabotage string
}

func main() {
	var cfg config
	flag.StringVar(&cfg.ovis, "ovis", "", "the ovis binary (required)")
	flag.Float64Var(&cfg.minutes, "minutes", 5, "how long the chaos runs, in minutes")
	flag.Uint64Var(&cfg.seed, "seed", 0, "random seed (0: from the clock); the run prints it")
	flag.IntVar(&cfg.nodes, "nodes", 5, "nodes at the start")
	flag.IntVar(&cfg.copies, "copies", 3, "copies of every object")
	flag.IntVar(&cfg.clients, "clients", 3, "clients, each with its own VDI")
	flag.IntVar(&cfg.slots, "slots", 8, "network namespaces, the most members at once")
	flag.StringVar(&cfg.dir, "dir", "", "where the nodes' data and logs go (default: a new folder under /dev/shm)")
	flag.DurationVar(&cfg.minGap, "min-gap", 10*time.Second, "shortest pause between a check and the next event")
	flag.DurationVar(&cfg.maxGap, "max-gap", 40*time.Second, "longest pause between a check and the next event")
	flag.DurationVar(&cfg.settleTO, "settle-timeout", 3*time.Minute, "how long the cluster may take to settle after an event")
	flag.StringVar(&cfg.sabotage, "sabotage", "", "self-test: at the end, overwrite 4 KiB of a verified region of c0 behind its back, with junk (\"junk\") or with c1's block at that offset, which passes fio's checks (\"stale\"); the run must then fail")
	flag.Parse()
	if cfg.ovis == "" || cfg.copies < 2 || cfg.nodes < cfg.copies+1 || cfg.slots < cfg.nodes || cfg.clients < 1 || cfg.clients > cfg.nodes {
		fmt.Fprintln(os.Stderr, "chaos: need -ovis, copies ≥ 2, nodes ≥ copies+1, slots ≥ nodes, 1 ≤ clients ≤ nodes")
		os.Exit(2)
	}
	if cfg.seed == 0 {
		cfg.seed = uint64(time.Now().UnixNano())
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	os.Exit(run(ctx, cfg))
}

// driver is the chaos: the cluster, the clients and the event loop.
type driver struct {
	cfg  config
	c    *cluster
	rep  *report
	rng  *rand.Rand
	gate sync.RWMutex // clients hold it shared per fio run; a check takes it alone
	cls  []*client
}

func run(ctx context.Context, cfg config) int {
	rep := newReport(os.Stdout)
	base := cfg.dir
	if base == "" {
		var err error
		if base, err = os.MkdirTemp("/dev/shm", "ovis-chaos."); err != nil {
			fmt.Fprintln(os.Stderr, "chaos:", err)
			return 2
		}
	}
	rep.info("start", "seed %d, %v minutes, %d nodes, copies %d, %d clients, data and logs in %s", cfg.seed, cfg.minutes, cfg.nodes, cfg.copies, cfg.clients, base)
	nt, err := netns.New(ctx, cfg.slots)
	if err != nil {
		fmt.Fprintln(os.Stderr, "chaos:", err)
		return 2
	}
	defer nt.Close()
	c := &cluster{ovis: cfg.ovis, base: base, nt: nt, rep: rep, slots: make([]*member, cfg.slots)}
	defer c.close()
	d := &driver{cfg: cfg, c: c, rep: rep, rng: rand.New(rand.NewPCG(cfg.seed, 0x6f766973))}
	if err := d.setup(ctx); err != nil {
		rep.check("setup", false, "%v", err)
		return rep.summary(fmt.Sprintf("seed %d, setup failed", cfg.seed)) + 1
	}

	cctx, cancelClients := context.WithCancel(ctx)
	stopRounds, endRounds := context.WithCancel(cctx)
	var wg sync.WaitGroup
	for _, cl := range d.cls {
		wg.Add(1)
		go func() {
			defer wg.Done()
			d.clientLoop(cctx, stopRounds, cl)
		}()
	}
	end := time.Now().Add(time.Duration(cfg.minutes * float64(time.Minute)))
	for ctx.Err() == nil && time.Now().Before(end) {
		gap := cfg.minGap + time.Duration(d.rng.Int64N(int64(cfg.maxGap-cfg.minGap)+1))
		select {
		case <-ctx.Done():
		case <-time.After(min(gap, time.Until(end))):
		}
		if ctx.Err() != nil || !time.Now().Before(end) {
			break
		}
		d.revive(ctx)
		d.event(ctx)
		d.settleAndCheck(ctx, "after the event")
	}
	endRounds()
	if ctx.Err() == nil {
		rep.info("end", "the chaos is over: clients finish their rounds, every node returns, final checks")
	}
	wg.Wait()
	cancelClients()
	if ctx.Err() != nil {
		rep.info("interrupted", "stopped by a signal: no final checks")
		rep.summary(fmt.Sprintf("seed %d, interrupted", cfg.seed))
		return 1
	}
	for _, m := range c.byState("killed", "stopped", "exited") {
		d.restart(ctx, m)
	}
	if cfg.sabotage != "" {
		d.sabotage(ctx, cfg.sabotage)
	}
	d.settleAndCheck(ctx, "at the end")
	for _, cl := range d.cls {
		cl.reverify(ctx, ctx, "at the end")
		cl.log.Close()
	}
	return min(1, rep.summary(fmt.Sprintf("seed %d, %v minutes, %d nodes at the start, copies %d, %d clients", cfg.seed, cfg.minutes, cfg.nodes, cfg.copies, cfg.clients)))
}

// setup starts the nodes, formats the cluster, makes one VDI per
// client, and checks.
func (d *driver) setup(ctx context.Context) error {
	if err := d.c.startEtcd(ctx); err != nil {
		return err
	}
	for range d.cfg.nodes {
		d.c.mu.Lock()
		m, err := d.c.newMemberLocked()
		d.c.mu.Unlock()
		if err != nil {
			return err
		}
		if err := d.c.start(ctx, m); err != nil {
			return err
		}
	}
	addr, _ := d.c.adminNode()
	if _, err := call(ctx, addr, admin.Format, admin.FormatRequest{Copies: d.cfg.copies}); err != nil {
		return err
	}
	up := d.c.byState("up")
	for i := range d.cfg.clients {
		name := fmt.Sprintf("c%d", i)
		if _, err := call(ctx, addr, admin.VDICreate, admin.VDICreateRequest{Name: name, Size: vdiSize, ObjectShift: 20}); err != nil {
			return err
		}
		cl, err := newClient(d.c, d.rep, &d.gate, name, up[i], d.cfg.seed+uint64(i)*0x9e3779b97f4a7c15)
		if err != nil {
			return err
		}
		d.cls = append(d.cls, cl)
	}
	d.rep.event("setup", "%d nodes up, formatted with copies %d, VDIs c0..c%d of %d MiB", d.cfg.nodes, d.cfg.copies, d.cfg.clients-1, vdiSize>>20)
	d.settleAndCheck(ctx, "after setup")
	return nil
}

// clientLoop runs cl's rounds, each under the shared gate.
func (d *driver) clientLoop(ctx, stop context.Context, cl *client) {
	cl.run(ctx, stop)
}

// counts returns how many members are up, how many are down (killed,
// stopped, cut or exited) and how many there are (all but the left).
func (d *driver) counts() (up, down, members int) {
	d.c.mu.Lock()
	defer d.c.mu.Unlock()
	for _, m := range d.c.members {
		switch m.state {
		case "up":
			up++
			members++
		case "killed", "stopped", "cut", "healing", "exited", "starting":
			down++
			members++
		}
	}
	return
}

// homeOf names the clients m serves, for the event lines.
func (d *driver) homeOf(m *member) string {
	d.c.mu.Lock()
	defer d.c.mu.Unlock()
	s := ""
	for _, cl := range d.cls {
		if cl.home == m {
			s += " " + cl.name
		}
	}
	if s == "" {
		return ""
	}
	return ", serving" + s
}

func (d *driver) describe(m *member) string {
	d.c.mu.Lock()
	id := m.id
	d.c.mu.Unlock()
	return fmt.Sprintf("%s (id %s, %s)%s", m.name, id, d.c.nodeAddr(m), d.homeOf(m))
}

// event picks one event the rules allow and carries it out.
func (d *driver) event(ctx context.Context) {
	up, down, members := d.counts()
	outage := down < d.cfg.copies-1 && up-1 >= d.cfg.copies
	downs := d.c.byState("killed", "stopped")
	free := false
	d.c.mu.Lock()
	for _, s := range d.c.slots {
		free = free || s == nil
	}
	d.c.mu.Unlock()
	type choice struct {
		kind   string
		weight int
	}
	var cs []choice
	if outage {
		cs = append(cs, choice{"kill", 3}, choice{"stop", 2}, choice{"partition", 3})
	}
	if len(downs) > 0 {
		w := 3
		if !outage {
			w = 100
		}
		cs = append(cs, choice{"restart", w})
	}
	if down == 0 && up >= d.cfg.copies+1 {
		// Every holder of some objects at once (copies nodes), back
		// one at a time slower than the lease (issue 26).
		cs = append(cs, choice{"holders", 2})
	}
	if down == 0 {
		cs = append(cs, choice{"blackout", 1})
	}
	if down == 0 && free {
		cs = append(cs, choice{"join", 1})
	}
	if down == 0 && members-1 >= d.cfg.copies+1 {
		cs = append(cs, choice{"leave", 1})
	}
	total := 0
	for _, c := range cs {
		total += c.weight
	}
	if total == 0 {
		d.rep.info("no-event", "no event allowed: %d up, %d down, %d members", up, down, members)
		return
	}
	k := d.rng.IntN(total)
	kind := ""
	for _, c := range cs {
		if k < c.weight {
			kind = c.kind
			break
		}
		k -= c.weight
	}
	ups := d.c.byState("up")
	switch kind {
	case "kill", "stop":
		m := ups[d.rng.IntN(len(ups))]
		sig, state := syscall.SIGKILL, "killed"
		if kind == "stop" {
			sig, state = syscall.SIGTERM, "stopped"
		}
		d.rep.event(kind, "%s with %v", d.describe(m), sig)
		d.c.mu.Lock()
		m.state = state
		m.disturbed++
		d.c.mu.Unlock()
		if err := d.c.signal(m, sig); err != nil {
			d.rep.check("node-stops", false, "%v", err)
		}
	case "restart":
		m := downs[d.rng.IntN(len(downs))]
		d.restart(ctx, m)
	case "holders", "blackout":
		n := d.cfg.copies
		if kind == "blackout" {
			n = len(ups)
		}
		victims := make([]*member, n)
		for i, j := range d.rng.Perm(len(ups))[:n] {
			victims[i] = ups[j]
		}
		names := ""
		for _, m := range victims {
			names += " " + d.describe(m)
		}
		d.rep.event(kind, "%d nodes SIGKILLed at once (every holder of some objects), back one at a time 6-10 s apart (lease 5 s):%s", n, names)
		for _, m := range victims {
			d.c.mu.Lock()
			m.state = "killed"
			m.disturbed++
			d.c.mu.Unlock()
			if err := d.c.signal(m, syscall.SIGKILL); err != nil {
				d.rep.check("node-stops", false, "%v", err)
			}
		}
		for _, m := range victims {
			gap := 6*time.Second + time.Duration(d.rng.Int64N(int64(4*time.Second)+1))
			select {
			case <-ctx.Done():
				return
			case <-time.After(gap):
			}
			d.restart(ctx, m)
		}
	case "partition":
		m := ups[d.rng.IntN(len(ups))]
		cut := 5*time.Second + time.Duration(d.rng.Int64N(int64(15*time.Second)+1))
		d.rep.event("partition", "%s cut off for %v", d.describe(m), cut.Round(time.Millisecond))
		d.c.mu.Lock()
		m.state = "cut"
		m.fenceable = true
		m.disturbed++
		d.c.mu.Unlock()
		mark := d.c.logSize(m)
		if err := d.c.nt.Cut(m.slot); err != nil {
			d.rep.check("partition", false, "%v", err)
			return
		}
		select {
		case <-ctx.Done():
		case <-time.After(cut):
		}
		if err := d.c.nt.Heal(m.slot); err != nil {
			d.rep.check("partition", false, "%v", err)
			return
		}
		d.afterHeal(ctx, m, mark)
	case "join":
		d.c.mu.Lock()
		m, err := d.c.newMemberLocked()
		d.c.mu.Unlock()
		if err != nil {
			d.rep.check("join", false, "%v", err)
			return
		}
		d.rep.event("join", "new node %s in namespace %d (%s), fresh directory", m.name, m.slot, d.c.nodeAddr(m))
		if err := d.c.start(ctx, m); err != nil {
			d.rep.check("node-starts", false, "%v", err)
			d.c.mu.Lock()
			m.state = "exited"
			d.c.mu.Unlock()
		}
	case "leave":
		m := ups[d.rng.IntN(len(ups))]
		d.rep.event("leave", "%s leaves for good (SIGTERM, directory deleted)", d.describe(m))
		d.c.mu.Lock()
		m.state = "leaving"
		m.disturbed++
		d.c.mu.Unlock()
		if err := d.c.signal(m, syscall.SIGTERM); err != nil {
			d.rep.check("node-stops", false, "%v", err)
		}
		os.RemoveAll(m.dir)
		d.c.mu.Lock()
		m.state = "left"
		d.c.slots[m.slot] = nil
		d.c.mu.Unlock()
	}
}

// afterHeal settles a healed member. A node that kept its lease runs
// on. One that lost it (it logs so) either stops, and is restarted once
// it has exited (ovis before the rejoin landed), or rejoins the
// membership by itself (it logs "rejoined the membership"): it is up
// again then. Clients wait meanwhile (the member is not up).
func (d *driver) afterHeal(ctx context.Context, m *member, mark int64) {
	d.c.mu.Lock()
	if m.state == "cut" {
		m.state = "healing"
	}
	ex := m.proc.Exited()
	d.c.mu.Unlock()
	healed := time.Now()
	d.rep.event("heal", "%s is on the network again", m.name)
	for {
		select {
		case <-ex:
			d.c.mu.Lock()
			m.state = "exited"
			d.c.mu.Unlock()
			d.rep.info("heal-outcome", "%s had exited (%v after the heal): restarting it", m.name, time.Since(healed).Round(100*time.Millisecond))
			d.restart(ctx, m)
			return
		default:
		}
		fenced := d.c.logSince(m, mark, "lost the membership lease")
		rejoined := d.c.logSince(m, mark, "rejoined the membership")
		switch {
		case rejoined != "":
			d.c.mu.Lock()
			if m.state == "healing" {
				m.state = "up"
			}
			d.c.mu.Unlock()
			d.rep.expected("node-rejoined-after-partition", "%s lost its lease and rejoined by itself %v after the heal: %s", m.name, time.Since(healed).Round(100*time.Millisecond), rejoined)
			return
		case fenced == "" && time.Since(healed) > 10*time.Second:
			d.c.mu.Lock()
			if m.state == "healing" {
				m.state = "up"
			}
			d.c.mu.Unlock()
			d.rep.expected("partition-ridden-out", "%s kept its lease through the partition and runs on", m.name)
			return
		case fenced != "" && time.Since(healed) > 90*time.Second:
			d.rep.check("fenced-node-returns", false, "%s lost its lease (%s) and had neither rejoined nor exited 90 s after the heal; killed, log tail:\n%s", m.name, fenced, d.c.logTail(m, 3000))
			d.c.signal(m, syscall.SIGKILL)
			continue
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(500 * time.Millisecond):
		}
	}
}

// restart starts m again on its directory.
func (d *driver) restart(ctx context.Context, m *member) {
	d.c.mu.Lock()
	was := m.state
	d.c.mu.Unlock()
	kind := "restart"
	if was == "exited" {
		kind = "restart-after-exit"
	}
	d.rep.event(kind, "%s (was %s) on its directory", d.describe(m), was)
	if err := d.c.start(ctx, m); err != nil {
		d.rep.check("node-starts", false, "%v", err)
		d.c.mu.Lock()
		if m.state == "starting" {
			m.state = "exited"
		}
		d.c.mu.Unlock()
	}
}

// revive restarts the members whose process ended on its own (a fence
// after a partition, or a death already reported as a failure).
func (d *driver) revive(ctx context.Context) {
	for _, m := range d.c.byState("exited") {
		d.restart(ctx, m)
	}
}

// settleAndCheck waits for the cluster to settle, then checks it with
// the clients paused.
func (d *driver) settleAndCheck(ctx context.Context, when string) {
	t0 := time.Now()
	deadline := t0.Add(d.cfg.settleTO)
	var why string
	for {
		if ctx.Err() != nil {
			return
		}
		d.revive(ctx)
		ok, w, epoch := d.c.settled(ctx)
		if ok {
			d.rep.check("settle", true, "%s: %d nodes up, recovered and clean at epoch %d after %v", when, len(d.c.byState("up")), epoch, time.Since(t0).Round(100*time.Millisecond))
			break
		}
		why = w
		if time.Now().After(deadline) {
			d.rep.check("settle", false, "%s: not settled in %v: %s", when, d.cfg.settleTO, why)
			return
		}
		time.Sleep(time.Second)
	}
	d.c.mu.Lock()
	deaths := d.c.deaths
	d.c.deaths = 0
	d.c.mu.Unlock()
	if deaths == 0 {
		d.rep.check("node-alive", true, "%s: no node died on its own since the last check", when)
	}
	// Copies are compared with no write in flight.
	t1 := time.Now()
	d.gate.Lock()
	paused := time.Since(t1)
	sum, err := d.c.clusterCheck(ctx, d.cfg.copies)
	d.gate.Unlock()
	if err != nil {
		d.rep.check("cluster-check", false, "%s: %v", when, err)
	} else {
		d.rep.check("cluster-check", true, "%s: %s (clients paused after %v)", when, sum, paused.Round(100*time.Millisecond))
	}
	d.c.mu.Lock()
	for _, m := range d.c.members {
		m.fenceable = m.fenceable && m.state != "up"
	}
	d.c.mu.Unlock()
}

// sabotage overwrites 4 KiB in the middle of a region the first client
// completed, through the cluster, as a lost or misdirected write would
// leave it: with junk (kind "junk"), or with the second client's block
// at the same offset (kind "stale"), an intact fio block with the right
// offset that fio's verify_only accepts, so that only the read-back hash
// can catch it. The final re-verification must report it.
func (d *driver) sabotage(ctx context.Context, kind string) {
	cl := d.cls[0]
	for r := range regions {
		if _, ok := cl.known[r]; !ok {
			continue
		}
		off := r*regionSize + regionSize/2
		addr, err := d.c.adminNode()
		var data []byte
		switch {
		case err != nil:
		case kind == "stale" && len(d.cls) > 1:
			data, err = d.c.adminBytes(ctx, addr, "vdi", "read", d.cls[1].name, fmt.Sprint(off), "4096")
		case kind == "junk":
			data = make([]byte, 4096)
			for i := range data {
				data[i] = byte(d.rng.Uint32())
			}
		default:
			err = fmt.Errorf("-sabotage %q: want junk, or stale with 2 clients or more", kind)
		}
		if err == nil {
			cmd := exec.CommandContext(ctx, d.c.ovis, "vdi", "write", cl.name, fmt.Sprint(off), "4096", "-a", addr)
			cmd.Stdin = bytes.NewReader(data)
			if out, werr := cmd.CombinedOutput(); werr != nil {
				err = fmt.Errorf("%v: %s", werr, out)
			}
		}
		if err != nil {
			d.rep.check("sabotage", false, "writing behind %s's back: %v", cl.name, err)
			return
		}
		d.rep.event("sabotage", "4 KiB (%s) written into %s region %d (offset %d) behind its back: its re-verification must fail", kind, cl.name, r, off)
		return
	}
	d.rep.info("sabotage", "%s completed no region: nothing to sabotage", cl.name)
}
