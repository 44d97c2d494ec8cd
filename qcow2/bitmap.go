package qcow2

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math/bits"
	"sync"
	"sync/atomic"

	"github.com/ovis-storage/ovis/block"
)

// Persistent dirty bitmaps: the bitmaps extension (docs/interop/qcow2.rst).
// The extension points at a directory of bitmaps; each bitmap has a table
// of clusters that hold its bits (entry 0: all clear; 1: all set).
//
// ovis keeps them as QEMU does:
//   - a read-only image only lists them and reads their bits;
//   - a writable image leaves them alone until its first write. Then every
//     enabled ("auto") bitmap is loaded and flagged in-use on disk, durably,
//     before the write goes ahead; each write sets the bits it covers; and
//     Close stores the bits and clears the flag. A crash leaves the flag
//     set, which tells QEMU (and ovis) that the bitmap cannot be trusted.
//   - changes (add, remove, clear, enable, merge, resize) write new bitmap
//     clusters, tables and a new directory before the header points at
//     them, and free the old ones afterwards, so a crash leaks at worst.
//
// Locking: bm.mu guards the list and the bits while writes run; the
// exclusive operations (which run with no I/O in flight) change bitmaps
// without it and replace the list under it. bm.mu is a leaf: nothing is
// locked, and no lock is waited for, while it is held.

// Bitmap describes one persistent dirty bitmap.
type Bitmap struct {
	Name string
	// Granularity is how many bytes of the disk one bit covers.
	Granularity int64
	// InUse: a writer had the bitmap open and did not store it (QEMU's
	// "in-use" flag); its bits cannot be trusted.
	InUse bool
	// Auto: the bitmap is enabled and records writes (QEMU's "auto").
	Auto bool
}

// Limits and flags of the bitmaps extension (QEMU's block/qcow2-bitmap.c).
const (
	bitmapsExtLen        = 24
	bitmapEntryLen       = 24
	maxBitmaps           = 65535
	maxBitmapDirectory   = maxBitmaps * 1024
	maxBitmapNameLen     = 1023
	maxBitmapTableSize   = 0x8000000
	minBitmapGranBits    = 9
	maxBitmapGranBits    = 31
	bitmapFlagInUse      = 1 << 0
	bitmapFlagAuto       = 1 << 1
	bitmapFlagExtraCompa = 1 << 2
	bitmapFlagsKnown     = bitmapFlagInUse | bitmapFlagAuto | bitmapFlagExtraCompa
	bitmapTypeDirty      = 1
	bitmapTableAllOnes   = 1
	// maxTrackedBitmapBytes bounds the memory that tracking writes may
	// take (the bits of every enabled bitmap); an image that needs more
	// has its bitmaps dropped (autoclear bit cleared) instead.
	maxTrackedBitmapBytes = 256 << 20
)

// Errors of the bitmap operations, in QEMU's words.
var (
	ErrBitmapNotFound = errors.New("bitmap not found")
	ErrBitmapExists   = errors.New("bitmap already exists")
	ErrBitmapInUse    = errors.New("bitmap is inconsistent")
)

// BitmapError is a bitmap operation's failure about one named bitmap;
// Err is ErrBitmapNotFound, ErrBitmapExists or ErrBitmapInUse.
type BitmapError struct {
	Err  error
	Name string
}

func (e *BitmapError) Error() string { return fmt.Sprintf("qcow2: %v: %q", e.Err, e.Name) }
func (e *BitmapError) Unwrap() error { return e.Err }

// bitmap is one directory entry, and its bits once loaded.
type bitmap struct {
	Bitmap
	tableOff  uint64
	tableSize uint32
	flags     uint32 // as stored, unknown bits included
	typ       uint8
	extra     []byte
	// bits, when loaded, hold the bitmap: bit i (byte i/8, bit i%8 from
	// the least significant) covers bytes [i*Granularity, (i+1)*Granularity).
	bits []byte
	// changed: bits differ from what the table holds.
	changed bool
	// tracking: writes set bits (an enabled bitmap of a written image).
	tracking bool
	// flagged: this Image set the in-use flag on disk, and Close clears
	// it.
	flagged bool
}

