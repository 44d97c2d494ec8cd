package image

import (
	"fmt"
	"slices"
	"sync"

	"github.com/ovis-storage/ovis/block"
	"github.com/ovis-storage/ovis/qcow2"
)

// Options are the options an image opens with. They are the qcow2
// engine's; another format uses those that apply to it (raw: ReadOnly,
// OpenFile and the locking fields, see qcow2.OpenRaw) and ignores the
// rest. Open sets OpenBacking, when nil, so that a qcow2 image's backing
// file may be of any registered format.
type Options = qcow2.Options

// Format is one image format Open and Probe know.
type Format struct {
	// Probe reports whether head, the first bytes of a file (ProbeSize,
	// or fewer for a shorter file), starts an image of this format. nil
	// never claims a file: the format must be named (raw is what a file
	// no format claims is taken for).
	Probe func(head []byte) bool
	// Open opens the image at path, a file name (Open has parsed file:
	// and json: names already). Required.
	Open func(path string, o Options) (block.Device, error)
}

// ProbeSize is how many bytes of a file Probe hands to Format.Probe.
const ProbeSize = 512

// registry holds the formats by name. Formats are registered by init
// functions and looked up by every Open.
var registry struct {
	mu      sync.RWMutex
	formats map[string]Format
}

// Register makes a format known by name to Open and Probe. It panics if
// name is registered already or f.Open is nil, as a second registration
// is a programming error. Safe for concurrent use.
func Register(name string, f Format) {
	if f.Open == nil {
		panic("image: Register " + name + " without Open")
	}
	registry.mu.Lock()
	defer registry.mu.Unlock()
	if registry.formats == nil {
		registry.formats = map[string]Format{}
	}
	if _, dup := registry.formats[name]; dup {
		panic("image: Register called twice for format " + name)
	}
	registry.formats[name] = f
}

// Lookup returns the format registered as name.
func Lookup(name string) (Format, bool) {
	registry.mu.RLock()
	defer registry.mu.RUnlock()
	f, ok := registry.formats[name]
	return f, ok
}

// Formats returns the names of the registered formats, sorted. The
// caller owns the slice.
func Formats() []string {
	registry.mu.RLock()
	defer registry.mu.RUnlock()
	names := make([]string, 0, len(registry.formats))
	for name := range registry.formats {
		names = append(names, name)
	}
	slices.Sort(names)
	return names
}

// lookup is Lookup with the error Open returns for an unknown name.
func lookup(name string) (Format, error) {
	f, ok := Lookup(name)
	if !ok {
		return Format{}, fmt.Errorf("image: %w %q", ErrUnknownFormat, name)
	}
	return f, nil
}
