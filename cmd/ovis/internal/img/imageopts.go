package img

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strings"

	"github.com/ovis-storage/ovis/image"
)

// ImageOpts is an image named by an option list (--image-opts); see
// image.Opts.
type ImageOpts = image.Opts

// ParseImageOpts parses an --image-opts list (image.ParseOpts). Its errors
// are QEMU's reasons; callers put "Could not open 'SPEC': " before them.
func ParseImageOpts(spec string) (*ImageOpts, error) {
	o, err := image.ParseOpts(spec)
	if err != nil {
		return nil, qemuOptError(err)
	}
	return o, nil
}

// qemuOptError words an *image.OptError of an --image-opts list as QEMU
// words the same mistake; it unwraps to err.
func qemuOptError(err error) error {
	var oe *image.OptError
	if !errors.As(err, &oe) {
		return err
	}
	name := oe.Name
	switch {
	case errors.Is(err, image.ErrUnknownDriver):
		return wrapMsg(err, "Unknown driver '%s'", oe.Value)
	case errors.Is(err, image.ErrNodeName):
		return wrapMsg(err, "Cannot find device='%s' nor node-name='%s'", oe.Value, oe.Value)
	case errors.Is(err, image.ErrOptUnsupported) && oe.Driver == "file":
		return wrapMsg(err, "Block protocol 'file' doesn't support the option '%s'", strings.TrimPrefix(name, "file."))
	case errors.Is(err, image.ErrOptUnsupported):
		return wrapMsg(err, "Block format '%s' does not support the option '%s'", oe.Driver, name)
	case errors.Is(err, image.ErrOptBool):
		return wrapMsg(err, "Parameter '%s' expects 'on' or 'off'", name)
	case errors.Is(err, image.ErrOptSize):
		return wrapMsg(err, "Parameter '%s' expects a non-negative number below 2^64\n"+
			"Optional suffix k, M, G, T, P or E means kilo-, mega-, giga-, tera-, peta-\n"+
			"and exabytes, respectively.", name)
	case errors.Is(err, image.ErrOptNumber):
		return wrapMsg(err, "Parameter '%s' expects a number", name)
	case errors.Is(err, image.ErrOptValue):
		return wrapMsg(err, "Parameter '%s' does not accept value '%s'", strings.TrimPrefix(name, "file."), oe.Value)
	case errors.Is(err, image.ErrNoFilename) && oe.Driver == "":
		return wrapMsg(err, "Must specify either driver or file")
	case errors.Is(err, image.ErrNoFilename):
		return wrapMsg(err, `A block device must be specified for "file"`)
	case errors.Is(err, image.ErrOptConflict):
		return wrapMsg(err, "cache.direct=on together with cache.no-flush=on is not supported by ovis")
	}
	return err
}

// UseImageOpts parses the --image-opts list spec and returns the file and
// format it names, and records the list in e: the verb then opens that
// file with its options and names it by spec in open errors.
func (e *Env) UseImageOpts(spec string) (filename, format string, err error) {
	io, err := ParseImageOpts(spec)
	if err != nil {
		return "", "", fmt.Errorf("Could not open '%s': %w", spec, err)
	}
	e.setImageOpts(io)
	return io.Filename, io.Driver, nil
}

// SnapshotParam is a -l argument (qemu-nbd's, qemu-img convert's and
// measure's); see image.Snapshot.
type SnapshotParam = image.Snapshot

// ParseSnapshotParam parses a -l argument, failing with qemu-nbd's two
// lines for an option it does not know.
func ParseSnapshotParam(s string) (SnapshotParam, error) {
	return parseSnapshotParam(s, "`")
}

// parseSnapshotParam parses a snapshot parameter (image.ParseSnapshot);
// quote opens the parameter in the parse error (qemu-nbd's is a
// backquote, qemu-img's an apostrophe).
func parseSnapshotParam(s, quote string) (SnapshotParam, error) {
	p, err := image.ParseSnapshot(s)
	var oe *image.OptError
	if errors.As(err, &oe) {
		return p, errors.Join(wrapMsg(err, "Invalid parameter '%s'", oe.Name),
			fmt.Errorf("Failed in parsing snapshot param %s%s'", quote, s))
	}
	return p, err
}

// ResolveFilename takes an image name as QEMU's tools take one: "file:"
// before a path names that path, and "json:{...}" is an option tree (the
// drivers ovis has: qcow2, raw, file) as --image-opts gives one in a
// list. It returns the file to open, sets *format to the tree's driver
// unless a format was given (-f wins, as in qemu-img), and records the
// name in e, so that the verb's opens take its options and its errors
// name the image by the original string. Other names are returned as they
// are.
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
// list (image.FlattenJSON), with QEMU's messages.
func flattenJSONFilename(s string) (flat string, topFile bool, err error) {
	flat, topFile, err = image.FlattenJSON(s)
	var je *image.JSONError
	switch {
	case err == nil:
		return flat, topFile, nil
	case errors.Is(err, image.ErrJSONNotObject):
		return "", false, wrapMsg(err, "Invalid JSON object given")
	case errors.Is(err, image.ErrJSONTrailing):
		return "", false, wrapMsg(err, "Could not parse the JSON options: Expecting at most one JSON value")
	case errors.As(err, &je):
		return "", false, jsonParseError(je.Input, je.Offset, je.Err)
	}
	return "", false, err
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
