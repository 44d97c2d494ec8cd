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
// mutation, kept by tombstones and copied by recovery, so that the
// highest version among the copies that are not suspect is the newest
// data. A node that was away (out of the membership) missed writes that
// carried later epochs, so its copies compare lower; a removal leaves a
// tombstone whose version beats the data it removed.
//
// Invariants:
//
//  1. A step never makes a copy older: Pull and PullTombstone name a
//     source whose version is above the node's own (or whose copy is not
//     suspect where the node's is).
//  2. When no copy is trustworthy (every one is suspect: a power loss of
//     every holder), every node picks the same one, the highest version
//     and then the lowest node ID, so the copies converge to one.
//  3. A copy a node no longer should hold is dropped only once every node
//     now placed for it has finished recovering an epoch at least as
//     new as the one the decision is made in: each of them then holds a
//     copy at least as new as the dropped one.
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
	// Trust: every copy is suspect and the node's own was chosen; it is
	// synced and declared good, and the others copy it.
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
	}
	return "action?"
}

// Step is the decision for one object.
type Step struct {
	Action Action
	// Source is the node to copy from (Pull), and Version the version
	// the node ends with (Pull, PullTombstone, Trust).
	Source  string
	Version uint64
	// FromSuspect: the source's copy is suspect, chosen because no copy
	// is better; it must be read as it is (protocol.FlagRecovery).
	FromSuspect bool
}

// better orders copies for choosing a source: higher version first,
// then the lower node ID, so that every node choosing among the same
// copies chooses the same one.
func better(a, b Copy) int {
	if c := cmp.Compare(b.Version, a.Version); c != 0 {
		return c
	}
	return cmp.Compare(a.Node, b.Node)
}

// Decide returns what node self does about one object it is placed for,
// given the copies the live nodes hold (self's among them, if any; a
// node holding nothing is simply absent).
func Decide(self string, copies []Copy) Step {
	var own *Copy
	var best, bestSuspect *Copy
	for i := range copies {
		c := &copies[i]
		if c.Node == self {
			own = c
		}
		if c.Suspect {
			if bestSuspect == nil || better(*c, *bestSuspect) < 0 {
				bestSuspect = c
			}
			continue
		}
		if best == nil || better(*c, *best) < 0 {
			best = c
		}
	}
	switch {
	case best != nil:
		if own != nil && !own.Suspect && own.Version >= best.Version {
			return Step{Action: Keep, Version: own.Version}
		}
		if best.Tombstone {
			return Step{Action: PullTombstone, Source: best.Node, Version: best.Version}
		}
		return Step{Action: Pull, Source: best.Node, Version: best.Version}
	case bestSuspect != nil:
		if bestSuspect.Node == self {
			return Step{Action: Trust, Version: own.Version}
		}
		return Step{Action: Pull, Source: bestSuspect.Node, Version: bestSuspect.Version, FromSuspect: true}
	}
	return Step{Action: Keep}
}

// MayDrop reports whether node self, which holds a copy of an object it
// is no longer placed for in epoch, may delete that copy: every node
// placed for the object has recorded recovery complete for epoch or a
// later one (recovered maps a node to its last complete epoch). With
// no placed node at all (nothing to hand the copy to) it may not.
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
