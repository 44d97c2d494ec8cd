package image

import (
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/ovis-storage/ovis/block"
)

// Opts is an image named the way QEMU's --image-opts names one: an option
// list ("driver=qcow2,file.filename=disk.qcow2,l2-cache-size=1M") in place
// of a file name. ParseOpts makes one; Apply turns it into the Options to
// open Filename with.
type Opts struct {
	// Spec is the list as given; QEMU names the image by it in errors.
	Spec string
	// Driver is a registered format ("qcow2", "raw"), or "" to probe the
	// file.
	Driver string
	// Filename is file.filename, never "" in what ParseOpts returns.
	Filename string
	// Cache is the cache mode that cache.direct and cache.no-flush give,
	// when HasCache; block.CacheWriteback when neither is given.
	Cache    block.CacheMode
	HasCache bool
	// ReadOnly is read-only=on; ForceShare force-share=on; NoLock
	// file.locking=off.
	ReadOnly, ForceShare, NoLock bool
	// The qcow2 cache options, 0 when not given.
	L2CacheSize, L2CacheEntrySize, RefcountCacheSize, CacheSize int64
	// CacheCleanInterval is cache-clean-interval in seconds, -1 when not
	// given.
	CacheCleanInterval int
	// FileProtocol is set for a json: name whose top driver is the file
	// protocol, which ovis reads as a raw image. ParseOpts leaves it
	// false.
	FileProtocol bool
	// Discard and DetectZeroes are the discard and detect-zeroes options,
	// "" when not given: an NBD export uses them, an offline tool ignores
	// them. They are not checked here.
	Discard, DetectZeroes string
}

// The errors an OptError carries: what is wrong with the option.
var (
	// ErrUnknownDriver: driver or file.driver names a format or protocol
	// ovis does not have (Value).
	ErrUnknownDriver = errors.New("unknown driver")
	// ErrNodeName: file names a block node instead of holding options;
	// ovis has no block graph to find it in.
	ErrNodeName = errors.New("node names are not supported")
	// ErrOptUnsupported: the driver or protocol (OptError.Driver) has no
	// such option.
	ErrOptUnsupported = errors.New("option not supported")
	// ErrOptBool: the value is not on, off, yes, no, true, false, y or n.
	ErrOptBool = errors.New("want on or off")
	// ErrOptSize: the value is not a size (ParseSize) of at most 2^62.
	ErrOptSize = errors.New("want a size of at most 2^62")
	// ErrOptNumber: the value is not a decimal number below 2^31.
	ErrOptNumber = errors.New("want a number below 2^31")
	// ErrOptValue: the value is none the option takes.
	ErrOptValue = errors.New("value not accepted")
	// ErrNoFilename: the list names no file (file.filename).
	ErrNoFilename = errors.New("no file.filename")
	// ErrOptConflict: the option cannot be combined with one given
	// before it (cache.direct=on with cache.no-flush=on).
	ErrOptConflict = errors.New("conflicting options")
)

// OptError is what is wrong with an option list: the error type of
// ParseOpts and ParseSnapshot.
type OptError struct {
	// Spec is the list.
	Spec string
	// Name is the option at fault as the list spells it ("driver",
	// "file.locking"), "" when the list as a whole is at fault.
	Name string
	// Value is the option's value.
	Value string
	// Driver is the list's driver ("" when not given) for ErrNoFilename,
	// and the driver or protocol that has no option Name for
	// ErrOptUnsupported: a format ("qcow2" when the format is probed),
	// "file", or "snapshot" for ParseSnapshot.
	Driver string
	// Err is one of the ErrOpt…, ErrUnknownDriver, ErrNodeName and
	// ErrNoFilename errors.
	Err error
}

func (e *OptError) Error() string {
	if e.Name == "" {
		return fmt.Sprintf("image: option list %q: %v", e.Spec, e.Err)
	}
	return fmt.Sprintf("image: option list %q: %s=%s: %v", e.Spec, e.Name, e.Value, e.Err)
}