// bitmapState is an image's bitmaps.
type bitmapState struct {
	mu   sync.Mutex
	list []*bitmap
	// dirOff and dirSize locate the directory on disk.
	dirOff, dirSize uint64
	// pending: the image is writable and has enabled bitmaps that the
	// first write must load and flag in-use.
	pending atomic.Bool
	// tracking: writes set bits of the tracked bitmaps.
	tracking atomic.Bool
}

// bitCount is how many bits a bitmap of granularity g has for size bytes.
func bitCount(size, g int64) int64 { return (size + g - 1) / g }

// tableEntriesFor is how many table entries a bitmap of granularity g
// needs for size bytes.
func (img *Image) tableEntriesFor(size, g int64) int64 {
	bytes := (bitCount(size, g) + 7) / 8
	return (bytes + img.clusterSize - 1) / img.clusterSize
}

// bitmapExt returns the bitmaps extension's data, or nil.
func (img *Image) bitmapExt() []byte {
	for _, e := range img.hdr.Extensions {
		if e.Type == extBitmaps {
			return e.Data
		}
	}
	return nil
}

// loadBitmapDirectory reads and checks the directory, when the header
// has a bitmaps extension and its autoclear bit.
func (img *Image) loadBitmapDirectory(fileSize int64) error {
	ext := img.bitmapExt()
	if ext == nil || img.hdr.AutoclearFeatures&AutoclearBitmaps == 0 {
		return nil
	}
	if len(ext) < bitmapsExtLen {
		return corruptf("bitmaps extension of %d bytes", len(ext))
	}
	be := binary.BigEndian
	n := be.Uint32(ext[0:])
	dirSize, dirOff := be.Uint64(ext[8:]), be.Uint64(ext[16:])
	switch {
	case n == 0 || n > maxBitmaps:
		return corruptf("bitmaps extension lists %d bitmaps", n)
	case dirSize > maxBitmapDirectory || dirSize < uint64(n)*bitmapEntryLen:
		return corruptf("bitmap directory of %d bytes for %d bitmaps", dirSize, n)
	}
	if err := checkTable("bitmap directory", dirOff, dirSize, img.clusterSize, fileSize); err != nil {
		return err
	}
	dir := make([]byte, dirSize)
	if err := block.ReadFull(img.file, dir, int64(dirOff)); err != nil {
		return fmt.Errorf("qcow2: bitmap directory at %#x: %w", dirOff, err)
	}
	var list []*bitmap
	names := map[string]bool{}
	p := uint64(0)
	for i := uint32(0); i < n; i++ {
		if dirSize-p < bitmapEntryLen {
			return corruptf("bitmap directory entry %d runs past the directory", i)
		}
		e := dir[p:]
		b := &bitmap{
			tableOff:  be.Uint64(e[0:]),
			tableSize: be.Uint32(e[8:]),
			flags:     be.Uint32(e[12:]),
			typ:       e[16],
		}
		granBits := e[17]
		nameLen, extraLen := uint64(be.Uint16(e[18:])), uint64(be.Uint32(e[20:]))
		end := bitmapEntryLen + extraLen + nameLen
		if end > dirSize-p {
			return corruptf("bitmap directory entry %d runs past the directory", i)
		}
		b.extra = append([]byte(nil), e[bitmapEntryLen:bitmapEntryLen+extraLen]...)
		b.Name = string(e[bitmapEntryLen+extraLen : end])
		b.InUse = b.flags&bitmapFlagInUse != 0
		b.Auto = b.flags&bitmapFlagAuto != 0
		switch {
		case b.typ != bitmapTypeDirty:
			return corruptf("bitmap %q has type %d", b.Name, b.typ)
		case granBits < minBitmapGranBits || granBits > maxBitmapGranBits:
			return corruptf("bitmap %q has granularity 2^%d", b.Name, granBits)
		case nameLen == 0 || nameLen > maxBitmapNameLen || names[b.Name]:
			return corruptf("bitmap directory entry %d has a bad or repeated name", i)
		case b.tableSize > maxBitmapTableSize:
			return corruptf("bitmap %q has a table of %d entries", b.Name, b.tableSize)
		}
		b.Granularity = 1 << granBits
		if want := img.tableEntriesFor(img.size, b.Granularity); !b.InUse && int64(b.tableSize) != want {
			return corruptf("bitmap %q has a table of %d entries for %d", b.Name, b.tableSize, want)
		}
		if err := checkTable("bitmap table", b.tableOff, uint64(b.tableSize)*8, img.clusterSize, fileSize); err != nil {
			return err
		}
		names[b.Name] = true
		list = append(list, b)
		p += (end + 7) &^ 7
	}
	img.bm.list, img.bm.dirOff, img.bm.dirSize = list, dirOff, dirSize
	return nil
}

