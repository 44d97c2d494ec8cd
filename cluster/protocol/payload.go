package protocol

import (
	"encoding/binary"
	"errors"
	"fmt"

	"github.com/ovis-storage/ovis/cluster/object"
)

// ErrPayload is wrapped by the errors of the Parse functions: a
// structured payload that is malformed.
var ErrPayload = errors.New("protocol: malformed payload")

// ObjectInfo describes one object a node holds: the OpStat reply (one)
// and the OpList reply (one per object, by ascending ID).
type ObjectInfo struct {
	ID      object.ID
	Version uint64
	// Allocated is the bytes of the object allocated on disk, from 0 to
	// MaxObjectSpan.
	Allocated int64
	// Suspect: the copy may be torn after a crash. Tombstone: the object
	// was removed, and Version is the removal's.
	Suspect, Tombstone bool
}

// Flag bits of an ObjectInfo, in the top byte of its third word.
const (
	infoSuspect   = 1 << 56
	infoTombstone = 1 << 57
	infoFlags     = 0xff << 56
)

// ObjectInfoLen is the encoded size of one ObjectInfo.
const ObjectInfoLen = 24

// MaxListEntries is the most ObjectInfos one OpList reply holds.
const MaxListEntries = MaxPayload / ObjectInfoLen

// AppendObjectInfos appends the encoding of infos to dst: each as id
// u64, version u64, then allocated in the low 56 bits and the flags
// (bit 56 suspect, bit 57 tombstone) in the top byte of a u64,
// big-endian.
func AppendObjectInfos(dst []byte, infos []ObjectInfo) []byte {
	for _, in := range infos {
		dst = binary.BigEndian.AppendUint64(dst, uint64(in.ID))
		dst = binary.BigEndian.AppendUint64(dst, in.Version)
		w := uint64(in.Allocated)
		if in.Suspect {
			w |= infoSuspect
		}
		if in.Tombstone {
			w |= infoTombstone
		}
		dst = binary.BigEndian.AppendUint64(dst, w)
	}
	return dst
}

// ParseObjectInfos appends the ObjectInfos encoded in p to dst. It
// returns an error wrapping ErrPayload when p is not a whole number of
// entries, an Allocated is out of range or the IDs do not ascend
// strictly.
func ParseObjectInfos(dst []ObjectInfo, p []byte) ([]ObjectInfo, error) {
	if len(p)%ObjectInfoLen != 0 {
		return dst, fmt.Errorf("%w: object infos: %d bytes is not a multiple of %d", ErrPayload, len(p), ObjectInfoLen)
	}
	n := len(p) / ObjectInfoLen
	dst = growCap(dst, n)
	for i := 0; i < n; i++ {
		b := p[i*ObjectInfoLen:]
		w := binary.BigEndian.Uint64(b[16:])
		in := ObjectInfo{
			ID:        object.ID(binary.BigEndian.Uint64(b[0:])),
			Version:   binary.BigEndian.Uint64(b[8:]),
			Allocated: int64(w &^ infoFlags),
			Suspect:   w&infoSuspect != 0,
			Tombstone: w&infoTombstone != 0,
		}
		if f := w & infoFlags &^ (infoSuspect | infoTombstone); f != 0 {
			return dst, fmt.Errorf("%w: object info %d (%s): unknown flags %#x", ErrPayload, i, in.ID, f>>56)
		}
		if in.Allocated < 0 || in.Allocated > MaxObjectSpan {
			return dst, fmt.Errorf("%w: object info %d (%s): allocated %d out of [0, %d]", ErrPayload, i, in.ID, in.Allocated, MaxObjectSpan)
		}
		if i > 0 && in.ID <= dst[len(dst)-1].ID {
			return dst, fmt.Errorf("%w: object info %d: id %s after %s", ErrPayload, i, in.ID, dst[len(dst)-1].ID)
		}
		dst = append(dst, in)
	}
	return dst, nil
}

// Extent is one range of an object in an OpExtents reply: allocated
// data, or a hole that reads as zeroes.
type Extent struct {
	Offset, Length uint64
	Hole           bool
}

// ExtentLen is the encoded size of one Extent.
const ExtentLen = 20

// extentHole is the flag bit of a hole.
const extentHole = 1 << 0

