package serve

import (
	"strings"
	"testing"
)

func TestValidate(t *testing.T) {
	for _, tc := range []struct {
		cfg  Config
		want string
	}{
		{Config{}, "no image file"},
		{Config{File: "x", Format: "vmdk"}, "Unknown driver 'vmdk'"},
		{Config{File: "x", Socket: "rel.sock"}, "socket path must be absolute"},
		{Config{File: "x", Shared: -1}, "Invalid shared device number '-1'"},
		{Config{File: "x", DetectZeroes: DetectZeroesUnmap}, "not allowed without setting discard operation to unmap"},
		{Config{File: "x", TLSKey: "k"}, "must be given together"},
		{Config{File: "x", TLSCA: "ca"}, "--tls-ca needs"},
		{Config{File: "x", L2CachePolicy: "mru"}, "Invalid l2-cache-policy 'mru'"},
		{Config{File: "x", CacheSize: -1}, "cache-size -1"},
		{Config{File: "x", ExportName: strings.Repeat("a", 4097)}, "too long"},
	} {
		err := tc.cfg.Validate()
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("Validate(%+v) = %v, want %q", tc.cfg, err, tc.want)
		}
	}
	ok := Config{File: "x", Discard: DiscardUnmap, DetectZeroes: DetectZeroesUnmap, Shared: 0, Socket: "/s"}
	if err := ok.Validate(); err != nil {
		t.Errorf("Validate(%+v) = %v", ok, err)
	}
}

func TestParse(t *testing.T) {
	for s, want := range map[string]Discard{"ignore": DiscardIgnore, "off": DiscardIgnore, "unmap": DiscardUnmap, "on": DiscardUnmap} {
		if got, err := ParseDiscard(s); got != want || err != nil {
			t.Errorf("ParseDiscard(%q) = %v, %v", s, got, err)
		}
	}
	if _, err := ParseDiscard("trim"); err == nil || err.Error() != "Invalid discard mode `trim'" {
		t.Errorf("ParseDiscard(trim): %v", err)
	}
	for s, want := range map[string]DetectZeroes{"off": DetectZeroesOff, "on": DetectZeroesOn, "unmap": DetectZeroesUnmap} {
		if got, err := ParseDetectZeroes(s); got != want || err != nil {
			t.Errorf("ParseDetectZeroes(%q) = %v, %v", s, got, err)
		}
	}
	if _, err := ParseCacheMode("fast"); err == nil || err.Error() != "Invalid cache mode `fast'" {
		t.Errorf("ParseCacheMode(fast): %v", err)
	}
}
