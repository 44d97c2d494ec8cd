package image

import (
	"errors"
	"fmt"
	"math/bits"
	"strconv"
	"testing"

	"pgregory.net/rapid"
)

func TestParseSize(t *testing.T) {
	tests := []struct {
		in   string
		want uint64
		err  error
	}{
		{"0", 0, nil},
		{"512", 512, nil},
		{"1k", 1 << 10, nil},
		{"1.5M", 3 << 19, nil},
		{" +2G", 2 << 30, nil},
		{"0x10", 16, nil},
		{"1.k", 1 << 10, nil},
		{"15E", 15 << 60, nil},
		{"16E", 0, ErrSizeRange},
		{"18446744073709551616", 0, ErrSizeRange},
		{"1.5", 0, ErrSizeSyntax},
		{"1e3", 0, ErrSizeSyntax},
		{"", 0, ErrSizeSyntax},
		{"-5", 0, ErrSizeSyntax},
		{"1kb", 0, ErrSizeSyntax},
		{"0x1.5k", 0, ErrSizeSyntax},
	}
	for _, tt := range tests {
		got, err := ParseSize(tt.in)
		if got != tt.want || !errors.Is(err, tt.err) || (tt.err == nil) != (err == nil) {
			t.Errorf("ParseSize(%q) = %d, %v, want %d, %v", tt.in, got, err, tt.want, tt.err)
		}
	}
}

// TestParseSizeModel: a whole number with a suffix is the number times
// the suffix's power of 1024, or ErrSizeRange past 64 bits.
func TestParseSizeModel(t *testing.T) {
	suffixes := []struct {
		s     string
		shift uint
	}{{"", 0}, {"b", 0}, {"B", 0}, {"k", 10}, {"K", 10}, {"M", 20}, {"g", 30}, {"T", 40}, {"p", 50}, {"E", 60}}
	rapid.Check(t, func(t *rapid.T) {
		n := rapid.Uint64().Draw(t, "n")
		if rapid.Bool().Draw(t, "small") {
			n %= 1 << 20
		}
		suf := rapid.SampledFrom(suffixes).Draw(t, "suffix")
		got, err := ParseSize(strconv.FormatUint(n, 10) + suf.s)
		hi, lo := bits.Mul64(n, 1<<suf.shift)
		switch {
		case hi != 0:
			if !errors.Is(err, ErrSizeRange) {
				t.Fatalf("%d%s = %d, %v, want ErrSizeRange", n, suf.s, got, err)
			}
		case err != nil || got != lo:
			t.Fatalf("%d%s = %d, %v, want %d", n, suf.s, got, err, lo)
		}
	})
}

// FuzzParseSize: any string parses or fails with one of the two errors;
// plain decimal numbers parse as strconv parses them.
func FuzzParseSize(f *testing.F) {
	for _, s := range []string{"1", "1.5G", "0x1f", " +3k", "1.k", "16E", "9.99999999999999999999E"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		v, err := ParseSize(s)
		if err != nil && !errors.Is(err, ErrSizeSyntax) && !errors.Is(err, ErrSizeRange) {
			t.Fatalf("%q: unexpected error %v", s, err)
		}
		if u, perr := strconv.ParseUint(s, 10, 64); perr == nil && (err != nil || v != u) {
			t.Fatalf("%q = %d, %v, want %d", s, v, err, u)
		}
		if err == nil {
			if w, err := ParseSize(fmt.Sprint(v)); err != nil || w != v {
				t.Fatalf("%q = %d, which reparses as %d, %v", s, v, w, err)
			}
		}
	})
}
