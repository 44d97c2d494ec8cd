// Package recovery decides, for one node and one membership epoch, what
// the node must do so that it holds the newest copy of every object
// placed on it, and when it may drop a copy it no longer should hold.
//
// It is pure: the node's recovery loop (cluster/node) gathers what every
// live node holds and carries the steps out; the decisions here take no
// time, no network and no disk, so that tests can drive them through
// any history.
//
// Versions come from cluster/store: epoch<<32 | count, raised by every
// mutation, kept by tombstones and copied by recovery, so that among
// copies of one rank (below) the highest version that is not suspect is
// the newest data. A node that was away (out of the membership) missed writes that
// carried later epochs, so its copies compare lower; a removal leaves a
// tombstone whose version beats the data it removed.
//
// A version alone does not say which copy is newest when a node was cut
// off: a gateway on a node cut off from the others keeps applying its
// client's writes to its own copy (stamped with its last epoch) until
// its lease runs out, though none of them is acknowledged; the others go
// on in the next epoch, and a new owner may read the older bytes there.
// So copies are ranked first (Copy.Rank): by the latest epoch in which
// the holder is known to have received every acknowledged write of the
// object. The cut-off node's copy ranks at its last epoch, the copies of
// the nodes that went on rank later, and they win, although the cut-off
// copy's version is higher.
//
// Invariants:
//
//  1. Rank is a lower bound: a copy of rank R holds every acknowledged
//     write of the object made in an epoch up to R. Any copy that holds
//     the last acknowledged write (made in epoch W) ranks at least W, so
//     the chosen copy, of the highest rank, holds it: ranking never loses
//     an acknowledged write, and a copy of a lower rank never wins.
//  2. Among copies of the best rank, one that is not suspect wins over a
//     suspect one (it made every write it took durable), then the higher
//     version, then the lower node ID: every node choosing among the same
//     copies chooses the same one, so copies converge.
//  3. A step makes a copy older only to replace a copy of a lower rank
//     (Step.Replace): the copy it replaces holds writes that were never
//     acknowledged.
//  4. A copy a node no longer should hold is dropped only once every node
//     now placed for it has finished recovering an epoch at least as
//     new as the one the decision is made in, and stayed placed for it
//     up to that epoch: each of them then holds a copy at least as new
//     as the dropped one.
//  5. Absence is evidence only when every possible holder answered
//     (Unfound): a decision is made, and a run counts as complete, only
//     for an object of which, in every epoch after the best rank among
//     the answers, some node placed for it answered. Otherwise the
//     object is unavailable: it is neither served nor decided, and the
//     run of the epoch is not recorded.
//  6. A live own copy (Copy.Live) that is not suspect is kept: it has
//     every acknowledged write, and any copy with a higher version
//     lacks, or may lack, writes of the epoch this one took first, so
//     pulling it would lose them. Only copies that took no write of the
//     epoch decided in are compared by version.
//
// # Why absence needs every possible holder (Unfound)
//
// Ranks and Decide judge the copies of the nodes that answered. A node
// that holds nothing of an object is taken to show that it was never
// written (or, of a high rank, that a copy of a lower rank holds writes
// never acknowledged). That holds only if no node that did not answer
// may hold a newer copy. Issue 26 is what happens otherwise: every
// holder of an object is down, the nodes still up are placed for it, find
// no copy, record the epoch as recovered, and when the holders return
// their copies rank below that "absence" and are dropped, while reads in
// between return zeros.
//
// The rule: let R be the best rank among the answers (0 when none says
// anything) and W the epoch of the object's last acknowledged write.
// Every node placed for the object in W received that write. If W > R,
// take a node Z placed in W that answered: it held the write, so its
// copy's version epoch, and with it its rank, is at least W > R, unless
// it no longer holds it. A copy goes only in three ways: replaced by a
// copy of a higher rank (which holds the write: invariant 1), dropped as
// holding only writes never acknowledged (not this one: it was
// acknowledged), or dropped as moved (invariant 4) once every node placed
// for it in a later epoch W' held it; some node placed in W' answered
// too, and the same argument applies to it, with W' > W. Epochs end at
// the one being decided, so some answering node holds a copy of rank at
// least W > R: a contradiction. So W <= R, and the copy of the best rank
// holds the last acknowledged write. Unfound checks the premise: in every
// epoch from R+1 (or the VDI's creation) to the one decided, some node
// placed for the object answered. Where an epoch's placement is no
// longer known (the VDI's copies then), every node of that epoch must
// have answered.
//
// Ceph calls such an object "down" or "unfound" and makes I/O wait until
// a holder returns or an operator gives it up; so does ovis.
package recovery