// Bitmaps lists the image's persistent dirty bitmaps in directory order.
// An image whose bitmaps autoclear bit is clear has none (QEMU ignores
// them).
func (img *Image) Bitmaps() []Bitmap {
	img.bm.mu.Lock()
	defer img.bm.mu.Unlock()
	out := make([]Bitmap, len(img.bm.list))
	for i, b := range img.bm.list {
		out[i] = b.Bitmap
	}
	return out
}

// findBitmap returns the bitmap named name, or nil.
func (img *Image) findBitmap(name string) *bitmap {
	for _, b := range img.bm.list {
		if b.Name == name {
			return b
		}
	}
	return nil
}

// readBitmapTable reads a bitmap's table.
func (img *Image) readBitmapTable(b *bitmap) ([]uint64, error) {
	buf := make([]byte, int64(b.tableSize)*8)
	if err := block.ReadFull(img.file, buf, int64(b.tableOff)); err != nil {
		return nil, fmt.Errorf("qcow2: table of bitmap %q at %#x: %w", b.Name, b.tableOff, err)
	}
	t := make([]uint64, b.tableSize)
	for i := range t {
		t[i] = binary.BigEndian.Uint64(buf[i*8:])
	}
	return t, nil
}

// readBits returns a bitmap's bits, as loaded or from its clusters.
func (img *Image) readBits(b *bitmap) ([]byte, error) {
	if b.bits != nil {
		return b.bits, nil
	}
	if b.InUse {
		return nil, &BitmapError{ErrBitmapInUse, b.Name}
	}
	n := (bitCount(img.size, b.Granularity) + 7) / 8
	if n > maxTrackedBitmapBytes {
		return nil, fmt.Errorf("qcow2: bitmap %q needs %d bytes of memory, more than %d", b.Name, n, maxTrackedBitmapBytes)
	}
	out := make([]byte, n)
	t, err := img.readBitmapTable(b)
	if err != nil {
		return nil, err
	}
	fileSize, err := img.file.Size()
	if err != nil {
		return nil, err
	}
	for i, e := range t {
		chunk := out[min(int64(i)*img.clusterSize, n):min(int64(i+1)*img.clusterSize, n)]
		off := e & l2OffsetMask
		switch {
		case e&^(l2OffsetMask|bitmapTableAllOnes) != 0:
			return nil, corruptf("bitmap %q: table entry %d is %#x", b.Name, i, e)
		case off == 0 && e&bitmapTableAllOnes != 0:
			for j := range chunk {
				chunk[j] = 0xff
			}
		case off == 0:
		default:
			if err := checkTable("bitmap data", off, uint64(img.clusterSize), img.clusterSize, fileSize); err != nil {
				return nil, err
			}
			if err := block.ReadFull(img.file, chunk, int64(off)); err != nil {
				return nil, fmt.Errorf("qcow2: data of bitmap %q at %#x: %w", b.Name, off, err)
			}
		}
	}
	return out, nil
}

// setBits sets the bits that cover [off, off+n) of the disk.
func setBits(bm []byte, g, off, n int64) {
	if n <= 0 {
		return
	}
	first, last := off/g, (off+n-1)/g
	for i := first; i <= last && i/8 < int64(len(bm)); {
		if i%8 == 0 && last-i >= 7 {
			// Whole bytes at a time.
			j := i / 8
			k := min((last+1)/8, int64(len(bm)))
			for ; j < k; j++ {
				bm[j] = 0xff
			}
			i = j * 8
			continue
		}
		bm[i/8] |= 1 << (i % 8)
		i++
	}
}

// markBitmaps records a write of [off, off+n) in the tracked bitmaps.
func (img *Image) markBitmaps(off, n int64) {
	if !img.bm.tracking.Load() {
		return
	}
	img.bm.mu.Lock()
	defer img.bm.mu.Unlock()
	for _, b := range img.bm.list {
		if b.tracking {
			setBits(b.bits, b.Granularity, off, n)
			b.changed = true
		}
	}
}

