package object

import (
	"slices"
	"testing"

	"pgregory.net/rapid"
)

// TestSetModel adds and removes random indices (clustered, so that chunks fill and
// share) to a Set and to a map: membership, length and the ordered walk
// agree, and the chunk encoding round-trips.
func TestSetModel(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		var s Set
		model := map[uint32]bool{}
		base := rapid.SampledFrom([]uint32{0, SetChunk - 40, 5 * SetChunk, 1<<32 - 100}).Draw(t, "base")
		for _, d := range rapid.SliceOf(rapid.Uint32Range(0, 90)).Draw(t, "adds") {
			i := base + d
			if i < base {
				continue // wrapped past 2^32
			}
			if got := s.Add(i); got == model[i] {
				t.Fatalf("Add(%d) = %v with the index present: %v", i, got, model[i])
			}
			model[i] = true
		}
		for _, d := range rapid.SliceOf(rapid.Uint32Range(0, 90)).Draw(t, "removes") {
			i := base + d
			if i < base {
				continue
			}
			if got := s.Remove(i); got != model[i] {
				t.Fatalf("Remove(%d) = %v with the index present: %v", i, got, model[i])
			}
			delete(model, i)
		}
		if s.Len() != len(model) {
			t.Fatalf("Len %d, model %d", s.Len(), len(model))
		}
		var want []uint32
		for i := range model {
			want = append(want, i)
		}
		slices.Sort(want)
		var got []uint32
		s.Each(func(i uint32) { got = append(got, i) })
		if !slices.Equal(got, want) {
			t.Fatalf("Each gave %v, want %v", got, want)
		}
		for _, d := range rapid.SliceOf(rapid.Uint32Range(0, 90)).Draw(t, "probes") {
			if s.Has(base+d) != model[base+d] {
				t.Fatalf("Has(%d) = %v, model %v", base+d, s.Has(base+d), model[base+d])
			}
		}
		var back Set
		for _, c := range s.Chunks() {
			if err := back.AddChunkBytes(c, s.ChunkBytes(c)); err != nil {
				t.Fatal(err)
			}
		}
		var again []uint32
		back.Each(func(i uint32) { again = append(again, i) })
		if !slices.Equal(again, want) {
			t.Fatalf("decoded %v, want %v", again, want)
		}
	})
}

func TestSetChunkTooLong(t *testing.T) {
	var s Set
	if err := s.AddChunkBytes(0, make([]byte, SetChunk/8+1)); err == nil {
		t.Fatal("a chunk longer than 8 KiB was taken")
	}
	if s.Len() != 0 {
		t.Fatal("a refused chunk added indices")
	}
}
