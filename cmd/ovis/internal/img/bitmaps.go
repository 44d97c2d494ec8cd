package img

import (
	"encoding/binary"
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
)

// qcow2Bitmaps lists the image's persistent dirty bitmaps as QEMU's
// qcow2_get_bitmap_info_list does, for info's "bitmaps": each a QDict of
// name, granularity and flags ("in-use", "auto"). It returns nil when the
// image has none, or when the bitmaps autoclear bit is clear (QEMU then
// considers them inconsistent and ignores them).
//
// TODO(engine): this reads the bitmap directory itself because qcow2.Image
// does not expose bitmaps; it should become (*qcow2.Image).Bitmaps.
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
	case dirSize > maxBitmapDirectory || dirSize < uint64(n)*bitmapEntryLen:
		return nil, fmt.Errorf("bitmaps: directory of %d bytes for %d bitmaps", dirSize, n)
	case dirOff%uint64(h.ClusterSize()) != 0 || dirOff > fileSize || dirSize > fileSize-dirOff:
		return nil, fmt.Errorf("bitmaps: directory at %#x (%d bytes) is outside the file", dirOff, dirSize)
	}
	dir := make([]byte, dirSize)
	if _, err := f.ReadAt(dir, int64(dirOff)); err != nil {
		return nil, fmt.Errorf("bitmaps: read directory at %#x: %w", dirOff, err)
	}
	var list []any
	for off, i := uint64(0), uint32(0); i < n; i++ {
		if dirSize-off < bitmapEntryLen {
			return nil, fmt.Errorf("bitmaps: entry %d runs past the directory", i)
		}
		e := dir[off:]
		flags := be.Uint32(e[12:])
		granBits := e[17]
		nameLen := uint64(be.Uint16(e[18:]))
		extraLen := uint64(be.Uint32(e[20:]))
		end := bitmapEntryLen + extraLen + nameLen
		if end > dirSize-off || granBits > 63 {
			return nil, fmt.Errorf("bitmaps: entry %d at directory offset %d is malformed", i, off)
		}
		name := string(e[bitmapEntryLen+extraLen : end])
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
		off += (end + 7) &^ 7
	}
	return list, nil
}
