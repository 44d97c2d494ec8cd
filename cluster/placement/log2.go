package placement

import (
	"math/bits"
	"sync"
)

// The weighted score needs -log2 of a uniform 64-bit value. It is
// computed with integers only, from a table also built with integers
// only, so that every architecture gets the same bits: the answer of
// Place must not depend on the machine that asks.

const (
	logFrac      = 52 // fractional bits of the fixed-point results
	logTableBits = 12 // the table has 2^12+1 entries
	logInterp    = 64 - logTableBits
)

// log2Table returns the table whose entry i is log2(1 + i/2^logTableBits)
// with logFrac fractional bits, rounded down. It is built on first use,
// not at init: building it takes over a millisecond, which every ovis
// process paid, `ovis img` runs included, that never place an object.
var log2Table = sync.OnceValue(func() *[1<<logTableBits + 1]uint64 {
	var t [1<<logTableBits + 1]uint64
	for i := range 1 << logTableBits {
		t[i] = log2Fixed(uint64(1)<<62 + uint64(i)<<(62-logTableBits))
	}
	t[1<<logTableBits] = 1 << logFrac // log2(2), outside log2Fixed's domain
	return &t
})

// log2Fixed returns log2(x/2^62) for x in [2^62, 2^63), that is for
// values in [1, 2) with 62 fractional bits, with logFrac fractional
// bits, by repeated squaring: each squaring that reaches 2 yields a 1
// bit.
func log2Fixed(x uint64) uint64 {
	var r uint64
	for b := logFrac - 1; b >= 0; b-- {
		hi, lo := bits.Mul64(x, x) // x² with 124 fractional bits
		x = hi<<2 | lo>>62
		if x >= 1<<63 { // x² ≥ 2
			x >>= 1
			r |= 1 << b
		}
	}
	return r
}

// negLog2 returns -log2(h/2^64) with logFrac fractional bits: a value
// in (0, 64] for h ≥ 1; h = 0 counts as 1. Linear interpolation in the
// table keeps the error below 2^-26, far below anything that could
// bias a share, and the result is the same on every machine.
func negLog2(h uint64) uint64 {
	if h == 0 {
		h = 1
	}
	e := 63 - bits.LeadingZeros64(h)
	f := h << (63 - e) << 1 // the fraction after the leading 1, 64 bits
	i := f >> logInterp
	rem := f << logTableBits >> logTableBits // low logInterp bits
	t := log2Table()
	lo0, lo1 := t[i], t[i+1]
	hi, lo := bits.Mul64(lo1-lo0, rem)
	frac := lo0 + (hi<<(64-logInterp) | lo>>logInterp)
	return uint64(64-e)<<logFrac - frac
}
