package img

import (
	"errors"
	"testing"
)

// The expected values were printed by qemu-img 7.2 (qemu-img create -f raw
// x SIZE, which prints the parsed size in its Formatting line).
func TestParseSize(t *testing.T) {
	tests := []struct {
		in   string
		want uint64
		err  error
	}{
		{"0", 0, nil},
		{"512", 512, nil},
		{"1b", 1, nil},
		{"1B", 1, nil},
		{"1k", 1024, nil},
		{"1K", 1024, nil},
		{"1m", 1 << 20, nil},
		{"1M", 1 << 20, nil},
		{"1g", 1 << 30, nil},
		{"1G", 1 << 30, nil},
		{"1t", 1 << 40, nil},
		{"1T", 1 << 40, nil},
		{"1p", 1 << 50, nil},
		{"1e", 1 << 60, nil},
		{"7E", 7 << 60, nil},
		{"1.5G", 3 << 29, nil},
		{"1.5k", 1536, nil},
		{"1.3k", 1331, nil},
		{"0.5k", 512, nil},
		{"1.k", 1024, nil},
		{"1.0", 1, nil},
		{"7.9E", 9108079886394091136, nil},
		{"1.9999999999999999999999k", 1024, nil},
		{"1.00000000000000000001", 1, nil},
		{"0x10", 16, nil},
		{"0x10k", 16384, nil},
		{" 1k", 1024, nil},
		{"16E", 0, errSizeRange},
		{"18446744073709551616", 0, errSizeRange},
		{"1.5", 0, errSizeSyntax},
		{"0.5", 0, errSizeSyntax},
		{"1e3", 0, errSizeSyntax},
		{"1.5e3k", 0, errSizeSyntax},
		{"", 0, errSizeSyntax},
		{"k", 0, errSizeSyntax},
		{"1kb", 0, errSizeSyntax},
		{"1X", 0, errSizeSyntax},
		{"-5", 0, errSizeSyntax},
		{"0x", 0, errSizeSyntax},
		{"0x1.5k", 0, errSizeSyntax},
	}
	for _, tt := range tests {
		got, err := ParseSize(tt.in)
		if !errors.Is(err, tt.err) || (err == nil && got != tt.want) {
			t.Errorf("ParseSize(%q) = %d, %v; want %d, %v", tt.in, got, err, tt.want, tt.err)
		}
	}
}

func TestCvtnum(t *testing.T) {
	tests := []struct{ in, err string }{
		{"1X", "Invalid image size specified. You may use k, M, G, T, P or E suffixes for\nkilobytes, megabytes, gigabytes, terabytes, petabytes and exabytes."},
		{"8E", "Invalid image size specified. Must be between 0 and 9223372036854775807."},
		{"16E", "Invalid image size specified. Must be between 0 and 9223372036854775807."},
	}
	for _, tt := range tests {
		if _, err := cvtnum("image size", tt.in, 1<<63-1); err == nil || err.Error() != tt.err {
			t.Errorf("cvtnum(%q) = %v, want %q", tt.in, err, tt.err)
		}
	}
	if v, err := cvtnum("image size", "1G", 1<<63-1); err != nil || v != 1<<30 {
		t.Errorf("cvtnum(1G) = %d, %v", v, err)
	}
}

// The expected strings are qemu-img info's "virtual size" and "disk size".
func TestFormatSize(t *testing.T) {
	tests := []struct {
		in   uint64
		want string
	}{
		{0, "0 B"},
		{1, "1 B"},
		{999, "999 B"},
		{1000, "0.977 KiB"},
		{1536, "1.5 KiB"},
		{4096, "4 KiB"},
		{196608, "192 KiB"},
		{200704, "196 KiB"},
		{348160, "340 KiB"},
		{1314816, "1.25 MiB"},
		{8392704, "8 MiB"},
		{10485760, "10 MiB"},
		{1073741824, "1 GiB"},
		{1610612736, "1.5 GiB"},
		{1 << 40, "1 TiB"},
		{3 << 40, "3 TiB"},
		{1 << 50, "1 PiB"},
		{1 << 60, "1 EiB"},
		{1<<63 - 1, "8 EiB"},
	}
	for _, tt := range tests {
		if got := FormatSize(tt.in); got != tt.want {
			t.Errorf("FormatSize(%d) = %q, want %q", tt.in, got, tt.want)
		}
	}
}