// startBitmaps runs before the first write of a writable image with
// enabled bitmaps: it loads them and flags them in-use on disk (the
// directory is rewritten in place, as QEMU does for this flag) and synced
// before the write may land. When that cannot be done the caller drops
// the image's bitmaps instead.
func (img *Image) startBitmaps() error {
	img.bm.mu.Lock()
	defer img.bm.mu.Unlock()
	if !img.bm.pending.Load() {
		return nil
	}
	var need int64
	for _, b := range img.bm.list {
		if b.Auto && !b.InUse {
			need += (bitCount(img.size, b.Granularity) + 7) / 8
		}
	}
	if need > maxTrackedBitmapBytes {
		return fmt.Errorf("qcow2: tracking the enabled bitmaps needs %d bytes of memory, more than %d", need, maxTrackedBitmapBytes)
	}
	for _, b := range img.bm.list {
		if !b.Auto || b.InUse {
			continue
		}
		bits, err := img.readBits(b)
		if err != nil {
			return err
		}
		b.bits = bits
	}
	for _, b := range img.bm.list {
		if b.Auto && !b.InUse {
			b.InUse, b.tracking, b.flagged = true, true, true
			b.flags |= bitmapFlagInUse
		}
	}
	dir := img.encodeBitmapDirectory(img.bm.list)
	if uint64(len(dir)) != img.bm.dirSize {
		return fmt.Errorf("qcow2: bitmap directory re-encodes to %d bytes, not %d", len(dir), img.bm.dirSize)
	}
	if _, err := img.file.WriteAt(dir, int64(img.bm.dirOff)); err != nil {
		return fmt.Errorf("qcow2: flagging bitmaps in use: %w", err)
	}
	if err := img.file.Sync(); err != nil {
		return fmt.Errorf("qcow2: flagging bitmaps in use: %w", err)
	}
	img.bm.pending.Store(false)
	img.bm.tracking.Store(true)
	return nil
}

// dropBitmapsLocked clears the bitmaps autoclear bit, so that QEMU ignores
// (and drops) bitmaps that ovis could not keep. With flushMu and mu held.
func (img *Image) dropBitmapsLocked() error {
	img.bm.pending.Store(false)
	img.bm.mu.Lock()
	img.bm.list = nil
	img.bm.mu.Unlock()
	img.hdr.AutoclearFeatures &^= AutoclearBitmaps
	return img.writeHeaderLocked()
}

// encodeBitmapDirectory encodes a directory for list.
func (img *Image) encodeBitmapDirectory(list []*bitmap) []byte {
	var dir []byte
	be := binary.BigEndian
	for _, b := range list {
		e := make([]byte, bitmapEntryLen, (bitmapEntryLen+len(b.extra)+len(b.Name)+7)&^7)
		be.PutUint64(e[0:], b.tableOff)
		be.PutUint32(e[8:], b.tableSize)
		be.PutUint32(e[12:], b.flags)
		e[16] = b.typ
		e[17] = uint8(bits.TrailingZeros64(uint64(b.Granularity)))
		be.PutUint16(e[18:], uint16(len(b.Name)))
		be.PutUint32(e[20:], uint32(len(b.extra)))
		e = append(append(e, b.extra...), b.Name...)
		for len(e)%8 != 0 {
			e = append(e, 0)
		}
		dir = append(dir, e...)
	}
	return dir
}

