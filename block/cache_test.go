package block

import "testing"

func TestParseCacheMode(t *testing.T) {
	tests := []struct {
		in                         string
		want                       CacheMode
		wce, direct, ignoreFlushes bool
	}{
		{"writeback", CacheWriteback, true, false, false},
		{"writethrough", CacheWritethrough, false, false, false},
		{"none", CacheNone, true, true, false},
		{"off", CacheNone, true, true, false},
		{"directsync", CacheDirectSync, false, true, false},
		{"unsafe", CacheUnsafe, true, false, true},
	}
	for _, tt := range tests {
		t.Run(tt.in, func(t *testing.T) {
			m, err := ParseCacheMode(tt.in)
			if err != nil {
				t.Fatal(err)
			}
			if m != tt.want {
				t.Fatalf("ParseCacheMode(%q) = %v, want %v", tt.in, m, tt.want)
			}
			if m.WriteCache() != tt.wce || m.Direct() != tt.direct || m.IgnoreFlush() != tt.ignoreFlushes {
				t.Errorf("%v: WriteCache=%v Direct=%v IgnoreFlush=%v, want %v %v %v",
					m, m.WriteCache(), m.Direct(), m.IgnoreFlush(), tt.wce, tt.direct, tt.ignoreFlushes)
			}
			if tt.in != "off" && m.String() != tt.in {
				t.Errorf("String() = %q, want %q", m.String(), tt.in)
			}
		})
	}
}

func TestParseCacheModeInvalid(t *testing.T) {
	for _, s := range []string{"", "WriteBack", "direct", "sync"} {
		if _, err := ParseCacheMode(s); err == nil {
			t.Errorf("ParseCacheMode(%q) succeeded", s)
		}
	}
}

func TestCacheModeSet(t *testing.T) {
	var m CacheMode
	if m != CacheWriteback {
		t.Fatalf("zero value is %v, want writeback", m)
	}
	if err := m.Set("directsync"); err != nil || m != CacheDirectSync {
		t.Fatalf("Set(directsync) = %v, mode %v", err, m)
	}
	if err := m.Set("bogus"); err == nil || m != CacheDirectSync {
		t.Fatalf("Set(bogus) = %v, mode %v; want error and unchanged mode", err, m)
	}
	if m.Type() != "cache" {
		t.Errorf("Type() = %q", m.Type())
	}
}
