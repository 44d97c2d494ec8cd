package img

import (
	"path/filepath"

	"github.com/ovis-storage/ovis/block"
	"github.com/ovis-storage/ovis/qcow2"
)

// layer is one image of an open backing chain.
type layer struct {
	// path is the name the image was opened by: the name given for the
	// top, the resolved backing file name below.
	path, format string
	dev          block.Device
}

// chainOf lists the layers of an open image, top first. The devices
// belong to top, which closes them.
func chainOf(path, format string, top block.Device) []layer {
	var out []layer
	for dev := top; dev != nil; {
		out = append(out, layer{path: path, format: format, dev: dev})
		img, ok := block.As[*qcow2.Image](dev)
		if !ok {
			break
		}
		h := img.Header()
		path, format, dev = img.BackingPath(), h.BackingFormat, img.Backing()
		if format == "" && dev != nil {
			format = "raw"
			if _, ok := block.As[*qcow2.Image](dev); ok {
				format = "qcow2"
			}
		}
	}
	return out
}

// findBacking returns the index in chain of the layer that name refers
// to, as QEMU's bdrv_find_backing_image does: name, resolved against
// each image that has a backing file, is compared with that image's
// backing file, both as canonical absolute paths. It returns -1 when no
// layer matches.
func findBacking(chain []layer, name string) int {
	for i := 0; i+1 < len(chain); i++ {
		want, ok := realPath(combinePath(chain[i].path, name))
		if !ok {
			continue
		}
		if got, ok := realPath(chain[i+1].path); ok && got == want {
			return i + 1
		}
	}
	return -1
}

// realPath is C's realpath: absolute, symlinks resolved; false when the
// file does not exist.
func realPath(p string) (string, bool) {
	a, err := filepath.Abs(p)
	if err != nil {
		return "", false
	}
	r, err := filepath.EvalSymlinks(a)
	return r, err == nil
}
