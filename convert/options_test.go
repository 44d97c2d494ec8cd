package convert

import (
	"strings"
	"testing"
)

// TestOptionsValidate names the bad value of each option out of bounds
// and accepts the zero value and the bounds themselves.
func TestOptionsValidate(t *testing.T) {
	tests := []struct {
		name string
		o    Options
		want string // "" for valid
	}{
		{"zero value", Options{}, ""},
		{"most workers", Options{Workers: MaxWorkers}, ""},
		{"too many workers", Options{Workers: MaxWorkers + 1}, "Workers 17"},
		{"negative workers", Options{Workers: -1}, "Workers -1"},
		{"no zero detection", Options{MinSparse: -1}, ""},
		{"largest sparse", Options{MinSparse: MaxMinSparse}, ""},
		{"unaligned sparse", Options{MinSparse: 1000}, "MinSparse 1000"},
		{"sparse too large", Options{MinSparse: MaxMinSparse + 512}, "MinSparse 16777728"},
		{"negative rate", Options{RateLimit: -5}, "RateLimit -5"},
		{"negative backing end", Options{BackingEnd: -1, HasBackingEnd: true}, "BackingEnd -1"},
		{"backing end unused", Options{BackingEnd: -1}, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.o.Validate()
			if tt.want == "" {
				if err != nil {
					t.Fatalf("Validate() = %v, want nil", err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("Validate() = %v, want an error naming %q", err, tt.want)
			}
		})
	}
}

// TestOptionsDefaults checks what the zero values stand for.
func TestOptionsDefaults(t *testing.T) {
	var o Options
	if got := o.workers(); got != DefaultWorkers {
		t.Errorf("workers() = %d, want %d", got, DefaultWorkers)
	}
	if got := o.minSparse(); got != DefaultMinSparse {
		t.Errorf("minSparse() = %d, want %d", got, DefaultMinSparse)
	}
	o.MinSparse = -1
	if got := o.minSparse(); got != 0 {
		t.Errorf("minSparse() with detection off = %d, want 0", got)
	}
}
