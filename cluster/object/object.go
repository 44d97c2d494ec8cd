// Package object names the pieces a cluster stores: the objects of
// virtual disks (VDIs).
//
// A VDI is split into objects of one fixed size, a power of two chosen
// per VDI at creation. An object's ID packs the VDI's 32-bit id and the
// object's 32-bit index within it, so that one VDI can hold 2^32
// objects: 4 PiB with 1 MiB objects. VDI ids are handed out by the
// cluster's metadata (never 0) and never reused, so an ID names one
// object for the life of the cluster, and the objects of a deleted VDI
// cannot be mistaken for those of a new one.
//
// The package is pure: it does no I/O.
package object

import (
	"fmt"
	"strconv"
)

// VDI is a virtual disk's id. 0 is never a valid id.
type VDI uint32

// ID names one object: the VDI it belongs to and its index.
type ID uint64

// Make returns the ID of object index of vdi.
func Make(vdi VDI, index uint32) ID { return ID(uint64(vdi)<<32 | uint64(index)) }

// VDI returns the VDI the object belongs to.
func (id ID) VDI() VDI { return VDI(id >> 32) }

// Index returns the object's index within its VDI.
func (id ID) Index() uint32 { return uint32(id) }

// String gives the ID as 16 hex digits, the form used in file names,
// logs and errors.
func (id ID) String() string { return fmt.Sprintf("%016x", uint64(id)) }

// Parse reads an ID written by String.
func Parse(s string) (ID, error) {
	if len(s) != 16 {
		return 0, fmt.Errorf("object: id %q: want 16 hex digits", s)
	}
	v, err := strconv.ParseUint(s, 16, 64)
	if err != nil {
		return 0, fmt.Errorf("object: id %q: %w", s, err)
	}
	return ID(v), nil
}

// Object sizes a VDI may choose: powers of two from 1 MiB to 64 MiB.
const (
	MinSizeShift     = 20
	MaxSizeShift     = 26
	DefaultSizeShift = 22 // 4 MiB, as Sheepdog
)

// ValidSize reports whether size is an object size a VDI may use, and
// says why not.
func ValidSize(size int64) error {
	if size < 1<<MinSizeShift || size > 1<<MaxSizeShift || size&(size-1) != 0 {
		return fmt.Errorf("object size %d: want a power of two from 1 MiB to 64 MiB", size)
	}
	return nil
}

// MaxVDISize is the largest VDI of objects of the given size: 2^32
// objects.
func MaxVDISize(objectSize int64) int64 { return objectSize << 32 }
