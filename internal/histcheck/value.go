package histcheck

import (
	"bytes"
	"encoding/binary"
	"fmt"
)

const (
	// BlockSize is the size of a register's value: one 4 KiB block.
	BlockSize = 4096
	// SectorSize is the unit a torn read is made of: each sector of a
	// value names the value, so a mix of sectors shows where each came
	// from.
	SectorSize = 512
	sectors    = BlockSize / SectorSize

	sectorMagic = "OVHC"
	headerLen   = 24 // magic, register u32, value u64, sector u8, 7 zero bytes
)

// Encode returns the block that write of value v to register reg puts on
// the device. Every 512-byte sector starts with a header naming the
// register, the value and the sector's index, and is filled with bytes
// derived from the three, so a read tells exactly where each of its
// sectors came from. v must not be 0 (zeros are the initial content).
func Encode(reg int, v uint64) []byte {
	if v == 0 || reg < 0 || reg > 1<<32-1 {
		panic(fmt.Sprintf("histcheck: Encode(%d, %d): register out of range or value 0", reg, v))
	}
	b := make([]byte, BlockSize)
	for s := 0; s < sectors; s++ {
		fillSector(b[s*SectorSize:(s+1)*SectorSize], uint32(reg), v, uint8(s))
	}
	return b
}

func fillSector(b []byte, reg uint32, v uint64, s uint8) {
	copy(b, sectorMagic)
	binary.BigEndian.PutUint32(b[4:8], reg)
	binary.BigEndian.PutUint64(b[8:16], v)
	b[16] = s
	clear(b[17:headerLen])
	// The stream's seed mixes the three, so that no two (register,
	// value, sector) share a fill.
	x := uint64(reg)
	x = splitmix(&x) ^ v
	x = splitmix(&x) ^ uint64(s)
	for i := headerLen; i < len(b); i += 8 {
		binary.LittleEndian.PutUint64(b[i:i+8], splitmix(&x))
	}
}

// splitmix is SplitMix64's step: a fast, well-mixed stream from a seed.
func splitmix(x *uint64) uint64 {
	*x += 0x9e3779b97f4a7c15
	z := *x
	z = (z ^ z>>30) * 0xbf58476d1ce4e5b9
	z = (z ^ z>>27) * 0x94d049bb133111eb
	return z ^ z>>31
}

// ContentKind is what a read's bytes are.
type ContentKind uint8

const (
	// Zeros: the block's initial content (value 0).
	Zeros ContentKind = iota + 1
	// Whole: exactly one value written to this register.
	Whole
	// Torn: every sector is zeros or a sector of a value of this register
	// in its place, but not all from the same one.
	Torn
	// Foreign: a sector is whole but from another register, or from
	// another position in the block.
	Foreign
	// Garbage: a sector that is neither zeros nor any value's.
	Garbage
)

func (k ContentKind) String() string {
	switch k {
	case Zeros:
		return "zeros"
	case Whole:
		return "whole"
	case Torn:
		return "torn"
	case Foreign:
		return "foreign"
	case Garbage:
		return "garbage"
	}
	return fmt.Sprintf("content(%d)", k)
}

// Content is what Decode found in a block.
type Content struct {
	Kind ContentKind
	// Value is the value of a Whole block, 0 for Zeros.
	Value uint64
	// Sectors is, for Torn, each sector's value (0 for zeros).
	Sectors []uint64
	// Detail says what is wrong with a Foreign or Garbage block.
	Detail string
}

// Decode says what the block b read from register reg holds. b must be
// BlockSize bytes.
func Decode(reg int, b []byte) Content {
	if len(b) != BlockSize {
		return Content{Kind: Garbage, Detail: fmt.Sprintf("%d bytes, not %d", len(b), BlockSize)}
	}
	var zero [SectorSize]byte
	vals := make([]uint64, sectors)
	want := make([]byte, SectorSize)
	var foreign string
	for s := range sectors {
		sec := b[s*SectorSize : (s+1)*SectorSize]
		if bytes.Equal(sec, zero[:]) {
			continue
		}
		if string(sec[:4]) != sectorMagic {
			return Content{Kind: Garbage, Detail: fmt.Sprintf("sector %d has no value's header", s)}
		}
		r, v, at := binary.BigEndian.Uint32(sec[4:8]), binary.BigEndian.Uint64(sec[8:16]), sec[16]
		if v == 0 {
			return Content{Kind: Garbage, Detail: fmt.Sprintf("sector %d names value 0", s)}
		}
		fillSector(want, r, v, at)
		if !bytes.Equal(sec, want) {
			return Content{Kind: Garbage, Detail: fmt.Sprintf("sector %d has the header of value %d of register %d but not its bytes", s, v, r)}
		}
		if int(r) != reg || int(at) != s {
			if foreign == "" {
				foreign = fmt.Sprintf("sector %d is sector %d of value %d of register %d", s, at, v, r)
			}
			continue
		}
		vals[s] = v
	}
	if foreign != "" {
		return Content{Kind: Foreign, Detail: foreign}
	}
	for _, v := range vals[1:] {
		if v != vals[0] {
			return Content{Kind: Torn, Sectors: vals}
		}
	}
	if vals[0] == 0 {
		return Content{Kind: Zeros}
	}
	return Content{Kind: Whole, Value: vals[0]}
}
