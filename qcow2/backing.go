package qcow2

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/ovis-storage/ovis/block"
	"golang.org/x/sys/unix"
)

// maxChainDepth bounds backing chains, as a guard beside loop detection.
const maxChainDepth = 256

// probe returns "qcow2" when the file at path starts with the qcow2 magic
// and "raw" otherwise, as QEMU's format probing does for these two: the
// fallback of backing files opened without Options.OpenBacking (package
// image probes every registered format).
func probe(path string) (string, error) {
	if isPseudoFilename(path) {
		p, format, err := SplitFilename(path, "")
		if err != nil || format != "" {
			return format, err
		}
		path = p
	}
	f, err := os.Open(path)
	if err != nil {
		return "", err
	}
	defer f.Close()
	var b [4]byte
	n, _ := f.ReadAt(b[:], 0)
	if n == 4 && binary.BigEndian.Uint32(b[:]) == Magic {
		return "qcow2", nil
	}
	return "raw", nil
}

// OpenRaw opens the raw image at path with the image locks QEMU takes on
// a raw image (see Options: ReadOnly, Resize, NoShare, ForceShare,
// FixedSize, NoLock, Reopen and OpenFile apply; the rest does not). It is
// how package image opens raw images and how qcow2 opens raw backing
// files without Options.OpenBacking.
func OpenRaw(path string, o Options) (*block.Raw, error) {
	f, err := o.openLocked(path, roleRaw)
	if err != nil {
		return nil, err
	}
	r, err := block.NewRaw(f, o.ReadOnly)
	if err != nil {
		f.Close()
		return nil, err
	}
	return r, nil
}

// openDevice opens a backing file as format "qcow2" or "raw" ("" probes):
// the fallback of Options.OpenBacking.
func openDevice(path, format string, o Options, seen map[string]bool) (block.Device, error) {
	if isPseudoFilename(path) {
		p, f, err := SplitFilename(path, format)
		if err != nil {
			return nil, err
		}
		path, format = p, f
	}
	if format == "" {
		var err error
		if format, err = probe(path); err != nil {
			return nil, fmt.Errorf("qcow2: %w", err)
		}
	}
	switch format {
	case "qcow2":
		return openChain(path, o, seen)
	case "raw":
		return OpenRaw(path, o)
	}
	return nil, fmt.Errorf("qcow2: unknown format %q", format)
}

// isPseudoFilename reports whether name is one of the names QEMU takes
// beside paths that SplitFilename parses.
func isPseudoFilename(name string) bool {
	return strings.HasPrefix(name, "file:") || strings.HasPrefix(name, "json:")
}

// SplitFilename parses the image names QEMU takes beside paths, as a
// backing file name may be one: "file:PATH" is PATH, and "json:{...}" a
// tree of the drivers ovis has, {"driver": "qcow2" or "raw", "file":
// {"driver": "file", "filename": PATH}} or {"driver": "file", "filename":
// PATH} (a raw image). A format given (a backing format, -f) replaces
// the tree's driver, as in QEMU. It returns the path and the format (""
// when neither names one). Runtime options in the tree are not applied
// here.
func SplitFilename(name, format string) (path, driver string, err error) {
	if p, ok := strings.CutPrefix(name, "file:"); ok {
		return p, format, nil
	}
	type node struct {
		Driver   string          `json:"driver"`
		Filename string          `json:"filename"`
		File     json.RawMessage `json:"file"`
	}
	var top node
	if err := json.Unmarshal([]byte(strings.TrimPrefix(name, "json:")), &top); err != nil {
		return "", "", fmt.Errorf("Could not parse the JSON options: %v", err)
	}
	if format != "" {
		top.Driver = format
	}
	switch top.Driver {
	case "file":
		if top.Filename == "" {
			return "", "", errors.New(`The 'file' block driver requires a file name`)
		}
		return top.Filename, "raw", nil
	case "", "qcow2", "raw":
	default:
		return "", "", fmt.Errorf("Unknown driver '%s'", top.Driver)
	}
	var file node
	if len(top.File) == 0 {
		if top.Driver == "" {
			return "", "", errors.New("Must specify either driver or file")
		}
		return "", "", errors.New(`A block device must be specified for "file"`)
	}
	if err := json.Unmarshal(top.File, &file); err != nil {
		var ref string
		if json.Unmarshal(top.File, &ref) == nil {
			return "", "", fmt.Errorf("Cannot find device='%s' nor node-name='%s'", ref, ref)
		}
		return "", "", fmt.Errorf("Could not parse the JSON options: %v", err)
	}
	if file.Driver != "" && file.Driver != "file" {
		return "", "", fmt.Errorf("Unknown driver '%s'", file.Driver)
	}
	if file.Filename == "" {
		return "", "", errors.New(`The 'file' block driver requires a file name`)
	}
	return file.Filename, top.Driver, nil
}

