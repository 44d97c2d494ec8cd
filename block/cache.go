package block

import "fmt"

// CacheMode is one of QEMU's -drive cache= modes. Each is a combination of
// three switches:
//
//	mode          WriteCache  Direct  IgnoreFlush
//	writeback     on          off     off
//	writethrough  off         off     off
//	none          on          on      off
//	directsync    off         on      off
//	unsafe        on          off     on
//
// The zero value is CacheWriteback, QEMU's default. CacheMode implements
// the flag.Value and pflag.Value interfaces.
type CacheMode uint8

// The cache modes, named as QEMU names them.
const (
	CacheWriteback CacheMode = iota
	CacheWritethrough
	CacheNone
	CacheDirectSync
	CacheUnsafe
)

var cacheModeNames = [...]string{
	CacheWriteback:    "writeback",
	CacheWritethrough: "writethrough",
	CacheNone:         "none",
	CacheDirectSync:   "directsync",
	CacheUnsafe:       "unsafe",
}

// ParseCacheMode parses QEMU's names for the cache modes: writeback,
// writethrough, none (or its alias off), directsync and unsafe. Any other
// name is an error that quotes it.
func ParseCacheMode(s string) (CacheMode, error) {
	if s == "off" {
		return CacheNone, nil
	}
	for m, name := range cacheModeNames {
		if s == name {
			return CacheMode(m), nil
		}
	}
	return 0, fmt.Errorf("block: invalid cache mode %q (want writeback, writethrough, none, directsync or unsafe)", s)
}

// String returns QEMU's name for the mode.
func (m CacheMode) String() string {
	if int(m) < len(cacheModeNames) {
		return cacheModeNames[m]
	}
	return fmt.Sprintf("CacheMode(%d)", uint8(m))
}

// WriteCache reports whether the guest sees a volatile write cache (WCE):
// writes may be lost until a flush, and the guest is expected to flush.
// When false every write is made durable before it completes (FUA).
func (m CacheMode) WriteCache() bool {
	return m == CacheWriteback || m == CacheNone || m == CacheUnsafe
}

// Direct reports whether the host page cache is bypassed (O_DIRECT).
func (m CacheMode) Direct() bool {
	return m == CacheNone || m == CacheDirectSync
}

// IgnoreFlush reports whether flushes are dropped (cache.no-flush): data
// may be lost on a host crash.
func (m CacheMode) IgnoreFlush() bool { return m == CacheUnsafe }

// Set parses s into m, for flag parsing.
func (m *CacheMode) Set(s string) error {
	v, err := ParseCacheMode(s)
	if err != nil {
		return err
	}
	*m = v
	return nil
}

// Type names the flag's value type in help text.
func (m *CacheMode) Type() string { return "cache" }
