package store

import (
	"bytes"
	"encoding/binary"
	"maps"
	"testing"

	"github.com/ovis-storage/ovis/cluster/object"
)

func FuzzHeader(f *testing.F) {
	var b [headerLen]byte
	header{id: object.Make(1, 2), version: 7}.encode(b[:])
	f.Add(b[:], uint64(object.Make(1, 2)))
	f.Add(b[:20], uint64(1))
	f.Add(make([]byte, headerLen), uint64(0))
	var tomb [headerLen]byte
	header{id: object.Make(3, 4), version: Version(9, 2), removed: true}.encode(tomb[:])
	f.Add(tomb[:], uint64(object.Make(3, 4)))
	f.Fuzz(func(t *testing.T, b []byte, want uint64) {
		h, err := decodeHeader(b, object.ID(want))
		if err != nil {
			return
		}
		if h.id != object.ID(want) {
			t.Fatalf("decoded id %s, want %s", h.id, object.ID(want))
		}
		// Only the removed bit may be set, and it is what decodes.
		flags := binary.LittleEndian.Uint32(b[12:])
		if flags&^flagRemoved != 0 || h.removed != (flags&flagRemoved != 0) {
			t.Fatalf("flags %#x decoded as removed=%v", flags, h.removed)
		}
		var re [headerLen]byte
		h.encode(re[:])
		if !bytes.Equal(re[:], b[:headerLen]) {
			t.Fatalf("header does not round-trip: %x vs %x", re, b[:headerLen])
		}
	})
}

func FuzzJournal(f *testing.F) {
	var rec [recSize]byte
	var seed []byte
	for _, r := range []record{{key: 5, op: recDirty}, {key: 1, val: 9, op: recToken}, {key: 5, op: recClean}, {key: 6, op: recSuspect}} {
		r.encode(rec[:])
		seed = append(seed, rec[:]...)
	}
	f.Add(seed)
	f.Add(seed[:len(seed)-3])
	f.Add(append(bytes.Clone(seed[:30]), seed...))
	f.Fuzz(func(t *testing.T, b []byte) {
		l := newLiveState()
		n := replay(b, l)
		if n%recSize != 0 || n > len(b) {
			t.Fatalf("valid prefix %d of %d bytes", n, len(b))
		}
		// The prefix alone gives the same state, and so does its
		// snapshot (what compaction writes).
		l2 := newLiveState()
		if replay(b[:n], l2) != n || !maps.Equal(l.objs, l2.objs) || !maps.Equal(l.tokens, l2.tokens) {
			t.Fatal("replay of the valid prefix differs")
		}
		l3 := newLiveState()
		snap := l.encode()
		if replay(snap, l3) != len(snap) || !maps.Equal(l.objs, l3.objs) || !maps.Equal(l.tokens, l3.tokens) {
			t.Fatal("snapshot does not replay to the same state")
		}
		for id, op := range l.objs {
			if op != recDirty && op != recSuspect {
				t.Fatalf("object %s in state %d", id, op)
			}
		}
	})
}
