package img

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"

	"github.com/ovis-storage/ovis/block"
	"github.com/ovis-storage/ovis/qcow2"
)

// ImageOpts is an image named the way QEMU's --image-opts names one: an
// option list ("driver=qcow2,file.filename=disk.qcow2,l2-cache-size=1M")
// in place of a file name.
type ImageOpts struct {
	// Spec is the list as given; QEMU names the image by it in errors.
	Spec string
	// Driver is "qcow2", "raw" or "" (probe the file).
	Driver string
	// Filename is file.filename.
	Filename string
	// Cache is the cache mode that cache.direct and cache.no-flush give,
	// when HasCache.
	Cache    block.CacheMode
	HasCache bool
	// ReadOnly is read-only=on; ForceShare force-share=on; NoLock
	// file.locking=off.
	ReadOnly, ForceShare, NoLock bool
	// The qcow2 cache options, 0 when not given.
	L2CacheSize, L2CacheEntrySize, RefcountCacheSize, CacheSize int64
	// CacheCleanInterval is cache-clean-interval, -1 when not given.
	CacheCleanInterval int
	// FileProtocol is a json: name whose top driver is the file
	// protocol, which ovis reads as a raw image and info names "file".
	FileProtocol bool
	// Discard and DetectZeroes are the discard and detect-zeroes options,
	// "" when not given (an NBD export uses them; qemu-img ignores them).
	Discard, DetectZeroes string
}

// imageOptKind is how an --image-opts value is parsed.
type imageOptKind int

const (
	kindString imageOptKind = iota
	kindBool
	kindSize
	kindNumber
	kindIgnored // accepted and without effect in ovis
)

// The options ovis takes: the generic block options, qcow2's runtime
// options and the file protocol's ("file." prefixed). The other options
// QEMU knows are refused as QEMU refuses unknown ones.
var (
	blockImageOpts = map[string]imageOptKind{
		"driver": kindString, "read-only": kindBool, "force-share": kindBool,
		"cache.direct": kindBool, "cache.no-flush": kindBool,
		"discard": kindString, "detect-zeroes": kindString,
		"node-name": kindIgnored, "auto-read-only": kindIgnored,
	}
	qcow2ImageOpts = map[string]imageOptKind{
		"l2-cache-size": kindSize, "l2-cache-entry-size": kindSize,
		"refcount-cache-size": kindSize, "cache-size": kindSize,
		"cache-clean-interval": kindNumber,
	}
	fileImageOpts = map[string]imageOptKind{
		"driver": kindString, "filename": kindString, "locking": kindString,
		"aio": kindIgnored, "aio-max-batch": kindIgnored, "drop-cache": kindIgnored,
	}
)

