package image

import (
	"encoding/binary"

	"github.com/ovis-storage/ovis/block"
	"github.com/ovis-storage/ovis/qcow2"
)

// The formats of the module register themselves.
func init() {
	Register("qcow2", Format{Probe: probeQcow2, Open: openQcow2})
	Register(Raw, Format{Open: openRaw})
}

// probeQcow2 claims a file that starts with the qcow2 magic, as QEMU's
// qcow2 driver probes.
func probeQcow2(head []byte) bool {
	return len(head) >= 4 && binary.BigEndian.Uint32(head) == qcow2.Magic
}

func openQcow2(path string, o Options) (block.Device, error) {
	img, err := qcow2.Open(path, o)
	if err != nil {
		return nil, err // not a typed nil in an interface
	}
	return img, nil
}

func openRaw(path string, o Options) (block.Device, error) {
	r, err := qcow2.OpenRaw(path, o)
	if err != nil {
		return nil, err
	}
	return r, nil
}
