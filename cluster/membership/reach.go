package membership

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// Reachability: a node that reaches etcd but not some of its peers (one
// network card failed, a switch port, a firewall rule) keeps its lease,
// so nothing would end the epoch, and every write between the two sides
// would wait and then fail. Each node probes the peers of its epoch and
// reports, under its lease, those it has not reached for a while
// (Registration.Report); the reports go with the reporter's lease. Every
// node reads them all and applies one pure rule (Leavers) to the
// epoch's nodes: the nodes the rule names leave the epoch by
// themselves (Registration.Drop), so that the rest write on without
// them. A node that left that way joins again only once it reaches
// every node of the epoch (cluster/node, reach.go).

// Report records, under the registration's lease, that its node cannot
// reach the targets in epoch (a report counts only in the epoch it
// names, so one left from before a node's return is not held against
// it), or withdraws them (epoch 0). The targets go in one transaction,
// so that nobody reads a round's reports half made: the rule
// (Leavers) weighs a node by how many it reports.
func (r *Registration) Report(ctx context.Context, epoch uint64, targets ...string) error {
	if len(targets) == 0 {
		return nil
	}
	ops := make([]clientv3.Op, 0, len(targets))
	for _, target := range targets {
		key := r.c.k.reach(target, r.node.ID)
		if epoch != 0 {
			ops = append(ops, clientv3.OpPut(key, strconv.FormatUint(epoch, 10), clientv3.WithLease(r.lease)))
		} else {
			ops = append(ops, clientv3.OpDelete(key))
		}
	}
	if _, err := r.c.cli.Txn(ctx).Then(ops...).Commit(); err != nil {
		return fmt.Errorf("membership: node %q: report of %s (epoch %d): %w", r.node.ID, strings.Join(targets, " "), epoch, err)
	}
	return nil
}

// Registered returns the nodes registered now (live leases), whatever
// the epoch says, sorted by ID.
func (c *Client) Registered(ctx context.Context) ([]NodeInfo, error) {
	s, err := c.readSnapshot(ctx)
	if err != nil {
		return nil, err
	}
	slices.SortFunc(s.live, func(a, b NodeInfo) int { return cmp.Compare(a.ID, b.ID) })
	return s.live, nil
}

// Reports returns the live reports made in epoch: per reporter, the
// nodes it cannot reach, sorted.
func (c *Client) Reports(ctx context.Context, epoch uint64) (map[string][]string, error) {
	resp, err := c.cli.Get(ctx, c.k.reaches(), clientv3.WithPrefix())
	if err != nil {
		return nil, fmt.Errorf("membership: read reachability reports: %w", err)
	}
	out := map[string][]string{}
	for _, kv := range resp.Kvs {
		target, reporter, ok := strings.Cut(strings.TrimPrefix(string(kv.Key), c.k.reaches()), "/")
		if !ok || target == "" || reporter == "" {
			return nil, fmt.Errorf("membership: reachability report key %q: want %sTARGET/REPORTER", kv.Key, c.k.reaches())
		}
		e, err := strconv.ParseUint(string(kv.Value), 10, 64)
		if err != nil {
			return nil, fmt.Errorf("membership: reachability report %s: epoch %q: %w", kv.Key, kv.Value, err)
		}
		if e == epoch {
			out[reporter] = append(out[reporter], target)
		}
	}
	for _, ts := range out {
		slices.Sort(ts)
	}
	return out, nil
}

// Drop ends the registration now for reason, as a lost lease would
// (Fenced closes, Err wraps ErrFenced): its lease is revoked, so its
// key, its locks and its reports go, and the others write the next
// epoch. The node then rejoins as after a lost lease.
func (r *Registration) Drop(ctx context.Context, reason string) error {
	_, err := r.c.cli.Revoke(ctx, r.lease)
	r.fence(reason, false)
	if err != nil {
		return fmt.Errorf("membership: node %q: drop: revoke lease %x: %w", r.node.ID, int64(r.lease), err)
	}
	return nil
}

// Leavers is the reachability rule, pure: given the nodes of an epoch
// and the reports (per reporter, the nodes it cannot reach), it returns
// the nodes that leave by themselves, sorted. A report counts only
// between two nodes of the epoch.
//
// A node reported by others that reports none of them is silent: dead,
// stopped, or cut off from etcd too (it goes with its lease, and could
// not act on the rule anyway), or alive and not yet sure it misses
// anyone. It is not named, and the reports of it are set aside, so that
// neither a dead peer nor a cut-off node that saw its cut first (its
// dials failed at once, its peers' still wait) makes a live node leave.
// Every other report is a cut link between its two ends: while cut
// links remain, the node on the most of them leaves (ties: the one
// that reports the most nodes, then the greatest ID); so a node cut off
// from all its peers leaves alone, however many of them reported it
// yet, one cut link costs one of its two ends, and of two equal halves
// the one holding the smallest ID stays. Each leaver reports a peer
// itself. Every node that reads the same reports computes the same
// answer.
func Leavers(nodes []string, reports map[string][]string) []string {
	in := map[string]bool{}
	for _, n := range nodes {
		in[n] = true
	}
	reported := map[[2]string]bool{} // from, to
	reports1 := map[string]int{}     // reports each node makes
	for from, tos := range reports {
		for _, to := range tos {
			if in[from] && in[to] && from != to && !reported[[2]string{from, to}] {
				reported[[2]string{from, to}] = true
				reports1[from]++
			}
		}
	}
	links := map[[2]string]bool{}
	for l := range reported {
		if reports1[l[1]] > 0 { // else l[1] is silent
			links[[2]string{min(l[0], l[1]), max(l[0], l[1])}] = true
		}
	}
	var out []string
	for len(links) > 0 {
		degree := map[string]int{}
		for l := range links {
			degree[l[0]]++
			degree[l[1]]++
		}
		var worst string
		for n, d := range degree {
			c := cmp.Or(cmp.Compare(d, degree[worst]), cmp.Compare(reports1[n], reports1[worst]), cmp.Compare(n, worst))
			if worst == "" || c > 0 {
				worst = n
			}
		}
		out = append(out, worst)
		for l := range links {
			if l[0] == worst || l[1] == worst {
				delete(links, l)
			}
		}
	}
	slices.Sort(out)
	return out
}
