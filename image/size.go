package image

import (
	"errors"
	"math/bits"
	"strconv"
)

// The errors of ParseSize, QEMU's qemu_strtosz's -EINVAL and -ERANGE.
var (
	// ErrSizeSyntax is returned for a string that is not a size.
	ErrSizeSyntax = errors.New("image: invalid size")
	// ErrSizeRange is returned for a size that does not fit in 64 bits.
	ErrSizeRange = errors.New("image: size out of range")
)

// ParseSize parses a byte count as QEMU's option lists and tools write
// one, the way qemu_strtosz does (QEMU 7.2, util/cutils.c): a decimal
// number with an optional fraction, or a 0x hex number, followed by an
// optional suffix b/B (bytes) or k, M, G, T, P, E in either case (powers
// of 1024). A fraction needs a suffix
// ("1.5G"); the result is rounded to the nearest byte, halves up. The
// error is ErrSizeSyntax or ErrSizeRange.
func ParseSize(s string) (uint64, error) {
	i := 0
	for i < len(s) && isSpace(s[i]) {
		i++
	}
	start := i
	if i < len(s) && (s[i] == '+' || s[i] == '-') {
		if s[i] == '-' {
			return 0, ErrSizeSyntax
		}
		i++
	}
	val, end, err := parseUint(s, i, 10)
	if err != nil {
		return 0, err
	}
	var valf uint64
	switch {
	case val == 0 && end < len(s) && (s[end] == 'x' || s[end] == 'X'):
		// Looks like hex: reparse, and insist on no fraction.
		j := start
		if s[j] == '+' {
			j++
		}
		val, end, err = parseUint(s, j+2, 16)
		if err != nil {
			return 0, err
		}
		if end < len(s) && s[end] == '.' {
			return 0, ErrSizeSyntax
		}
	case end < len(s) && s[end] == '.':
		frac, fend, ok, err := parseFraction(s, end)
		switch {
		case err != nil:
			return 0, err
		case !ok:
			// "1.k": a dot without digits is allowed.
			end++
		default:
			end = fend
			if v := frac * 0x1p64; v < 0x1p64 {
				valf = uint64(v)
			}
			// A fraction that rounds to 1.0 converts to 0 on the x86
			// hosts QEMU runs on; do the same.
		}
	}
	// QEMU 7.2 accepts a suffix on hex numbers with a deprecation
	// warning; ovis accepts it silently.
	mul := uint64(1)
	if end < len(s) {
		if m := suffixMul(s[end]); m > 0 {
			mul = m
			end++
		}
	}
	if end != len(s) {
		return 0, ErrSizeSyntax
	}
	if mul == 1 {
		if valf != 0 {
			return 0, ErrSizeSyntax
		}
		return val, nil
	}
	// Exact 64.64 x 64.0 fixed-point product, rounding 0.5 up.
	hi, lo := bits.Mul64(val, mul)
	fhi, flo := bits.Mul64(valf, mul)
	lo, c := bits.Add64(lo, fhi, 0)
	hi += c
	lo, c = bits.Add64(lo, flo>>63, 0)
	hi += c
	if hi != 0 {
		return 0, ErrSizeRange
	}
	return lo, nil
}

func isSpace(c byte) bool {
	return c == ' ' || c == '\t' || c == '\n' || c == '\v' || c == '\f' || c == '\r'
}

// parseUint parses digits of base from s[i:] like strtoull, returning the
// value and the index after the digits. No digits is ErrSizeSyntax.
func parseUint(s string, i, base int) (uint64, int, error) {
	j := i
	for j < len(s) && digitVal(s[j]) < base {
		j++
	}
	if j == i {
		return 0, i, ErrSizeSyntax
	}
	v, err := strconv.ParseUint(s[i:j], base, 64)
	if err != nil {
		return 0, j, ErrSizeRange
	}
	return v, j, nil
}

func digitVal(c byte) int {
	switch {
	case c >= '0' && c <= '9':
		return int(c - '0')
	case c >= 'a' && c <= 'f':
		return int(c-'a') + 10
	case c >= 'A' && c <= 'F':
		return int(c-'A') + 10
	}
	return 99
}

// parseFraction parses the fraction strtod would read at s[i:], which
// starts with '.'. It returns ok=false for a dot without digits (QEMU then
// skips the dot: "1.k" is 1 KiB) and err for a fraction with an exponent
// ("1.5e3k"), which QEMU rejects.
func parseFraction(s string, i int) (frac float64, end int, ok bool, err error) {
	j := i + 1
	for j < len(s) && s[j] >= '0' && s[j] <= '9' {
		j++
	}
	if j == i+1 {
		return 0, i, false, nil
	}
	if j < len(s) && (s[j] == 'e' || s[j] == 'E') {
		k := j + 1
		if k < len(s) && (s[k] == '+' || s[k] == '-') {
			k++
		}
		if k < len(s) && s[k] >= '0' && s[k] <= '9' {
			return 0, i, false, ErrSizeSyntax
		}
	}
	f, perr := strconv.ParseFloat("0"+s[i:j], 64)
	if perr != nil {
		return 0, i, false, ErrSizeSyntax
	}
	return f, j, true, nil
}

func suffixMul(c byte) uint64 {
	switch c {
	case 'b', 'B':
		return 1
	case 'k', 'K':
		return 1 << 10
	case 'm', 'M':
		return 1 << 20
	case 'g', 'G':
		return 1 << 30
	case 't', 'T':
		return 1 << 40
	case 'p', 'P':
		return 1 << 50
	case 'e', 'E':
		return 1 << 60
	}
	return 0
}