func (e *OptError) Unwrap() error { return e.Err }

// optKind is how an option's value is parsed.
type optKind int

const (
	kindString optKind = iota
	kindBool
	kindSize
	kindNumber
	kindIgnored // accepted and without effect in ovis
)

// The options ovis takes: the generic block options, qcow2's runtime
// options and the file protocol's ("file." prefixed). The other options
// QEMU knows are refused as QEMU refuses unknown ones.
var (
	blockOpts = map[string]optKind{
		"driver": kindString, "read-only": kindBool, "force-share": kindBool,
		"cache.direct": kindBool, "cache.no-flush": kindBool,
		"discard": kindString, "detect-zeroes": kindString,
		"node-name": kindIgnored, "auto-read-only": kindIgnored,
	}
	qcow2Opts = map[string]optKind{
		"l2-cache-size": kindSize, "l2-cache-entry-size": kindSize,
		"refcount-cache-size": kindSize, "cache-size": kindSize,
		"cache-clean-interval": kindNumber,
	}
	fileOpts = map[string]optKind{
		"driver": kindString, "filename": kindString, "locking": kindString,
		"aio": kindIgnored, "aio-max-batch": kindIgnored, "drop-cache": kindIgnored,
	}
)

// ParseOpts parses an option list as QEMU's --image-opts does: name=value
// pairs split at commas, ",," standing for a comma inside a value, a bare
// name meaning name=on and a bare "noname" name=off; the last of
// repeated names wins. driver must be a registered format or absent;
// the qcow2 options are taken when it is qcow2 or absent, and the file
// options with a "file." prefix. The error is an *OptError; the options
// are checked in the order they were first given.
func ParseOpts(spec string) (*Opts, error) {
	o := &Opts{Spec: spec, CacheCleanInterval: -1}
	fail := func(name, value string, err error) (*Opts, error) {
		return nil, &OptError{Spec: spec, Name: name, Value: value, Err: err}
	}
	vals := map[string]string{}
	var order []string
	for _, p := range SplitOpts(spec) {
		if p.Name == "" {
			continue
		}
		if _, dup := vals[p.Name]; !dup {
			order = append(order, p.Name)
		}
		vals[p.Name] = p.Value // the last one wins, as in QemuOpts
	}
	o.Driver = vals["driver"]
	if _, ok := Lookup(o.Driver); o.Driver != "" && !ok {
		return fail("driver", o.Driver, ErrUnknownDriver)
	}
	if d, ok := vals["file.driver"]; ok && d != "file" {
		return fail("file.driver", d, ErrUnknownDriver)
	}
	if f, ok := vals["file"]; ok {
		return fail("file", f, ErrNodeName)
	}
	var direct, noFlush bool
	for _, name := range order {
		v := vals[name]
		kind, driver, ok := optKindOf(o.Driver, name)
		if !ok {
			return nil, &OptError{Spec: spec, Name: name, Value: v, Driver: driver, Err: ErrOptUnsupported}
		}
		var b bool
		var n int64
		switch kind {
		case kindBool:
			switch v {
			case "on", "yes", "true", "y":
				b = true
			case "off", "no", "false", "n":
			default:
				return fail(name, v, ErrOptBool)
			}
		case kindSize:
			u, err := ParseSize(v)
			if err != nil || u > 1<<62 {
				return fail(name, v, ErrOptSize)
			}
			n = int64(u)
		case kindNumber:
			u, err := strconv.ParseUint(v, 10, 31)
			if err != nil {
				return fail(name, v, ErrOptNumber)
			}
			n = int64(u)
		}
		switch name {
		case "read-only":
			o.ReadOnly = b
		case "force-share":
			o.ForceShare = b
		case "cache.direct":
			direct, o.HasCache = b, true
		case "cache.no-flush":
			noFlush, o.HasCache = b, true
		case "discard":
			o.Discard = v
		case "detect-zeroes":
			o.DetectZeroes = v
		case "l2-cache-size":
			o.L2CacheSize = n
		case "l2-cache-entry-size":
			o.L2CacheEntrySize = n
		case "refcount-cache-size":
			o.RefcountCacheSize = n
		case "cache-size":
			o.CacheSize = n
		case "cache-clean-interval":
			o.CacheCleanInterval = int(n)
		case "file.filename":
			o.Filename = v
		case "file.locking":
			switch v {
			case "on", "auto":
			case "off":
				o.NoLock = true
			default:
				return fail(name, v, ErrOptValue)
			}
		}
	}
	if o.Filename == "" {
		return nil, &OptError{Spec: spec, Driver: o.Driver, Err: ErrNoFilename}
	}
	switch {
	case direct && noFlush:
		return fail("cache.no-flush", "on", ErrOptConflict)
	case noFlush:
		o.Cache = block.CacheUnsafe
	case direct:
		o.Cache = block.CacheNone
	default:
		o.Cache = block.CacheWriteback
	}
	return o, nil
}

