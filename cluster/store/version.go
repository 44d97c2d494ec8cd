package store

import (
	"fmt"
	"math"
)

// A version is epoch<<32 | n: the membership epoch of the copy's last
// mutation in the high 32 bits, and a count of mutations within that
// epoch in the low 32. Recovery compares versions between replicas, so a
// version must order copies of one object across nodes: a copy written
// in a later epoch is newer than any copy last written in an earlier
// one, whatever either's count. Counts alone restart or diverge on a
// node that was away; epochs are the cluster's one shared clock.

// MaxEpoch is the highest epoch a version can carry.
const MaxEpoch = math.MaxUint32

// Version returns the version of the n-th mutation of epoch epoch.
// epoch must be at most MaxEpoch; higher bits are dropped.
func Version(epoch uint64, n uint32) uint64 {
	return (epoch&MaxEpoch)<<32 | uint64(n)
}

// VersionEpoch returns the epoch of version v.
func VersionEpoch(v uint64) uint64 { return v >> 32 }

// VersionCount returns the count within its epoch of version v.
func VersionCount(v uint64) uint32 { return uint32(v) }

// Stamp is what a mutating call carries: the writer's fencing token and
// the membership epoch the node admitted the request in.
type Stamp struct {
	Token, Epoch uint64
}

// nextVersion is the version of a copy at old after one more mutation
// stamped with epoch: max(old+1, Version(epoch, 1)), except that the
// count saturates at 2^32-1 instead of carrying into the epoch bits.
// Within one epoch the count only breaks ties between copies that differ
// by writes not yet acknowledged (every acknowledged write reached every
// replica of the epoch), so a saturated count loses no acknowledged
// data; a carry would make the copy claim an epoch it was never written
// in, and win against a genuinely newer copy.
func nextVersion(old, epoch uint64) uint64 {
	if base := Version(epoch, 1); old < base {
		return base
	}
	if VersionCount(old) == math.MaxUint32 {
		return old
	}
	return old + 1
}

func checkEpoch(op string, st Stamp) error {
	if st.Epoch > MaxEpoch {
		return fmt.Errorf("store: %s: epoch %d above %d: %w", op, st.Epoch, uint64(MaxEpoch), ErrRange)
	}
	return nil
}