// ParseImageOpts parses an --image-opts list. Its errors are QEMU's
// reasons; callers put "Could not open 'SPEC': " before them.
func ParseImageOpts(spec string) (*ImageOpts, error) {
	io := &ImageOpts{Spec: spec, CacheCleanInterval: -1}
	vals := map[string]string{}
	var order []string
	for _, p := range splitOptions(spec) {
		if p.name == "" {
			continue
		}
		if _, dup := vals[p.name]; !dup {
			order = append(order, p.name)
		}
		vals[p.name] = p.value // the last one wins, as in QemuOpts
	}
	io.Driver = vals["driver"]
	switch io.Driver {
	case "", "qcow2", "raw":
	default:
		return nil, fmt.Errorf("Unknown driver '%s'", io.Driver)
	}
	if d, ok := vals["file.driver"]; ok && d != "file" {
		return nil, fmt.Errorf("Unknown driver '%s'", d)
	}
	if f, ok := vals["file"]; ok {
		// A node name: ovis has no block graph to find it in.
		return nil, fmt.Errorf("Cannot find device='%s' nor node-name='%s'", f, f)
	}
	var direct, noFlush bool
	for _, name := range order {
		v := vals[name]
		kind, ok := imageOptKindOf(io.Driver, name)
		if !ok {
			if rest, file := strings.CutPrefix(name, "file."); file {
				return nil, fmt.Errorf("Block protocol 'file' doesn't support the option '%s'", rest)
			}
			drv := io.Driver
			if drv == "" {
				drv = "qcow2"
			}
			return nil, fmt.Errorf("Block format '%s' does not support the option '%s'", drv, name)
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
				return nil, fmt.Errorf("Parameter '%s' expects 'on' or 'off'", name)
			}
		case kindSize:
			u, err := ParseSize(v)
			if err != nil || u > 1<<62 {
				return nil, fmt.Errorf("Parameter '%s' expects a non-negative number below 2^64\n"+
					"Optional suffix k, M, G, T, P or E means kilo-, mega-, giga-, tera-, peta-\n"+
					"and exabytes, respectively.", name)
			}
			n = int64(u)
		case kindNumber:
			u, err := strconv.ParseUint(v, 10, 31)
			if err != nil {
				return nil, fmt.Errorf("Parameter '%s' expects a number", name)
			}
			n = int64(u)
		}
		switch name {
		case "read-only":
			io.ReadOnly = b
		case "force-share":
			io.ForceShare = b
		case "cache.direct":
			direct, io.HasCache = b, true
		case "cache.no-flush":
			noFlush, io.HasCache = b, true
		case "discard":
			io.Discard = v
		case "detect-zeroes":
			io.DetectZeroes = v
		case "l2-cache-size":
			io.L2CacheSize = n
		case "l2-cache-entry-size":
			io.L2CacheEntrySize = n
		case "refcount-cache-size":
			io.RefcountCacheSize = n
		case "cache-size":
			io.CacheSize = n
		case "cache-clean-interval":
			io.CacheCleanInterval = int(n)
		case "file.filename":
			io.Filename = v
		case "file.locking":
			switch v {
			case "on", "auto":
			case "off":
				io.NoLock = true
			default:
				return nil, fmt.Errorf("Parameter 'locking' does not accept value '%s'", v)
			}
		}
	}
	if io.Filename == "" {
		if io.Driver == "" {
			return nil, errors.New("Must specify either driver or file")
		}
		return nil, errors.New(`A block device must be specified for "file"`)
	}
	switch {
	case direct && noFlush:
		return nil, errors.New("cache.direct=on together with cache.no-flush=on is not supported by ovis")
	case noFlush:
		io.Cache = block.CacheUnsafe
	case direct:
		io.Cache = block.CacheNone
	default:
		io.Cache = block.CacheWriteback
	}
	return io, nil
}

func imageOptKindOf(driver, name string) (imageOptKind, bool) {
	if rest, ok := strings.CutPrefix(name, "file."); ok {
		k, ok := fileImageOpts[rest]
		return k, ok
	}
	if k, ok := blockImageOpts[name]; ok {
		return k, true
	}
	if driver != "raw" {
		k, ok := qcow2ImageOpts[name]
		return k, ok
	}
	return 0, false
}

// Apply sets o's fields from the options.
func (io *ImageOpts) Apply(o qcow2.Options) qcow2.Options {
	o.ReadOnly = o.ReadOnly || io.ReadOnly
	o.ForceShare = o.ForceShare || io.ForceShare
	o.NoLock = o.NoLock || io.NoLock
	for _, s := range []struct {
		dst *int64
		v   int64
	}{
		{&o.L2CacheSize, io.L2CacheSize}, {&o.L2CacheEntrySize, io.L2CacheEntrySize},
		{&o.RefcountCacheSize, io.RefcountCacheSize}, {&o.CacheSize, io.CacheSize},
	} {
		if s.v != 0 {
			*s.dst = s.v
		}
	}
	if io.CacheCleanInterval >= 0 {
		o.CacheCleanInterval = io.CacheCleanInterval
	}
	if io.HasCache {
		o.OpenFile = block.OpenFileFor(io.Cache)
	}
	return o
}

