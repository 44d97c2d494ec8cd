package store

import (
	"encoding/binary"
	"fmt"
	"hash/crc32"

	"github.com/ovis-storage/ovis/cluster/object"
)

// An object file is a HeaderSize-byte header followed by the object's
// bytes: object offset x lives at file offset HeaderSize+x, so data stays
// aligned to 4 KiB pages and blocks. Only the first headerLen bytes of the
// header are ever written after creation; the rest is reserved and zero.
const (
	HeaderSize = 4096
	headerLen  = 36

	headerFormat = 1

	// flagRemoved marks a tombstone: the object was removed at the
	// header's version and the file holds no data. Format-1 files written
	// before tombstones existed have flags 0.
	flagRemoved = 1 << 0
	knownFlags  = flagRemoved
)

var headerMagic = [8]byte{'O', 'V', 'I', 'S', 'O', 'B', 'J', 0}

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// header is the decoded first headerLen bytes of an object file.
//
//	0  magic   "OVISOBJ\0"
//	8  format  uint32 LE, 1
//	12 flags   uint32 LE, bit 0 removed (a tombstone); other bits 0
//	16 id      uint64 LE, the object's ID (catches misplaced files)
//	24 version uint64 LE, epoch<<32 | count (see Version)
//	32 crc     uint32 LE, CRC32C of bytes 0..31
type header struct {
	id      object.ID
	version uint64
	removed bool
}

func (h header) encode(b []byte) {
	_ = b[headerLen-1]
	copy(b[0:8], headerMagic[:])
	binary.LittleEndian.PutUint32(b[8:], headerFormat)
	var flags uint32
	if h.removed {
		flags |= flagRemoved
	}
	binary.LittleEndian.PutUint32(b[12:], flags)
	binary.LittleEndian.PutUint64(b[16:], uint64(h.id))
	binary.LittleEndian.PutUint64(b[24:], h.version)
	binary.LittleEndian.PutUint32(b[32:], crc32.Checksum(b[:32], castagnoli))
}

// decodeHeader parses an object file's header and checks it names want.
func decodeHeader(b []byte, want object.ID) (header, error) {
	if len(b) < headerLen {
		return header{}, fmt.Errorf("header of %d bytes: %w", len(b), ErrCorrupt)
	}
	if [8]byte(b[0:8]) != headerMagic {
		return header{}, fmt.Errorf("header magic %q: %w", b[0:8], ErrCorrupt)
	}
	if c, w := binary.LittleEndian.Uint32(b[32:]), crc32.Checksum(b[:32], castagnoli); c != w {
		return header{}, fmt.Errorf("header crc %#x, want %#x: %w", c, w, ErrCorrupt)
	}
	if f := binary.LittleEndian.Uint32(b[8:]); f != headerFormat {
		return header{}, fmt.Errorf("header format %d: %w", f, ErrCorrupt)
	}
	f := binary.LittleEndian.Uint32(b[12:])
	if f&^knownFlags != 0 {
		return header{}, fmt.Errorf("header flags %#x: %w", f, ErrCorrupt)
	}
	h := header{
		id:      object.ID(binary.LittleEndian.Uint64(b[16:])),
		version: binary.LittleEndian.Uint64(b[24:]),
		removed: f&flagRemoved != 0,
	}
	if h.id != want {
		return header{}, fmt.Errorf("header names object %s: %w", h.id, ErrCorrupt)
	}
	return h, nil
}