// AppendExtents appends the encoding of exts to dst: each as offset
// u64, length u64, flags u32 (bit 0: hole), big-endian.
func AppendExtents(dst []byte, exts []Extent) []byte {
	for _, e := range exts {
		dst = binary.BigEndian.AppendUint64(dst, e.Offset)
		dst = binary.BigEndian.AppendUint64(dst, e.Length)
		var f uint32
		if e.Hole {
			f |= extentHole
		}
		dst = binary.BigEndian.AppendUint32(dst, f)
	}
	return dst
}

// ParseExtents appends the Extents encoded in p to dst. It returns an
// error wrapping ErrPayload when p is not a whole number of entries, a
// flag bit other than hole is set, an extent is empty or ends past
// MaxObjectSpan, or an extent does not start where the one before ends.
func ParseExtents(dst []Extent, p []byte) ([]Extent, error) {
	if len(p)%ExtentLen != 0 {
		return dst, fmt.Errorf("%w: extents: %d bytes is not a multiple of %d", ErrPayload, len(p), ExtentLen)
	}
	n := len(p) / ExtentLen
	dst = growCap(dst, n)
	var end uint64
	for i := 0; i < n; i++ {
		b := p[i*ExtentLen:]
		e := Extent{Offset: binary.BigEndian.Uint64(b[0:]), Length: binary.BigEndian.Uint64(b[8:])}
		f := binary.BigEndian.Uint32(b[16:])
		if f&^extentHole != 0 {
			return dst, fmt.Errorf("%w: extent %d: unknown flags %#x", ErrPayload, i, f&^extentHole)
		}
		e.Hole = f&extentHole != 0
		if e.Length == 0 || e.Offset > MaxObjectSpan || e.Length > MaxObjectSpan-e.Offset {
			return dst, fmt.Errorf("%w: extent %d: %d+%d empty or past %d", ErrPayload, i, e.Offset, e.Length, MaxObjectSpan)
		}
		if i > 0 && e.Offset != end {
			return dst, fmt.Errorf("%w: extent %d: starts at %d, the one before ends at %d", ErrPayload, i, e.Offset, end)
		}
		end = e.Offset + e.Length
		dst = append(dst, e)
	}
	return dst, nil
}

// ChecksumReplyLen is the size of an OpChecksum reply.
const ChecksumReplyLen = 12

// AppendChecksumReply appends an OpChecksum reply to dst: the CRC32C of
// the range, u32, then the object's version, u64, big-endian.
func AppendChecksumReply(dst []byte, crc uint32, version uint64) []byte {
	dst = binary.BigEndian.AppendUint32(dst, crc)
	return binary.BigEndian.AppendUint64(dst, version)
}

// ParseChecksumReply decodes an OpChecksum reply. It returns an error
// wrapping ErrPayload when p is not ChecksumReplyLen bytes.
func ParseChecksumReply(p []byte) (crc uint32, version uint64, err error) {
	if len(p) != ChecksumReplyLen {
		return 0, 0, fmt.Errorf("%w: checksum reply: %d bytes, want %d", ErrPayload, len(p), ChecksumReplyLen)
	}
	return binary.BigEndian.Uint32(p), binary.BigEndian.Uint64(p[4:]), nil
}

// growCap returns dst with room for n more elements; n is bounded by
// the input's length, so this never allocates more than it holds.
func growCap[T any](dst []T, n int) []T {
	if cap(dst)-len(dst) < n {
		nd := make([]T, len(dst), len(dst)+n)
		copy(nd, dst)
		dst = nd
	}
	return dst
}

// AppendSettleIDs appends the OpSettle payload naming ids to dst: each
// gate id as a u64, big-endian, in the order given.
func AppendSettleIDs(dst []byte, ids []uint64) []byte {
	for _, id := range ids {
		dst = binary.BigEndian.AppendUint64(dst, id)
	}
	return dst
}

// ParseSettleIDs appends the gate ids of an OpSettle payload to dst. It
// returns an error wrapping ErrPayload when p is empty, not a whole
// number of ids, or holds more than MaxSettleIDs.
func ParseSettleIDs(dst []uint64, p []byte) ([]uint64, error) {
	if len(p) == 0 || len(p)%8 != 0 || len(p)/8 > MaxSettleIDs {
		return dst, fmt.Errorf("%w: settle: %d bytes, want 1 to %d ids of 8 bytes", ErrPayload, len(p), MaxSettleIDs)
	}
	dst = growCap(dst, len(p)/8)
	for i := 0; i < len(p); i += 8 {
		dst = append(dst, binary.BigEndian.Uint64(p[i:]))
	}
	return dst, nil
}