// storeBitmapsLocked makes list the image's bitmaps: the bits of every
// loaded bitmap that changed go to new clusters under a new table, the
// directory is written anew, the header points at it, and what the old
// directory alone referenced is freed. Inside exclusive.
func (img *Image) storeBitmapsLocked(list []*bitmap) error {
	old := img.bm.list
	var frees [][2]uint64 // offset, length
	for _, b := range list {
		if b.bits == nil || !b.changed {
			continue
		}
		n := img.tableEntriesFor(img.size, b.Granularity)
		table := make([]byte, n*8)
		for i := int64(0); i < n; i++ {
			chunk := b.bits[min(i*img.clusterSize, int64(len(b.bits))):min((i+1)*img.clusterSize, int64(len(b.bits)))]
			if block.IsZero(chunk) {
				continue
			}
			buf := make([]byte, img.clusterSize)
			copy(buf, chunk)
			off, err := img.writeNewLocked("bitmap data", buf)
			if err != nil {
				return err
			}
			binary.BigEndian.PutUint64(table[i*8:], off)
		}
		// The old table and its clusters go once the new directory is in
		// place.
		oldFrees, err := img.bitmapClusters(b)
		if err != nil {
			return err
		}
		frees = append(frees, oldFrees...)
		off, err := img.writeNewLocked("bitmap table", table)
		if err != nil {
			return err
		}
		b.tableOff, b.tableSize, b.changed = off, uint32(n), false
	}
	// A bitmap in old but not in list goes, with its table and clusters.
	for _, b := range old {
		if img.keeps(list, b) {
			continue
		}
		oldFrees, err := img.bitmapClusters(b)
		if err != nil {
			return err
		}
		frees = append(frees, oldFrees...)
	}
	var dirOff uint64
	dir := img.encodeBitmapDirectory(list)
	if len(list) > 0 {
		var err error
		if dirOff, err = img.writeNewLocked("bitmap directory", dir); err != nil {
			return err
		}
	}
	// The new clusters are counted and written before the header points
	// at them.
	if err := img.flushExclusiveLocked(); err != nil {
		return err
	}
	if img.bm.dirOff != 0 {
		frees = append(frees, [2]uint64{img.bm.dirOff, img.bm.dirSize})
	}
	img.setBitmapExt(list, dirOff, uint64(len(dir)))
	if err := img.writeHeaderLocked(); err != nil {
		return err
	}
	img.bm.mu.Lock()
	img.bm.list, img.bm.dirOff, img.bm.dirSize = list, dirOff, uint64(len(dir))
	img.bm.mu.Unlock()
	for _, f := range frees {
		img.freeRangeLocked(f[0], int64(f[1]))
	}
	return img.flushExclusiveLocked()
}

// bitmapClusters lists what bitmap b's table holds a reference to: its
// data clusters and the table itself, as (offset, length) pairs. Entries
// that are misaligned or point past the end of the file (a damaged table)
// are left out: freeing them could free someone else's cluster, while
// leaving them out only leaks.
func (img *Image) bitmapClusters(b *bitmap) ([][2]uint64, error) {
	if b.tableOff == 0 {
		return nil, nil
	}
	t, err := img.readBitmapTable(b)
	if err != nil {
		return nil, err
	}
	fileSize, err := img.file.Size()
	if err != nil {
		return nil, err
	}
	var out [][2]uint64
	for _, e := range t {
		off := e & l2OffsetMask
		if off != 0 && off%uint64(img.clusterSize) == 0 && off+uint64(img.clusterSize) <= uint64(fileSize) {
			out = append(out, [2]uint64{off, uint64(img.clusterSize)})
		}
	}
	return append(out, [2]uint64{b.tableOff, uint64(b.tableSize) * 8}), nil
}

// keeps reports whether list still holds b with the same table.
func (img *Image) keeps(list []*bitmap, b *bitmap) bool {
	for _, k := range list {
		if k == b {
			return true
		}
	}
	return false
}

// setBitmapExt points the header's bitmaps extension at a directory, or
// removes it (and the autoclear bit) when list is empty.
func (img *Image) setBitmapExt(list []*bitmap, dirOff, dirSize uint64) {
	exts := img.hdr.Extensions[:0:0]
	for _, e := range img.hdr.Extensions {
		if e.Type != extBitmaps {
			exts = append(exts, e)
		}
	}
	if len(list) == 0 {
		img.hdr.Extensions = exts
		img.hdr.AutoclearFeatures &^= AutoclearBitmaps
		return
	}
	data := make([]byte, bitmapsExtLen)
	binary.BigEndian.PutUint32(data[0:], uint32(len(list)))
	binary.BigEndian.PutUint64(data[8:], dirSize)
	binary.BigEndian.PutUint64(data[16:], dirOff)
	img.hdr.Extensions = append(exts, Extension{Type: extBitmaps, Data: data})
	img.hdr.AutoclearFeatures |= AutoclearBitmaps
}

