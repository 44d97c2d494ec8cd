package object

import (
	"fmt"
	"maps"
	"math/bits"
	"slices"
)

// SetChunk is how many indices one chunk of a Set covers: the unit in
// which a VDI's allocation map is stored (8 KiB of bits).
const SetChunk = 1 << 16

// chunkWords is a chunk's size in 64-bit words.
const chunkWords = SetChunk / 64

// Set is a set of object indices of one VDI, kept as chunks of bits so
// that its memory follows the indices present, not the VDI's size. The
// zero Set is empty and ready to use. It is not safe for concurrent use.
type Set struct {
	chunks map[uint32]*[chunkWords]uint64
	n      int
}

// Has reports whether i is in the set.
func (s *Set) Has(i uint32) bool {
	c := s.chunks[i/SetChunk]
	return c != nil && c[i%SetChunk/64]&(1<<(i%64)) != 0
}

// Add adds i and reports whether it was new.
func (s *Set) Add(i uint32) bool {
	if s.chunks == nil {
		s.chunks = map[uint32]*[chunkWords]uint64{}
	}
	c := s.chunks[i/SetChunk]
	if c == nil {
		c = new([chunkWords]uint64)
		s.chunks[i/SetChunk] = c
	}
	w, b := i%SetChunk/64, uint64(1)<<(i%64)
	if c[w]&b != 0 {
		return false
	}
	c[w] |= b
	s.n++
	return true
}

// Remove takes i out and reports whether it was there.
func (s *Set) Remove(i uint32) bool {
	c := s.chunks[i/SetChunk]
	w, b := i%SetChunk/64, uint64(1)<<(i%64)
	if c == nil || c[w]&b == 0 {
		return false
	}
	c[w] &^= b
	s.n--
	if *c == ([chunkWords]uint64{}) {
		delete(s.chunks, i/SetChunk)
	}
	return true
}

// Len is the number of indices in the set.
func (s *Set) Len() int { return s.n }

// Chunks returns the numbers of the chunks holding an index, in order.
func (s *Set) Chunks() []uint32 {
	return slices.Sorted(maps.Keys(s.chunks))
}

// ChunkBytes encodes chunk c: bit i%8 of byte i/8 is index
// c*SetChunk+i, with trailing zero bytes cut (nil for an empty chunk).
func (s *Set) ChunkBytes(c uint32) []byte {
	w := s.chunks[c]
	if w == nil {
		return nil
	}
	out := make([]byte, 0, SetChunk/8)
	for _, x := range w {
		for k := 0; k < 8; k++ {
			out = append(out, byte(x>>(8*k)))
		}
	}
	for len(out) > 0 && out[len(out)-1] == 0 {
		out = out[:len(out)-1]
	}
	if len(out) == 0 {
		return nil
	}
	return out
}

// AddChunkBytes adds the indices chunk c's encoding b holds
// (ChunkBytes). It fails, adding nothing, when b is longer than a chunk.
func (s *Set) AddChunkBytes(c uint32, b []byte) error {
	if len(b) > SetChunk/8 {
		return fmt.Errorf("object: chunk %d of an index set: %d bytes, at most %d", c, len(b), SetChunk/8)
	}
	for j, x := range b {
		for x != 0 {
			k := bits.TrailingZeros8(x)
			x &^= 1 << k
			s.Add(c*SetChunk + uint32(j*8+k))
		}
	}
	return nil
}

// Each calls f with every index in the set, in increasing order.
func (s *Set) Each(f func(i uint32)) {
	for _, c := range s.Chunks() {
		for w, x := range s.chunks[c] {
			for x != 0 {
				k := bits.TrailingZeros64(x)
				x &^= 1 << k
				f(c*SetChunk + uint32(w*64+k))
			}
		}
	}
}
