package image

import (
	"errors"
	"fmt"

	"github.com/ovis-storage/ovis/block"
)

// ErrUnknownFormat is wrapped by the error of Open for a format no one
// registered.
var ErrUnknownFormat = errors.New("unknown format")

// Open opens the image name names, a path or a file: or json: name (see
// qcow2.SplitFilename), as format, or as the format Probe finds when
// format is "". A qcow2 image opens with its backing chain, each backing
// file through Open again, so of any registered format, unless
// o.OpenBacking is set already. The device is the format's own
// (*qcow2.Image, *block.Raw): callers may type-assert it.
//
// Errors: ErrUnknownFormat (wrapped), a probing error, or the format's
// Open error. Close the device when done.
func Open(name, format string, o Options) (block.Device, error) {
	path, format, err := splitName(name, format)
	if err != nil {
		return nil, err
	}
	if format == "" {
		if format, err = Probe(path); err != nil {
			return nil, fmt.Errorf("image: %w", err)
		}
	}
	f, err := lookup(format)
	if err != nil {
		return nil, err
	}
	if o.OpenBacking == nil {
		o.OpenBacking = Open
	}
	return f.Open(path, o)
}