// storeOnCloseLocked stores the tracked bitmaps with their in-use flag
// cleared. Inside exclusive, from Close.
func (img *Image) storeOnCloseLocked() error {
	if !img.bm.tracking.Load() {
		return nil
	}
	img.bm.tracking.Store(false)
	list := append([]*bitmap(nil), img.bm.list...)
	for _, b := range list {
		if b.flagged {
			b.InUse, b.tracking, b.flagged, b.changed = false, false, false, true
			b.flags &^= bitmapFlagInUse
		}
	}
	return img.storeBitmapsLocked(list)
}

// DefaultBitmapGranularity is QEMU's default for a new bitmap: the
// cluster size, and at least 4 KiB.
func (img *Image) DefaultBitmapGranularity() int64 { return max(4096, img.clusterSize) }

// AddBitmap adds an empty persistent bitmap, enabled unless disabled, as
// qemu-img bitmap --add does. granularity 0 is the default.
func (img *Image) AddBitmap(ctx context.Context, name string, granularity int64, disabled bool) error {
	return img.exclusive(ctx, func() error {
		if granularity == 0 {
			granularity = img.DefaultBitmapGranularity()
		}
		switch {
		case granularity < 512 || granularity&(granularity-1) != 0 || granularity > 1<<maxBitmapGranBits:
			return errors.New("Granularity must be power of 2 and at least 512")
		case img.findBitmap(name) != nil:
			return &BitmapError{ErrBitmapExists, name}
		case !img.v3:
			return errors.New("Cannot store dirty bitmaps in qcow2 v2 files")
		case len(img.bm.list) >= maxBitmaps:
			return errors.New("Maximum number of persistent bitmaps is already reached")
		case len(name) > maxBitmapNameLen:
			return fmt.Errorf("Bitmap name is too long, max %d bytes", maxBitmapNameLen)
		case name == "":
			return errors.New("Bitmap name cannot be empty")
		}
		b := &bitmap{
			Bitmap:  Bitmap{Name: name, Granularity: granularity, Auto: !disabled},
			typ:     bitmapTypeDirty,
			bits:    make([]byte, (bitCount(img.size, granularity)+7)/8),
			changed: true,
		}
		if b.Auto {
			b.flags = bitmapFlagAuto
			// The next write flags it in-use and starts recording.
			defer img.bm.pending.Store(true)
		}
		return img.storeBitmapsLocked(append(append([]*bitmap(nil), img.bm.list...), b))
	})
}

// RemoveBitmap removes a bitmap and frees its clusters.
func (img *Image) RemoveBitmap(ctx context.Context, name string) error {
	return img.exclusive(ctx, func() error {
		b := img.findBitmap(name)
		if b == nil {
			return &BitmapError{ErrBitmapNotFound, name}
		}
		var list []*bitmap
		for _, k := range img.bm.list {
			if k != b {
				list = append(list, k)
			}
		}
		return img.storeBitmapsLocked(list)
	})
}

// ClearBitmap clears every bit of a bitmap.
func (img *Image) ClearBitmap(ctx context.Context, name string) error {
	return img.changeBitmap(ctx, name, func(b *bitmap) error {
		b.bits = make([]byte, (bitCount(img.size, b.Granularity)+7)/8)
		b.changed = true
		return nil
	})
}

// SetBitmapEnabled enables (auto) or disables a bitmap.
func (img *Image) SetBitmapEnabled(ctx context.Context, name string, on bool) error {
	return img.changeBitmap(ctx, name, func(b *bitmap) error {
		b.Auto = on
		if on {
			b.flags |= bitmapFlagAuto
			if !b.flagged {
				img.bm.pending.Store(true)
			}
		} else {
			b.flags &^= bitmapFlagAuto
		}
		b.tracking = on && b.flagged
		return nil
	})
}

// BitmapBits returns a copy of a bitmap's bits (bit i, byte i/8 from the
// least significant bit, covers granularity bytes from i*granularity) and
// its granularity.
func (img *Image) BitmapBits(name string) (bitmap []byte, granularity int64, err error) {
	img.gate.RLock()
	defer img.gate.RUnlock()
	img.bm.mu.Lock()
	defer img.bm.mu.Unlock()
	b := img.findBitmap(name)
	if b == nil {
		return nil, 0, &BitmapError{ErrBitmapNotFound, name}
	}
	bits, err := img.readBits(b)
	if err != nil {
		return nil, 0, err
	}
	return append([]byte(nil), bits...), b.Granularity, nil
}