import (
	"cmp"
	"slices"
)

// Copy is what one node holds of an object.
type Copy struct {
	Node    string
	Version uint64
	// Suspect: the copy may be torn (its node crashed with writes to it
	// not yet durable); its version says nothing about its bytes.
	Suspect bool
	// Tombstone: the object was removed at Version.
	Tombstone bool
	// Absent: the node holds nothing of the object (Version 0). Only
	// its Rank matters: a node of a high rank that holds nothing shows
	// that the object was never acknowledged up to that epoch, so a copy
	// a cut-off writer created goes.
	Absent bool
	// Live: the copy takes the writes of the epoch decided in and has
	// taken some (its Rank and its version's epoch are that epoch). Two
	// live copies differ only by that epoch's writes in flight, which
	// reach the replicas in different orders, each counting its own
	// version, or by writes never acknowledged: their versions do not
	// order them (invariant 6).
	Live bool
	// Rank is the latest epoch in which the holder is known to have
	// received every acknowledged write of the object: at least the
	// epoch of Version (a node takes a write only once it is current),
	// and the last epoch of an unbroken run of epochs, from one whose
	// recovery the holder completed, in each of which it was placed for
	// the object. See the package comment.
	Rank uint64
}

// Action is what a node does about one object.
type Action int

const (
	// Keep: the node's copy is the newest (or nobody holds the object).
	Keep Action = iota
	// Pull: copy the object's bytes and version from Source.
	Pull
	// PullTombstone: the object was removed; make the node's copy a
	// tombstone of Version.
	PullTombstone
	// Drop: the nodes of the best rank hold nothing; the node's own
	// copy, of a lower rank, holds only writes never acknowledged and is
	// deleted (no tombstone: nothing was removed).
	Drop
	// Trust: every copy of the best rank is suspect and the node's own
	// was chosen; it is declared good, and the others copy it.
	Trust
)

func (a Action) String() string {
	switch a {
	case Keep:
		return "keep"
	case Pull:
		return "pull"
	case PullTombstone:
		return "pull-tombstone"
	case Trust:
		return "trust"
	case Drop:
		return "drop"
	}
	return "action?"
}

// Step is the decision for one object.
type Step struct {
	Action Action
	// Source is the node to copy from (Pull), and Version the version
	// the node ends with (Pull, PullTombstone, Trust), or the version of
	// the copy it deletes (Drop).
	Source  string
	Version uint64
	// FromSuspect: the source's copy is suspect, chosen because no copy
	// is better; it must be read as it is (protocol.FlagRecovery).
	FromSuspect bool
	// Replace: the node's own copy, of a lower rank, has a version at
	// least as high as Version's; it is replaced anyway (not the
	// store's conditional Put).
	Replace bool
	// Verify (Pull): the node's own copy, of a lower rank, has the
	// source's version; it is replaced only if its bytes differ from the
	// source's (a checksum of each), and kept otherwise, so that a node
	// back from an outage does not copy again every object nobody wrote
	// meanwhile. A copy kept so is withheld as a pulled one would be
	// (Hide).
	Verify bool
	// Hide (Pull, PullTombstone): another good copy of the source's
	// rank lacks Version, so Version holds a write that was never
	// acknowledged (an acknowledged one reached every copy current in
	// its epoch) and that copy may be served as current meanwhile. The
	// node withholds what it pulls from readers until the copies agree,
	// so that no reader sees the write here and then misses it there.
	Hide bool
}

// better orders copies for choosing a source: the higher rank first,
// then a copy that is not suspect, then the higher version, then the
// lower node ID, so that every node choosing among the same copies
// chooses the same one.
func better(a, b Copy) int {
	if c := cmp.Compare(b.Rank, a.Rank); c != 0 {
		return c
	}
	if a.Suspect != b.Suspect {
		if b.Suspect {
			return -1
		}
		return 1
	}
	if c := cmp.Compare(b.Version, a.Version); c != 0 {
		return c
	}
	return cmp.Compare(a.Node, b.Node)
}

