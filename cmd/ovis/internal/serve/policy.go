package serve

import (
	"github.com/ovis-storage/ovis/block"
)

// policyDevice applies qemu-nbd's --discard and --detect-zeroes to a
// device, as QEMU's block layer does above the format driver:
//
//   - with DiscardIgnore, Discard succeeds without reaching the device;
//     WriteZeroes keeps its permission to unmap, as under qemu-nbd (its
//     zero writes reach the format driver through the BlockBackend with
//     BDRV_REQ_MAY_UNMAP intact: only discard=unmap's TRIM differs);
//   - with DetectZeroesOn, a write whose payload is all zeros becomes
//     WriteZeroes(mayUnmap=false) with the same FUA; with
//     DetectZeroesUnmap, WriteZeroes(mayUnmap=true), which Validate allows
//     only together with DiscardUnmap.
//
// Every other method is the device's own.
//
// Safe for concurrent use if the device is. Close closes the device.
type policyDevice struct {
	block.Device
	discard Discard
	zeroes  DetectZeroes
}

var _ block.Device = policyDevice{}

// withPolicy wraps d unless both policies are the device's own behaviour
// (discard=unmap, detect-zeroes=off).
func withPolicy(d block.Device, discard Discard, zeroes DetectZeroes) block.Device {
	if discard == DiscardUnmap && zeroes == DetectZeroesOff {
		return d
	}
	return policyDevice{Device: d, discard: discard, zeroes: zeroes}
}

// WriteAt writes p, or zeroes its range when detection is on and p is all
// zeros.
func (d policyDevice) WriteAt(p []byte, off int64, fua bool) (int, error) {
	if d.zeroes == DetectZeroesOff || len(p) == 0 || !block.IsZero(p) {
		return d.Device.WriteAt(p, off, fua)
	}
	if err := d.WriteZeroes(off, int64(len(p)), d.zeroes == DetectZeroesUnmap, fua); err != nil {
		return 0, err
	}
	return len(p), nil
}

// Discard passes the hint on under DiscardUnmap and checks only the range
// otherwise.
func (d policyDevice) Discard(off, n int64) error {
	if d.discard == DiscardUnmap {
		return d.Device.Discard(off, n)
	}
	return block.CheckRange(off, n, d.Size())
}

// ReadNoWait is the device's own (block.NoWaitReader).
func (d policyDevice) ReadNoWait(p []byte, off int64) bool {
	return block.ReadNoWait(d.Device, p, off)
}