// openBacking opens the backing chain read-only, refusing loops.
func (img *Image) openBacking(o Options, seen map[string]bool) error {
	key := chainKey(img.path)
	if seen == nil {
		seen = map[string]bool{}
	}
	seen[key] = true
	if len(seen) > maxChainDepth {
		return fmt.Errorf("qcow2: %s: backing chain deeper than %d", img.path, maxChainDepth)
	}
	p := img.resolve(img.hdr.BackingFile)
	if o.Untrusted {
		real, err := Confine(img.path, p)
		if err != nil {
			return fmt.Errorf("qcow2: %s: backing file refused: %w", img.path, err)
		}
		p = real
	}
	if seen[chainKey(p)] {
		return fmt.Errorf("qcow2: %s: backing file loop: %s is already in the chain", img.path, p)
	}
	bo := o
	bo.ReadOnly = true
	bo.NoBacking = false
	bo.ForCheck = false // only the image checked is opened for check
	bo.FixedSize, bo.Resize, bo.NoLock, bo.Reopen = false, false, false, false
	var b block.Device
	var err error
	if o.OpenBacking != nil {
		bo.seen = seen
		b, err = o.OpenBacking(p, img.hdr.BackingFormat, bo)
	} else {
		b, err = openDevice(p, img.hdr.BackingFormat, bo, seen)
	}
	if err != nil {
		return fmt.Errorf("qcow2: %s: opening backing file: %w", img.path, err)
	}
	img.backing = b
	img.backRef = p
	img.backingSize = b.Size()
	return nil
}

// chainKey identifies a file for loop detection: its device and inode
// when it can be stat'ed, else its cleaned absolute path.
func chainKey(p string) string {
	var st unix.Stat_t
	if err := unix.Stat(p, &st); err == nil {
		return fmt.Sprintf("%d:%d", st.Dev, st.Ino)
	}
	a, err := filepath.Abs(p)
	if err != nil {
		return p
	}
	return a
}

func isAbs(p string) bool { return filepath.IsAbs(p) }

// ErrUntrusted is wrapped by errors for files an untrusted image may not
// name.
var ErrUntrusted = errors.New("not allowed for an untrusted image")

// ErrProbeUntrusted is the refusal to probe the format of an untrusted
// image: a raw guest disk that wrote a qcow2 header into its first sector
// would be read as qcow2, naming any host file as its backing file. It
// wraps ErrUntrusted.
var ErrProbeUntrusted = fmt.Errorf("the image format must be given (-f FMT): probing the format is %w", ErrUntrusted)

// Confine checks that name, a file the image at path image refers to, is
// a regular file inside the image's folder once symlinks are resolved —
// the rule of Options.Untrusted, for callers that follow a chain by
// themselves. It returns the file's
// resolved path, which the caller opens: opening name itself would follow
// its symlinks again, and they may have changed since.
func Confine(image, name string) (string, error) {
	dir, err := filepath.EvalSymlinks(filepath.Dir(image))
	if err != nil {
		return "", err
	}
	real, err := filepath.EvalSymlinks(name)
	if err != nil {
		return "", err
	}
	rel, err := filepath.Rel(dir, real)
	if err != nil || rel == ".." || strings.HasPrefix(rel, ".."+string(filepath.Separator)) || filepath.IsAbs(rel) {
		return "", fmt.Errorf("%s is outside %s: %w", name, dir, ErrUntrusted)
	}
	st, err := os.Lstat(real)
	if err != nil {
		return "", err
	}
	if !st.Mode().IsRegular() {
		return "", fmt.Errorf("%s is not a regular file: %w", name, ErrUntrusted)
	}
	return real, nil
}

// joinDir resolves name against the folder of the image at path.
func joinDir(path, name string) string { return filepath.Join(filepath.Dir(path), name) }

func fallocate(f *block.OSFile, size int64) error {
	if err := unix.Fallocate(int(f.Fd()), 0, 0, size); err != nil {
		return fmt.Errorf("qcow2: fallocate: %w", err)
	}
	return nil
}
