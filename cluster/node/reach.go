package node

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/ovis-storage/ovis/cluster/membership"
	"github.com/ovis-storage/ovis/cluster/protocol"
)

// A node that reaches etcd but not its peers leaves the epoch by itself
// (membership's reachability rule, membership.Leavers): each probe
// round it sends a HELLO to every other node of its epoch, reports in
// etcd the peers it missed reachFailures rounds in a row, each probe
// waiting two rounds at most (and withdraws them when they answer),
// then reads every node's reports of the epoch and applies the rule. A node the rule names drops its registration (as a lost
// lease: its VDIs are held, its locks go with the lease and are taken
// again if nobody else took them), and joins again only once it reaches
// every node registered (reachAll, from the rejoin). A dead or stopped
// peer reports nobody: the rule names it, never a live node that
// reports it. The others write
// on without it as soon as the epoch without it is out: a few probe
// rounds after the cut.
const reachFailures = 3

// reacher is the probe loop's state; only watchReach's goroutine uses it.
type reacher struct {
	n        *Node
	misses   map[string]int    // consecutive missed probes, per peer
	reported map[string]uint64 // peers reported unreachable under reg: in which epoch
	unsure   bool              // a report failed under reg: it may stand in etcd all the same
	reg      *membership.Registration
}

// probe sends a HELLO to each of addrs (by node ID) at once, each with
// at most timeout, and returns the IDs that did not answer, sorted.
func (n *Node) probe(ctx context.Context, addrs map[string]string, timeout time.Duration) []string {
	var (
		mu     sync.Mutex
		missed []string
		wg     sync.WaitGroup
	)
	for id, addr := range addrs {
		if id == n.id {
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			pctx, cancel := context.WithTimeout(ctx, timeout)
			defer cancel()
			req := protocol.Request{Op: protocol.OpHello, Payload: []byte(n.id), Length: uint32(len(n.id))}
			var resp protocol.Response
			if err := n.pool.Call(pctx, addr, &req, &resp); err != nil {
				mu.Lock()
				missed = append(missed, id)
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	slices.Sort(missed)
	return missed
}

// watchReach runs the probe rounds every ProbeInterval until ctx ends.
func (n *Node) watchReach(ctx context.Context) {
	every := orSecond(n.cfg.ProbeInterval)
	r := &reacher{n: n}
	ticking(ctx, every, func() { r.round(ctx, every) })
}

// orSecond is d, or 1 s when d is not positive (a Config default).
func orSecond(d time.Duration) time.Duration {
	if d <= 0 {
		return time.Second
	}
	return d
}

// ticking calls f every d until ctx ends.
func ticking(ctx context.Context, d time.Duration, f func()) {
	tick := time.NewTicker(d)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
			f()
		}
	}
}

// round is one probe round: probe, report, apply the rule.
func (r *reacher) round(ctx context.Context, every time.Duration) {
	n := r.n
	reg := n.registration()
	if reg.Err() != nil {
		return // rejoining: the new registration starts afresh
	}
	if reg != r.reg {
		r.reg, r.misses, r.reported, r.unsure = reg, map[string]int{}, map[string]uint64{}, false
	}
	v := n.views.View()
	missed := n.probe(ctx, v.Addr, 2*every)
	for id := range v.Addr {
		if id == n.id {
			continue
		}
		if slices.Contains(missed, id) {
			r.misses[id]++
		} else {
			r.misses[id] = 0
		}
	}
	for id := range r.misses {
		if _, ok := v.Addr[id]; !ok {
			delete(r.misses, id)
		}
	}
	var back, lost []string
	for id := range r.reported {
		if _, in := v.Addr[id]; !in || r.misses[id] == 0 {
			back = append(back, id)
		}
	}
	for id, m := range r.misses {
		if m >= reachFailures && r.reported[id] != v.Epoch {
			lost = append(lost, id)
		}
	}
	slices.Sort(back)
	slices.Sort(lost)
	if err := reg.Report(ctx, 0, back...); err == nil {
		for _, id := range back {
			delete(r.reported, id)
			n.log.Info("peer reachable again", "peer", id)
		}
	}
	// The round's new reports in one transaction: none is read alone.
	if err := reg.Report(ctx, v.Epoch, lost...); err != nil {
		r.unsure = true
		n.log.Warn("reporting unreachable peers failed", "peers", strings.Join(lost, " "), "err", err)
	} else {
		for _, id := range lost {
			r.reported[id] = v.Epoch
			n.log.Warn("cannot reach peer; reported in etcd", "peer", id, "addr", v.Addr[id], "missed", r.misses[id])
		}
	}
	n.unreachable.Store(int64(len(r.reported)))
	if !r.unsure && !slices.Contains(slices.Collect(maps.Values(r.reported)), v.Epoch) {
		// The rule names only nodes that report a peer themselves
		// (membership.Leavers): with no report of its own in this
		// epoch, this node is not one, and reads no reports (an etcd
		// read every round on every node: about 5 ms/s of CPU over
		// three idle nodes on loopback).
		return
	}
	reports, err := n.mc.Reports(ctx, v.Epoch)
	if err != nil || len(reports) == 0 {
		return
	}
	if !slices.Contains(membership.Leavers(v.IDs(), reports), n.id) {
		return
	}
	n.reachLeft.Store(true)
	n.m.CutOffs.Inc()
	n.log.Error("cut off from peers while reaching etcd: leaving the epoch until every peer answers", "epoch", v.Epoch, "unreachable", strings.Join(unreachableFrom(n.id, reports), " "))
	if err := reg.Drop(ctx, "cut off from its peers"); err != nil {
		n.log.Warn("dropping the registration failed; the lease will run out", "err", err)
	}
}

// unreachableFrom lists the peers that id reports or is reported by.
func unreachableFrom(id string, reports map[string][]string) []string {
	var out []string
	for from, tos := range reports {
		if from == id {
			out = append(out, tos...)
		} else if slices.Contains(tos, id) {
			out = append(out, from)
		}
	}
	slices.Sort(out)
	return slices.Compact(out)
}

// reachAll returns nil once the node reaches every node registered now
// (a dead one's registration goes with its lease), after it left for
// being cut off (reachLeft), else which it misses. A node that did not
// leave that way does not wait.
func (n *Node) reachAll(ctx context.Context) error {
	if !n.reachLeft.Load() {
		return nil
	}
	live, err := n.mc.Registered(ctx)
	if err != nil {
		return err
	}
	addrs := map[string]string{}
	for _, ni := range live {
		addrs[ni.ID] = ni.Addr
	}
	if missed := n.probe(ctx, addrs, 2*orSecond(n.cfg.ProbeInterval)); len(missed) > 0 {
		return fmt.Errorf("node: still cut off from %s", strings.Join(missed, " "))
	}
	n.reachLeft.Store(false)
	return nil
}