// Decide returns what node self does about one object it is placed for,
// given the copies the live nodes hold (self's among them, if any; a
// node holding nothing is simply absent).
func Decide(self string, copies []Copy) Step {
	var own, best *Copy
	for i := range copies {
		c := &copies[i]
		if c.Node == self {
			own = c
		}
		if best == nil || better(*c, *best) < 0 {
			best = c
		}
	}
	switch {
	case best == nil:
		return Step{Action: Keep}
	case own != nil && own.Live && !own.Suspect && !own.Absent:
		return Step{Action: Keep, Version: own.Version}
	case best.Absent && own != nil && !own.Absent:
		return Step{Action: Drop, Version: own.Version}
	case best.Absent:
		return Step{Action: Keep}
	case best == own && own.Suspect:
		// Every copy of the best rank is suspect (their holders crashed
		// with writes not yet durable) and this one was chosen.
		return Step{Action: Trust, Version: own.Version}
	case best == own:
		return Step{Action: Keep, Version: own.Version}
	case own != nil && !own.Absent && !own.Suspect && own.Version == best.Version && own.Tombstone == best.Tombstone && (own.Rank == best.Rank || own.Tombstone):
		// Equal versions mean equal bytes within one rank, and two
		// tombstones are the same removal.
		return Step{Action: Keep, Version: own.Version}
	}
	st := Step{Action: Pull, Source: best.Node, Version: best.Version, FromSuspect: best.Suspect}
	if best.Tombstone {
		st.Action = PullTombstone
	}
	// A good own copy at a version as high is of a lower rank: it holds
	// writes never acknowledged, and is replaced all the same.
	st.Replace = own != nil && !own.Absent && !own.Suspect && own.Version >= best.Version
	// Across ranks an equal version says nothing of the bytes: each
	// replica counts its own writes, so a cut-off writer's copy of a
	// lower rank can reach the version of the others' acknowledged write
	// with other bytes. The copies are compared before any is moved.
	st.Verify = st.Replace && own.Version == best.Version && !best.Tombstone
	for _, c := range copies {
		if c.Node == self || c.Node == best.Node || c.Rank != best.Rank || c.Suspect {
			continue
		}
		// An absent copy reads as zeros, as a tombstone does.
		if c.Absent && !best.Tombstone || !c.Absent && c.Version < best.Version {
			st.Hide = true
		}
	}
	return st
}

// MayDrop reports whether node self, which holds a copy of an object it
// is no longer placed for in epoch, may delete that copy: every node
// placed for the object has recorded recovery complete for epoch or a
// later one, and stayed placed for the object from epoch up to that
// one. recovered maps a node to that epoch for this object: its last
// complete run if it stayed placed from epoch to it, else 0 (a run of an
// epoch in which it was not placed says nothing of the object). With no
// placed node at all (nothing to hand the copy to) it may not.
func MayDrop(self string, placed []string, epoch uint64, recovered map[string]uint64) bool {
	if len(placed) == 0 || slices.Contains(placed, self) {
		return false
	}
	for _, n := range placed {
		if recovered[n] < epoch {
			return false
		}
	}
	return true
}

// TombstoneFloor is the epoch below which a tombstone may be forgotten:
// the lowest clean epoch (clean maps a node to the last epoch after whose
// recovery it had dropped every copy it no longer holds) among the nodes
// that ever recovered (recovered's keys). Each of them then holds no copy
// a tombstone older than that removed, so forgetting it brings nothing
// back. A node that recovered but was never clean gives 0: nothing may go.
// With no node at all the floor is the largest epoch.
func TombstoneFloor(recovered, clean map[string]uint64) uint64 {
	floor := uint64(1<<64 - 1)
	for id := range recovered {
		floor = min(floor, clean[id])
	}
	return floor
}