// UseImageOpts parses the --image-opts list spec and returns the file and
// format it names; the verb then opens that file with its options and
// names it by spec in open errors.
func (e *Env) UseImageOpts(spec string) (filename, format string, err error) {
	io, err := ParseImageOpts(spec)
	if err != nil {
		return "", "", fmt.Errorf("Could not open '%s': %w", spec, err)
	}
	e.setImageOpts(io)
	return io.Filename, io.Driver, nil
}

// SnapshotParam is qemu-nbd's -l argument: "snapshot.id=ID,snapshot.name=
// NAME" (either may be left out), or one ID or name, which is looked up
// as an ID first.
type SnapshotParam struct {
	ID, Name string
	// IDOrName is set for the second form.
	IDOrName string
}

// ParseSnapshotParam parses a -l argument, failing with qemu-nbd's two
// lines for an option it does not know.
func ParseSnapshotParam(s string) (SnapshotParam, error) {
	return parseSnapshotParam(s, "`")
}

// parseSnapshotParam parses a snapshot parameter; quote opens the
// parameter in the parse error (qemu-nbd's is a backquote, qemu-img's
// an apostrophe).
func parseSnapshotParam(s, quote string) (SnapshotParam, error) {
	if !strings.HasPrefix(s, "snapshot.") {
		return SnapshotParam{IDOrName: s}, nil
	}
	var p SnapshotParam
	for _, o := range splitOptions(s) {
		switch o.name {
		case "snapshot.id":
			p.ID = o.value
		case "snapshot.name":
			p.Name = o.value
		default:
			return p, errors.Join(fmt.Errorf("Invalid parameter '%s'", o.name),
				fmt.Errorf("Failed in parsing snapshot param %s%s'", quote, s))
		}
	}
	return p, nil
}

// ResolveFilename takes an image name as QEMU's tools take one: "file:"
// before a path names that path, and "json:{...}" is an option tree (the
// drivers ovis has: qcow2, raw, file) as --image-opts gives one in a
// list. It returns the file to open, sets *format to the tree's driver
// unless a format was given (-f wins, as in qemu-img), and names the image
// by the original string in errors. Other names are returned as they are.
func (e *Env) ResolveFilename(name string, format *string) (string, error) {
	switch {
	case strings.HasPrefix(name, "file:"):
		io := &ImageOpts{Spec: name, Filename: strings.TrimPrefix(name, "file:"), CacheCleanInterval: -1}
		e.setImageOpts(io)
		return io.Filename, nil
	case strings.HasPrefix(name, "json:"):
		flat, topFile, err := flattenJSONFilename(strings.TrimPrefix(name, "json:"))
		if err == nil && topFile && format != nil && *format != "" {
			// A format given replaces the tree's driver, as in QEMU,
			// and the file driver's options then name no file.
			err = errors.New(`A block device must be specified for "file"`)
		}
		if err != nil {
			return "", fmt.Errorf("Could not open '%s': %w", name, err)
		}
		io, err := ParseImageOpts(flat)
		if err != nil {
			return "", fmt.Errorf("Could not open '%s': %w", name, err)
		}
		io.Spec = name
		io.FileProtocol = topFile
		e.setImageOpts(io)
		if format != nil && *format == "" {
			*format = io.Driver
		}
		return io.Filename, nil
	}
	return name, nil
}

// flattenJSONFilename turns a json: filename's object into an option
// list, as QEMU flattens it (nested objects become dotted names, list
// items numbered ones), keeping the order of the keys. A top-level file
// driver is ovis's raw driver over the file (topFile).
func flattenJSONFilename(s string) (flat string, topFile bool, err error) {
	dec := json.NewDecoder(strings.NewReader(s))
	dec.UseNumber()
	tok, err := dec.Token()
	if err != nil {
		return "", false, jsonParseError(s, dec.InputOffset(), err)
	}
	if d, ok := tok.(json.Delim); !ok || d != '{' {
		return "", false, errors.New("Invalid JSON object given")
	}
	var parts []string
	if err := flattenJSON(dec, "", '}', &parts); err != nil {
		return "", false, jsonParseError(s, dec.InputOffset(), err)
	}
	if _, err := dec.Token(); err != io.EOF {
		return "", false, errors.New("Could not parse the JSON options: Expecting at most one JSON value")
	}
	// The file protocol alone: ovis reads it as a raw image.
	for i, p := range parts {
		if p == "driver=file" {
			topFile = true
			parts[i] = "driver=raw"
			for j, q := range parts {
				if j != i && !strings.HasPrefix(q, "file.") && !strings.HasPrefix(q, "driver=") {
					parts[j] = "file." + q
				}
			}
			break
		}
	}
	return strings.Join(parts, ","), topFile, nil
}