// optKindOf returns how the option name of a list whose driver is driver
// is parsed, or the driver or protocol that has no such option.
func optKindOf(driver, name string) (optKind, string, bool) {
	if rest, ok := strings.CutPrefix(name, "file."); ok {
		k, ok := fileOpts[rest]
		return k, "file", ok
	}
	if k, ok := blockOpts[name]; ok {
		return k, driver, true
	}
	if driver == "" || driver == "qcow2" {
		k, ok := qcow2Opts[name]
		return k, "qcow2", ok
	}
	return 0, driver, false
}

// Apply returns o with the list's options set: read-only, force-share
// and file.locking=off are added to o's, the cache sizes and interval
// given replace o's, and a cache mode given replaces o.OpenFile.
func (l *Opts) Apply(o Options) Options {
	o.ReadOnly = o.ReadOnly || l.ReadOnly
	o.ForceShare = o.ForceShare || l.ForceShare
	o.NoLock = o.NoLock || l.NoLock
	for _, s := range []struct {
		dst *int64
		v   int64
	}{
		{&o.L2CacheSize, l.L2CacheSize}, {&o.L2CacheEntrySize, l.L2CacheEntrySize},
		{&o.RefcountCacheSize, l.RefcountCacheSize}, {&o.CacheSize, l.CacheSize},
	} {
		if s.v != 0 {
			*s.dst = s.v
		}
	}
	if l.CacheCleanInterval >= 0 {
		o.CacheCleanInterval = l.CacheCleanInterval
	}
	if l.HasCache {
		o.OpenFile = block.OpenFileFor(l.Cache)
	}
	return o
}

// Opt is one name=value pair of an option list.
type Opt struct {
	Name, Value string
}

// SplitOpts splits an option list as QEMU's QemuOpts parser does: pairs
// are separated by commas, a value runs to the next single comma (",,"
// is a comma inside it), a name without "=" is name=on, or, when it
// starts with "no", the rest of it =off. Empty names are kept. The
// caller owns the slice.
func SplitOpts(list string) []Opt {
	var out []Opt
	for p := 0; p < len(list); {
		n := strings.IndexAny(list[p:], "=,")
		if n < 0 {
			n = len(list) - p
		}
		name := list[p : p+n]
		p += n
		if p >= len(list) || list[p] == ',' {
			value := "on"
			if strings.HasPrefix(name, "no") {
				name, value = name[2:], "off"
			}
			out = append(out, Opt{name, value})
			p++
			continue
		}
		p++ // '='
		var value strings.Builder
		for {
			c := strings.IndexByte(list[p:], ',')
			if c < 0 {
				value.WriteString(list[p:])
				p = len(list)
				break
			}
			value.WriteString(list[p : p+c])
			p += c
			if p+1 < len(list) && list[p+1] == ',' {
				value.WriteByte(',')
				p += 2
				continue
			}
			p++ // the separator
			break
		}
		out = append(out, Opt{name, value.String()})
	}
	return out
}
