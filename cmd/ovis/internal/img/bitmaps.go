package img

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"

	"github.com/ovis-storage/ovis/qcow2"
)

// The bitmaps header extension and directory (docs/interop/qcow2.rst,
// "Bitmaps extension"), and QEMU's limits on them (block/qcow2-bitmap.c).
const (
	extBitmaps         = 0x23852875
	bitmapsExtLen      = 24
	bitmapEntryLen     = 24
	maxBitmaps         = 65535
	maxBitmapDirectory = maxBitmaps * 1024 // QCOW2_MAX_BITMAP_DIRECTORY_SIZE
	bitmapFlagInUse    = 1 << 0
	bitmapFlagAuto     = 1 << 1
	maxBitmapTable     = 0x8000000  // BME_MAX_TABLE_SIZE, entries
	maxBitmapPhys      = 0x20000000 // BME_MAX_PHYS_SIZE, bytes
)

var errBrokenBitmapDir = errors.New("Broken bitmap directory")

// bitmapEntryValid applies QEMU's check_dir_entry to directory entry e of
// an image with clusters of cs bytes and a virtual size of size bytes.
func bitmapEntryValid(e []byte, cs, size uint64) bool {
	be := binary.BigEndian
	tableOff, tableSize := be.Uint64(e[0:]), be.Uint32(e[8:])
	flags, typ, granBits := be.Uint32(e[12:]), e[16], e[17]
	nameLen := be.Uint16(e[18:])
	const reserved = ^uint32(bitmapFlagInUse | bitmapFlagAuto)
	if tableSize == 0 || tableOff == 0 || tableOff%cs != 0 || tableSize > maxBitmapTable ||
		granBits > 31 || granBits < 9 || flags&reserved != 0 || nameLen > 1023 || typ != 1 {
		return false
	}
	phys := uint64(tableSize) * cs
	if phys > maxBitmapPhys {
		return false
	}
	// A bitmap in use may be of any size; it is not loaded.
	return flags&bitmapFlagInUse != 0 || size <= (phys*8)<<granBits
}

// qcow2Bitmaps lists the image's persistent dirty bitmaps as QEMU's
// qcow2_get_bitmap_info_list does, for info's "bitmaps": each a QDict of
// name, granularity and flags ("in-use", "auto"). It returns nil when the
// image has none, or when the bitmaps autoclear bit is clear (QEMU then
// considers them inconsistent and ignores them).
//
// It reads the directory itself rather than take (*qcow2.Image).Bitmaps:
// the engine leaves a broken directory aside and serves the image, while
// qemu-img refuses to open it, with the messages this returns.
func qcow2Bitmaps(path string, h *qcow2.Header) ([]any, error) {
	if h.AutoclearFeatures&qcow2.AutoclearBitmaps == 0 {
		return nil, nil
	}
	var ext []byte
	for _, e := range h.Extensions {
		if e.Type == extBitmaps {
			ext = e.Data
		}
	}
	if len(ext) < bitmapsExtLen {
		return nil, nil
	}
	be := binary.BigEndian
	n := be.Uint32(ext[0:])
	dirSize := be.Uint64(ext[8:])
	dirOff := be.Uint64(ext[16:])
	if n == 0 {
		return nil, nil
	}
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, err
	}
	fileSize := uint64(st.Size())
	switch {
	case n > maxBitmaps:
		return nil, fmt.Errorf("bitmaps: %d bitmaps exceed %d", n, maxBitmaps)
	case dirSize > maxBitmapDirectory:
		return nil, fmt.Errorf("bitmaps: directory of %d bytes for %d bitmaps", dirSize, n)
	case dirOff%uint64(h.ClusterSize()) != 0 || dirOff > fileSize || dirSize > fileSize-dirOff:
		return nil, fmt.Errorf("bitmaps: directory at %#x (%d bytes) is outside the file", dirOff, dirSize)
	}
	dir := make([]byte, dirSize)
	if _, err := f.ReadAt(dir, int64(dirOff)); err != nil {
		return nil, fmt.Errorf("bitmaps: read directory at %#x: %w", dirOff, err)
	}
	// Entry by entry as QEMU's bitmap_list_load, with its messages: QEMU
	// does not open an image whose directory breaks these rules.
	var list []any
	count := uint32(0)
	for off := uint64(0); off < dirSize; {
		if dirSize-off < bitmapEntryLen {
			return nil, errBrokenBitmapDir
		}
		if count++; count > n {
			return nil, fmt.Errorf("More bitmaps found than specified in header extension")
		}
		e := dir[off:]
		flags := be.Uint32(e[12:])
		granBits := e[17]
		nameLen := uint64(be.Uint16(e[18:]))
		extraLen := uint64(be.Uint32(e[20:]))
		size := (bitmapEntryLen + extraLen + nameLen + 7) &^ 7
		if size > dirSize-off {
			return nil, errBrokenBitmapDir
		}
		if extraLen != 0 {
			return nil, fmt.Errorf("Bitmap extra data is not supported")
		}
		name := string(e[bitmapEntryLen : bitmapEntryLen+nameLen])
		if !bitmapEntryValid(e, uint64(h.ClusterSize()), h.Size) {
			return nil, fmt.Errorf("Bitmap '%s' doesn't satisfy the constraints", name)
		}
		var fl []any
		if flags&bitmapFlagInUse != 0 {
			fl = append(fl, "in-use")
		}
		if flags&bitmapFlagAuto != 0 {
			fl = append(fl, "auto")
		}
		if fl == nil {
			fl = []any{}
		}
		d := newQDict()
		d.put("name", name)
		d.put("granularity", int64(1)<<granBits)
		d.put("flags", fl)
		list = append(list, d)
		off += size
	}
	if count != n {
		return nil, fmt.Errorf("Less bitmaps found than specified in header extension")
	}
	return list, nil
}