// flattenJSON appends the members of the object (end '}') or the items of
// the list (end ']') dec is inside of to parts, named after prefix.
func flattenJSON(dec *json.Decoder, prefix string, end json.Delim, parts *[]string) error {
	for i := 0; dec.More(); i++ {
		name := fmt.Sprintf("%s%d", prefix, i)
		if end == '}' {
			k, err := dec.Token()
			if err != nil {
				return err
			}
			name = prefix + k.(string)
		}
		tok, err := dec.Token()
		if err != nil {
			return err
		}
		var v string
		switch t := tok.(type) {
		case json.Delim:
			close := json.Delim('}')
			if t == '[' {
				close = ']'
			}
			if err := flattenJSON(dec, name+".", close, parts); err != nil {
				return err
			}
			continue
		case string:
			v = t
		case json.Number:
			v = t.String()
		case bool:
			v = "off"
			if t {
				v = "on"
			}
		case nil:
			continue // QEMU drops null members
		}
		*parts = append(*parts, name+"="+strings.ReplaceAll(v, ",", ",,"))
	}
	_, err := dec.Token() // the closing delimiter
	return err
}

// jsonParseError words a JSON syntax error of s as QEMU's parser does
// where it can.
func jsonParseError(s string, at int64, err error) error {
	const prefix = "Could not parse the JSON options: "
	var se *json.SyntaxError
	switch {
	case errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF):
		if strings.TrimSpace(s) == "" {
			return errors.New(prefix + "Expecting a JSON value")
		}
		return errors.New(prefix + "JSON parse error, premature EOI")
	case errors.As(err, &se):
		letter := func(i int) bool {
			return i >= 0 && i < len(s) && ('a' <= s[i] && s[i] <= 'z' || 'A' <= s[i] && s[i] <= 'Z')
		}
		// The offending byte: the decoder's offsets differ by case, so
		// a letter (a bare word) is looked for first, then a separator.
		cands := []int{int(se.Offset), int(at), int(se.Offset) - 1}
		pos := -1
		for _, i := range cands {
			if letter(i) {
				pos = i
				break
			}
		}
		if pos < 0 {
			for _, i := range cands {
				if i >= 0 && i < len(s) && strings.IndexByte("}],:", s[i]) >= 0 {
					pos = i
					break
				}
			}
		}
		// A bare word: QEMU's lexer names its run of letters.
		if letter(pos) {
			lo, hi := pos, pos
			for letter(lo - 1) {
				lo--
			}
			for letter(hi + 1) {
				hi++
			}
			return fmt.Errorf(prefix+"JSON parse error, invalid keyword '%s'", s[lo:hi+1])
		}
		switch msg := se.Error(); {
		case strings.Contains(msg, "after object key:value pair"):
			return errors.New(prefix + "JSON parse error, expected separator in dict")
		case strings.Contains(msg, "after array element"):
			return errors.New(prefix + "JSON parse error, expected separator in list")
		case strings.Contains(msg, "after object key"):
			return errors.New(prefix + "JSON parse error, missing : in object pair")
		}
		if pos >= 0 && strings.IndexByte("}],:", s[pos]) >= 0 {
			return errors.New(prefix + "JSON parse error, expecting value")
		}
	}
	return fmt.Errorf(prefix+"JSON parse error, %v", err)
}
