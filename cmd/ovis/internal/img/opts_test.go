package img

import (
	"fmt"
	"strings"
	"testing"
)

func TestSplitOptions(t *testing.T) {
	tests := []struct {
		in   string
		want string
	}{
		{"a=1", "[{a 1}]"},
		{"a=1,b=2", "[{a 1} {b 2}]"},
		{"backing_file=a,,b,backing_fmt=raw", "[{backing_file a,b} {backing_fmt raw}]"},
		{"a=1,,,b=2", "[{a 1,} {b 2}]"},
		{"a=x,,", "[{a x,}]"},
		{"lazy_refcounts", "[{lazy_refcounts on}]"},
		{"nolazy_refcounts", "[{lazy_refcounts off}]"},
		{"help", "[{help on}]"},
		{"=4k", "[{ 4k}]"},
		{"a=", "[{a }]"},
		{"a=b=c", "[{a b=c}]"},
	}
	for _, tt := range tests {
		if got := fmt.Sprint(splitOptions(tt.in)); got != tt.want {
			t.Errorf("splitOptions(%q) = %s, want %s", tt.in, got, tt.want)
		}
	}
}

func TestValidOptionList(t *testing.T) {
	for s, want := range map[string]bool{
		"a=1":      true,
		"a=1,,":    true,
		"a=1,":     false,
		"a=1,,,":   false,
		",a=1":     false,
		"":         false,
		"a=1,b=2":  true,
		"a=1,,b=2": true,
	} {
		if got := validOptionList(s); got != want {
			t.Errorf("validOptionList(%q) = %v, want %v", s, got, want)
		}
	}
}

func TestHasHelpOption(t *testing.T) {
	for s, want := range map[string]bool{
		"help":                 true,
		"?":                    true,
		"compat=0.10,help":     true,
		"compat=help":          false,
		"backing_file=a,,help": false,
	} {
		if got := hasHelpOption(s); got != want {
			t.Errorf("hasHelpOption(%q) = %v, want %v", s, got, want)
		}
	}
}

// The expected lines were printed by qemu-img 7.2 create.
func TestOptsPrint(t *testing.T) {
	tests := []struct {
		opts string
		want string
	}{
		{"", "cluster_size=65536 extended_l2=off compression_type=zlib size=1073741824 lazy_refcounts=off refcount_bits=16"},
		{"compat=0.10", "cluster_size=65536 extended_l2=off compression_type=zlib size=1073741824 compat=0.10 lazy_refcounts=off refcount_bits=16"},
		{"cluster_size=4k,refcount_bits=010,lazy_refcounts=yes", "cluster_size=4096 extended_l2=off compression_type=zlib size=1073741824 lazy_refcounts=yes refcount_bits=8"},
		{"compat=1.1,backing_file=base.raw,backing_fmt=raw,cluster_size=4k,lazy_refcounts=yes,refcount_bits=64,extended_l2=off,compression_type=zstd,preallocation=off",
			"cluster_size=4096 extended_l2=off preallocation=off compression_type=zstd size=1073741824 compat=1.1 backing_file=base.raw backing_fmt=raw lazy_refcounts=yes refcount_bits=64"},
		{"data_file=x.data,data_file_raw=true,preallocation=full,compat=v3",
			"cluster_size=65536 extended_l2=off preallocation=full compression_type=zlib size=1073741824 compat=v3 data_file=x.data data_file_raw=true lazy_refcounts=off refcount_bits=16"},
		{"backing_file=a,,b", "cluster_size=65536 extended_l2=off compression_type=zlib size=1073741824 backing_file=a,,b lazy_refcounts=off refcount_bits=16"},
	}
	for _, tt := range tests {
		o, err := parseOptions(qcow2CreateOpts, tt.opts)
		if err != nil {
			t.Fatalf("parseOptions(%q): %v", tt.opts, err)
		}
		o.setNumber(optKeySize, 1<<30)
		if got := o.print(); got != tt.want {
			t.Errorf("-o %s:\n got %s\nwant %s", tt.opts, got, tt.want)
		}
	}
}

func TestParseOptionsErrors(t *testing.T) {
	tests := []struct{ opts, err string }{
		{"foo=bar", "Invalid parameter 'foo'"},
		{"=4k", "Invalid parameter ''"},
		{"lazy_refcounts=maybe", "Parameter 'lazy_refcounts' expects 'on' or 'off'"},
		{"refcount_bits=abc", "Parameter 'refcount_bits' expects a number"},
		{"cluster_size=abc", "Parameter 'cluster_size' expects a non-negative number below 2^64"},
		{"cluster_size", "Parameter 'cluster_size' expects a non-negative number below 2^64"},
	}
	for _, tt := range tests {
		_, err := parseOptions(qcow2CreateOpts, tt.opts)
		if err == nil || !strings.HasPrefix(err.Error(), tt.err) {
			t.Errorf("parseOptions(%q) = %v, want %q", tt.opts, err, tt.err)
		}
	}
}

func TestCombinePath(t *testing.T) {
	tests := []struct{ image, name, want string }{
		{"top.qcow2", "base.qcow2", "base.qcow2"},
		{"sub/t.qcow2", "../base.qcow2", "sub/../base.qcow2"},
		{"./../sub/t.qcow2", "../base.qcow2", "./../sub/../base.qcow2"},
		{"/tmp/q/top.qcow2", "base.qcow2", "/tmp/q/base.qcow2"},
		{"sub/t.qcow2", "/abs/base", "/abs/base"},
	}
	for _, tt := range tests {
		if got := combinePath(tt.image, tt.name); got != tt.want {
			t.Errorf("combinePath(%q, %q) = %q, want %q", tt.image, tt.name, got, tt.want)
		}
	}
}
