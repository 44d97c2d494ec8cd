package export

import (
	"context"

	"github.com/ovis-storage/ovis/block"
)

// Discard is what a TRIM does to the device (qemu-nbd --discard).
type Discard uint8

const (
	// DiscardIgnore makes TRIM a successful no-op; zero writes may still
	// unmap when the client allows it, as under qemu-nbd. qemu-nbd's
	// default.
	DiscardIgnore Discard = iota
	// DiscardUnmap passes TRIM and unmapping zero writes to the device.
	DiscardUnmap
)

// String returns the option value.
func (d Discard) String() string {
	if d == DiscardUnmap {
		return "unmap"
	}
	return "ignore"
}

// DetectZeroes is what happens to writes whose payload is all zeros
// (qemu-nbd --detect-zeroes).
type DetectZeroes uint8

const (
	// DetectZeroesOff writes zeros as data. The default.
	DetectZeroesOff DetectZeroes = iota
	// DetectZeroesOn turns them into zero writes that keep the range
	// allocated.
	DetectZeroesOn
	// DetectZeroesUnmap turns them into zero writes that may deallocate
	// the range. It needs DiscardUnmap.
	DetectZeroesUnmap
)

// String returns the option value.
func (z DetectZeroes) String() string {
	switch z {
	case DetectZeroesOn:
		return "on"
	case DetectZeroesUnmap:
		return "unmap"
	}
	return "off"
}

// policyDevice applies qemu-nbd's --discard and --detect-zeroes to a
// device, as QEMU's block layer does above the format driver:
//
//   - with DiscardIgnore, Discard succeeds without reaching the device;
//     WriteZeroes keeps its permission to unmap, as under qemu-nbd (its
//     zero writes reach the format driver through the BlockBackend with
//     BDRV_REQ_MAY_UNMAP intact: only discard=unmap's TRIM differs);
//   - with DetectZeroesOn, a write whose payload is all zeros becomes
//     WriteZeroes with NoUnmap and the same FUA; with DetectZeroesUnmap,
//     WriteZeroes without NoUnmap, which a server's configuration should
//     allow only together with DiscardUnmap (qemu-nbd refuses it
//     otherwise).
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

// WithPolicy wraps d unless both policies are the device's own behaviour
// (discard=unmap, detect-zeroes=off).
func WithPolicy(d block.Device, discard Discard, zeroes DetectZeroes) block.Device {
	if discard == DiscardUnmap && zeroes == DetectZeroesOff {
		return d
	}
	return policyDevice{Device: d, discard: discard, zeroes: zeroes}
}

// WriteAt writes p, or zeroes its range when detection is on and p is all
// zeros.
func (d policyDevice) WriteAt(ctx context.Context, p []byte, off int64, f block.Flags) (int, error) {
	if d.zeroes == DetectZeroesOff || len(p) == 0 || !block.IsZero(p) {
		return d.Device.WriteAt(ctx, p, off, f)
	}
	zf := f & block.FUA
	if d.zeroes != DetectZeroesUnmap {
		zf |= block.NoUnmap
	}
	if err := d.Device.WriteZeroes(ctx, off, int64(len(p)), zf); err != nil {
		return 0, err
	}
	return len(p), nil
}

// Discard passes the hint on under DiscardUnmap and checks only the range
// otherwise.
func (d policyDevice) Discard(ctx context.Context, off, n int64, f block.Flags) error {
	if d.discard == DiscardUnmap {
		return d.Device.Discard(ctx, off, n, f)
	}
	return block.CheckRange(off, n, d.Size())
}

func (d policyDevice) Unwrap() block.Device { return d.Device }