// MergeBitmap sets in bitmap name every bit that covers a range set in
// src, a bitmap of granularity srcGran over the same disk, as qemu-img
// bitmap --merge does.
func (img *Image) MergeBitmap(ctx context.Context, name string, src []byte, srcGran int64) error {
	return img.changeBitmap(ctx, name, func(b *bitmap) error {
		dst, err := img.readBits(b)
		if err != nil {
			return err
		}
		for i := int64(0); i < int64(len(src))*8; i++ {
			if src[i/8] == 0 {
				i += 7 - i%8
				continue
			}
			if src[i/8]&(1<<(i%8)) != 0 && i*srcGran < img.size {
				setBits(dst, b.Granularity, i*srcGran, min(srcGran, img.size-i*srcGran))
			}
		}
		b.bits, b.changed = dst, true
		return nil
	})
}

// changeBitmap applies fn to bitmap name and stores the result.
func (img *Image) changeBitmap(ctx context.Context, name string, fn func(*bitmap) error) error {
	return img.exclusive(ctx, func() error {
		b := img.findBitmap(name)
		switch {
		case b == nil:
			return &BitmapError{ErrBitmapNotFound, name}
		case b.InUse && !b.flagged:
			return &BitmapError{ErrBitmapInUse, name}
		}
		if err := fn(b); err != nil {
			return err
		}
		return img.storeBitmapsLocked(append([]*bitmap(nil), img.bm.list...))
	})
}

// resizeBitmapsLocked loads every consistent bitmap before a resize to
// size bytes and returns a function that stores them at the new size
// (bits past the old end clear), as QEMU resizes persistent bitmaps.
// In-use bitmaps keep their (untrusted) tables. Inside exclusive.
func (img *Image) resizeBitmapsLocked(size int64) (store func() error, err error) {
	if len(img.bm.list) == 0 {
		return func() error { return nil }, nil
	}
	for _, b := range img.bm.list {
		if b.InUse && !b.flagged {
			continue
		}
		bits, err := img.readBits(b)
		if err != nil {
			return nil, err
		}
		n := (bitCount(size, b.Granularity) + 7) / 8
		nb := make([]byte, n)
		copy(nb, bits)
		if r := bitCount(size, b.Granularity) % 8; r != 0 && len(nb) > 0 && int64(len(bits)) >= n {
			nb[n-1] &= byte(1)<<r - 1 // bits past the new end
		}
		b.bits, b.changed = nb, true
	}
	return func() error { return img.storeBitmapsLocked(append([]*bitmap(nil), img.bm.list...)) }, nil
}

// markAllBitmapsLocked sets every bit of the enabled bitmaps, after
// flagging them in-use, before an operation that may change any cluster
// (applying a snapshot). Inside exclusive.
func (img *Image) markAllBitmapsLocked() error {
	if img.bm.pending.Load() {
		if err := img.startBitmaps(); err != nil {
			return img.dropBitmapsLocked()
		}
	}
	img.markBitmaps(0, img.size)
	return nil
}

// BitmapExtent describes the run of equal dirtiness of bitmap name that
// starts at off, at most n bytes long (and not past the disk's end), for
// exporting it (qemu-nbd -B). The bits are those writes set so far: the
// first call loads them and keeps them.
func (img *Image) BitmapExtent(name string, off, n int64) (length int64, dirty bool, err error) {
	img.bm.mu.Lock()
	defer img.bm.mu.Unlock()
	b := img.findBitmap(name)
	if b == nil {
		return 0, false, &BitmapError{ErrBitmapNotFound, name}
	}
	if b.bits == nil {
		if b.bits, err = img.readBits(b); err != nil {
			return 0, false, err
		}
	}
	end := min(off+n, img.size)
	if off < 0 || off >= end {
		return 0, false, block.ErrOutOfRange
	}
	g, bm := b.Granularity, b.bits
	bit := func(i int64) bool { return bm[i/8]&(1<<(i%8)) != 0 }
	i := off / g
	dirty = bit(i)
	var whole byte
	if dirty {
		whole = 0xff
	}
	last := (end - 1) / g
	j := i + 1
	for j <= last {
		if j%8 == 0 && j+7 <= last && bm[j/8] == whole {
			j += 8 // a whole byte alike
			continue
		}
		if bit(j) != dirty {
			break
		}
		j++
	}
	return min(j*g, end) - off, dirty, nil
}