// Rank returns the rank of a node's copy of an object (Copy.Rank) in
// epoch upTo: the end of the longest unbroken run of epochs in which the
// node was placed for the object, starting from an epoch in which its
// copy is known current, and at least the epoch of version (a node takes
// a write only once its copy is current). A copy is known current in
// the epoch of the node's last completed run (recovered), in the epoch
// the object's VDI was created in (created: nobody had any write), and
// in its version's epoch; a node that holds nothing passes version 0.
// placed reports whether the node was placed for the object in epoch e;
// known false (the epoch's placement is no longer known) ends a run,
// which only makes the rank lower: ranks err low, never high. Its error
// is returned as it is.
func Rank(version, recovered, created, upTo uint64, placed func(e uint64) (ok, known bool, err error)) (uint64, error) {
	verEpoch := version >> 32
	best := verEpoch
	for _, s := range []uint64{max(recovered, created), verEpoch} {
		e, err := PlacedRun(s, upTo, placed)
		if err != nil {
			return 0, err
		}
		best = max(best, e)
	}
	return best, nil
}

// Ranked completes the copies the nodes of nodes hold of one object,
// for a decision in epoch upTo, as Decide and Unfound take them: it sets
// each copy's Rank (rank gives it for a node and a version, as Rank
// does; 0 for a node that holds nothing) and Live (it ranks at upTo and
// its version is of upTo), and appends for each node of nodes that holds
// nothing an Absent copy with its rank, when that rank says something
// (above 0). The node's recovery and the model test both rank through
// it, so that the model checks the rule the node runs.
func Ranked(copies []Copy, nodes []string, upTo uint64, rank func(node string, version uint64) (uint64, error)) ([]Copy, error) {
	for i := range copies {
		r, err := rank(copies[i].Node, copies[i].Version)
		if err != nil {
			return nil, err
		}
		copies[i].Rank = r
		copies[i].Live = r == upTo && copies[i].Version>>32 == upTo
	}
	held := len(copies)
	for _, id := range nodes {
		if slices.ContainsFunc(copies[:held], func(c Copy) bool { return c.Node == id }) {
			continue
		}
		r, err := rank(id, 0)
		if err != nil {
			return nil, err
		}
		if r > 0 {
			copies = append(copies, Copy{Node: id, Absent: true, Rank: r})
		}
	}
	return copies, nil
}

// PlacedRun returns the last epoch of the unbroken run of epochs from s
// up to upTo in which a node was placed for an object (placed, as for
// Rank), and 0 when it was not placed in s, or s is 0 or above upTo.
func PlacedRun(s, upTo uint64, placed func(e uint64) (ok, known bool, err error)) (uint64, error) {
	if s == 0 || s > upTo {
		return 0, nil
	}
	e := s - 1
	for e < upTo {
		ok, known, err := placed(e + 1)
		if err != nil {
			return 0, err
		}
		if !known || !ok {
			break
		}
		e++
	}
	if e < s {
		return 0, nil
	}
	return e, nil
}

// Placement is where one object was placed in one epoch, as Unfound
// sees it: its replicas (Exact), or, where the epoch's copies of the
// object's VDI are no longer known, every node of the epoch (some of
// which were its replicas).
type Placement struct {
	Nodes []string
	Exact bool
}

// Unfound returns the nodes that may hold a copy of an object newer than
// every copy the answering nodes hold, sorted; nil when the answers
// settle the object (see the package comment). copies are the answering
// nodes' ranked copies (Absent ones included); answered says whether a
// node answered (held nothing or a copy in copies); from is the first
// epoch in which the object can have been written (its VDI's creation),
// upTo the epoch decided in, and placed gives the object's placement in
// an epoch. An error from placed is returned as it is.
func Unfound(copies []Copy, answered func(node string) bool, from, upTo uint64, placed func(epoch uint64) (Placement, error)) ([]string, error) {
	best := uint64(0)
	for _, c := range copies {
		best = max(best, c.Rank)
	}
	var away []string
	for e := max(best+1, from, 1); e <= upTo; e++ {
		p, err := placed(e)
		if err != nil {
			return nil, err
		}
		var missing []string
		some := false
		for _, n := range p.Nodes {
			if answered(n) {
				some = true
			} else {
				missing = append(missing, n)
			}
		}
		if (p.Exact && some) || len(missing) == 0 {
			continue
		}
		away = append(away, missing...)
	}
	if away == nil {
		return nil, nil
	}
	slices.Sort(away)
	return slices.Compact(away), nil
}
