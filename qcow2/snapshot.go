package qcow2

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"
	"slices"
	"syscall"
)

// Snapshot table layout (docs/interop/qcow2.rst, "Snapshots") and QEMU's
// limits (block/qcow2.h).
const (
	// snapshotFixedLen is the fixed part of a table entry, bytes 0-39.
	snapshotFixedLen = 40

	// Offsets into the extra data, which starts at byte 40 of an entry.
	extraVMStateSize = 0  // entry bytes 40-47
	extraDiskSize    = 8  // entry bytes 48-55
	extraICount      = 16 // entry bytes 56-63

	// snapshotExtraV3 is how much extra data version 3 requires: up to
	// and including the disk size, entry byte 55.
	snapshotExtraV3 = extraDiskSize + 8

	// maxSnapshotExtra is QCOW_MAX_SNAPSHOT_EXTRA_DATA: QEMU refuses
	// images with more extra data in an entry.
	maxSnapshotExtra = 1024

	// maxSnapshotTableBytes is QCOW_MAX_SNAPSHOTS_SIZE, an average of
	// 1 KiB per entry for the largest number of snapshots.
	maxSnapshotTableBytes = 1024 * maxSnapshots

	// maxSnapshotString is the longest ID or name the 16-bit length
	// fields can describe.
	maxSnapshotString = math.MaxUint16
)

// Snapshot is one entry of the internal snapshot table.
type Snapshot struct {
	// L1TableOffset is the host offset of the snapshot's L1 table; it
	// is cluster aligned.
	L1TableOffset uint64
	// L1Size is the number of entries in the snapshot's L1 table.
	L1Size uint32

	// ID is the snapshot's unique ID string and Name its name. Neither
	// is NUL-terminated on disk and either may be up to 65535 bytes.
	ID, Name string

	// DateSec and DateNsec are the wall-clock time the snapshot was
	// taken, in seconds since the Unix epoch and nanoseconds.
	DateSec, DateNsec uint32
	// VMClockNsec is how long the guest had run when the snapshot was
	// taken, in nanoseconds.
	VMClockNsec uint64
	// VMStateSize is the size of the saved VM state in bytes, 0 for a
	// disk-only snapshot. It comes from the 64-bit field in the extra
	// data when that is present, else from the 32-bit field.
	VMStateSize uint64
	// DiskSize is the virtual disk size at the time of the snapshot
	// (entry bytes 48-55, in the extra data). HasDiskSize reports whether the entry
	// carries it; QEMU assumes the current virtual size when it does not.
	DiskSize    uint64
	HasDiskSize bool
	// ICount is the record/replay instruction count when the snapshot
	// was taken, -1 when icount was disabled or the entry does not carry
	// it. A new Snapshot should set it to -1.
	ICount int64

	// Extra is the entry's whole raw extra data, entry bytes 40 and up,
	// so that fields ovis does not know survive a rewrite of the table.
	// The fields above take precedence over their bytes in Extra.
	Extra []byte
}

// parseSnapshotTable reads the n entries of the snapshot table at host
// offset off of an image file of fileSize bytes with clusters of
// clusterSize bytes.
//
// Everything is checked against the file before it is allocated: the
// table must start on a cluster boundary inside the file and end inside
// it and within QEMU's 64 MiB limit, an entry may carry at most 1024 bytes
// of extra data, and each snapshot's L1 table must be cluster aligned, at
// most 32 MiB and inside the file. Violations yield a *CorruptError naming
// the entry and its offset; read failures are returned wrapped.
func parseSnapshotTable(r io.ReaderAt, off uint64, n uint32, clusterSize, fileSize int64) ([]Snapshot, error) {
	if n == 0 {
		return nil, nil
	}
	if clusterSize <= 0 || clusterSize&(clusterSize-1) != 0 {
		return nil, fmt.Errorf("qcow2: snapshot table: invalid cluster size %d", clusterSize)
	}
	fileSize = max(fileSize, 0)
	if n > maxSnapshots {
		return nil, corruptf("snapshot table: %d snapshots exceed %d", n, maxSnapshots)
	}
	if off%uint64(clusterSize) != 0 {
		return nil, corruptf("snapshot table: offset %#x is not cluster aligned", off)
	}
	if off == 0 {
		return nil, corruptf("snapshot table: offset 0 overlaps the image header")
	}
	// Each entry takes at least its fixed part, so n is bounded by the
	// file before anything is allocated for it.
	if off >= uint64(fileSize) || uint64(n)*snapshotFixedLen > uint64(fileSize)-off {
		return nil, corruptf("snapshot table: %d entries at %#x run past the end of the file (%d bytes)", n, off, fileSize)
	}
	avail := fileSize - int64(off)
	t := &snapshotReader{
		off:    off,
		limit:  min(avail, maxSnapshotTableBytes),
		capped: avail > maxSnapshotTableBytes,
	}
	t.br = bufio.NewReaderSize(io.NewSectionReader(r, int64(off), t.limit), int(min(t.limit, 64<<10)))

	snaps := make([]Snapshot, 0, n)
	var fixed [snapshotFixedLen]byte
	var strs []byte // ID and name of the entry being read
	for i := range n {
		t.entry = i
		// Every entry starts on an 8-byte boundary.
		if err := t.read(nil, -t.pos&7); err != nil {
			return nil, err
		}
		at := off + uint64(t.pos)
		if err := t.read(fixed[:], snapshotFixedLen); err != nil {
			return nil, err
		}
		s, idLen, nameLen, extraLen := decodeSnapshotFixed(fixed[:])
		if extraLen > maxSnapshotExtra {
			return nil, corruptf("snapshot %d at %#x: %d bytes of extra data exceed %d", i, at, extraLen, maxSnapshotExtra)
		}

		// At most 1024 + 2*65535 bytes, allocated only once the file is
		// known to hold them.
		if err := t.check(extraLen + idLen + nameLen); err != nil {
			return nil, err
		}
		if extraLen > 0 {
			s.Extra = make([]byte, extraLen)
			if err := t.read(s.Extra, extraLen); err != nil {
				return nil, err
			}
		}
		if cap(strs) < int(idLen+nameLen) {
			strs = make([]byte, idLen+nameLen)
		}
		strs = strs[:idLen+nameLen]
		if err := t.read(strs, idLen+nameLen); err != nil {
			return nil, err
		}
		s.ID = string(strs[:idLen])
		s.Name = string(strs[idLen:])

		s.decodeExtra()

		if err := checkSnapshotL1(&s, i, at, clusterSize, fileSize); err != nil {
			return nil, err
		}
		snaps = append(snaps, s)
	}
	return snaps, nil
}

// snapshotReader reads a snapshot table sequentially, keeping every read
// within the file and within QEMU's limit on the table size.
type snapshotReader struct {
	br     *bufio.Reader
	off    uint64 // host offset of the table
	pos    int64  // offset in the table
	limit  int64  // how much of the table may be read
	capped bool   // limit is QEMU's limit rather than the end of the file
	entry  uint32 // the entry being read, for errors
}

// check reports a *CorruptError if n more bytes do not fit the table.
func (t *snapshotReader) check(n int64) error {
	if n <= t.limit-t.pos {
		return nil
	}
	at := t.off + uint64(t.pos)
	if t.capped {
		return corruptf("snapshot %d at %#x: snapshot table exceeds %d bytes", t.entry, at, maxSnapshotTableBytes)
	}
	return corruptf("snapshot %d at %#x: entry runs past the end of the file", t.entry, at)
}

// read reads the next n bytes into buf, or skips them if buf is nil.
func (t *snapshotReader) read(buf []byte, n int64) error {
	if n == 0 {
		return nil
	}
	if err := t.check(n); err != nil {
		return err
	}
	var err error
	if buf == nil {
		_, err = t.br.Discard(int(n))
	} else {
		_, err = io.ReadFull(t.br, buf[:n])
	}
	if err != nil {
		if errors.Is(err, io.EOF) {
			// The file is shorter than the caller said.
			err = io.ErrUnexpectedEOF
		}
		return fmt.Errorf("qcow2: reading snapshot %d at %#x: %w", t.entry, t.off+uint64(t.pos), err)
	}
	t.pos += n
	return nil
}

// checkSnapshotL1 validates the L1 table of snapshot i, whose entry is at
// host offset at.
func checkSnapshotL1(s *Snapshot, i uint32, at uint64, clusterSize, fileSize int64) error {
	l1Bytes := uint64(s.L1Size) * 8
	if l1Bytes > maxL1Bytes {
		return corruptf("snapshot %d at %#x: L1 table of %d entries exceeds %d bytes", i, at, s.L1Size, maxL1Bytes)
	}
	if s.L1TableOffset%uint64(clusterSize) != 0 {
		return corruptf("snapshot %d at %#x: L1 table offset %#x is not cluster aligned", i, at, s.L1TableOffset)
	}
	if s.L1Size > 0 && (s.L1TableOffset == 0 || s.L1TableOffset > uint64(fileSize) || l1Bytes > uint64(fileSize)-s.L1TableOffset) {
		return corruptf("snapshot %d at %#x: L1 table at %#x (%d bytes) is outside the file (%d bytes)", i, at, s.L1TableOffset, l1Bytes, fileSize)
	}
	return nil
}

// encodeSnapshotTable returns the snapshot table holding snaps, for an
// image of the given version, with every entry padded to a multiple of 8
// bytes.
//
// The extra data of an entry is Extra, grown as needed and with the known
// fields written over their bytes: the 64-bit VM state size, the disk size
// and the icount. It is grown to hold the disk size for version 3 (which
// requires it) or when HasDiskSize is set, the 64-bit VM state size when
// VMStateSize does not fit the 32-bit field, and the icount when ICount is
// not -1. Whenever the disk size is written, DiskSize is written, even if
// HasDiskSize is false; callers rewriting a table that lacked it should set
// it to the current virtual size, as QEMU does. Unknown bytes after the
// known fields are kept.
//
// As QEMU does, the 32-bit VM state size is written as 0 when VMStateSize
// does not fit, so that older readers see a disk-only snapshot rather than
// a truncated one.
//
// The entries must satisfy (*Snapshot).checkEncodable; encodeSnapshotTable
// panics otherwise.
func encodeSnapshotTable(snaps []Snapshot, version uint32) []byte {
	be := binary.BigEndian
	var b []byte
	for i := range snaps {
		s := &snaps[i]
		if err := s.checkEncodable(); err != nil {
			panic(fmt.Sprintf("qcow2: encoding snapshot %d: %v", i, err))
		}
		extra := s.encodeExtra(version)

		var fixed [snapshotFixedLen]byte
		be.PutUint64(fixed[0:], s.L1TableOffset)
		be.PutUint32(fixed[8:], s.L1Size)
		be.PutUint16(fixed[12:], uint16(len(s.ID)))
		be.PutUint16(fixed[14:], uint16(len(s.Name)))
		be.PutUint32(fixed[16:], s.DateSec)
		be.PutUint32(fixed[20:], s.DateNsec)
		be.PutUint64(fixed[24:], s.VMClockNsec)
		if s.VMStateSize <= math.MaxUint32 {
			be.PutUint32(fixed[32:], uint32(s.VMStateSize))
		}
		be.PutUint32(fixed[36:], uint32(len(extra)))

		b = append(b, fixed[:]...)
		b = append(b, extra...)
		b = append(b, s.ID...)
		b = append(b, s.Name...)
		b = append(b, make([]byte, -len(b)&7)...)
	}
	return b
}

// snapshotTableLen returns the number of bytes the table holding snaps
// occupies on disk as QEMU counts them (snapshots_size): each entry starts
// 8-byte aligned, and the last one is not padded. For a table returned by
// parseSnapshotTable it is the size of the table that was read. It never
// exceeds len(encodeSnapshotTable(snaps, v)) unless encoding grows extra
// data, which it does only for version 3 entries with fewer than 16 bytes.
func snapshotTableLen(snaps []Snapshot) int64 {
	var n int64
	for i := range snaps {
		s := &snaps[i]
		n = (n+7)&^7 + snapshotFixedLen + int64(len(s.Extra)+len(s.ID)+len(s.Name))
	}
	return n
}

// checkEncodable reports why s cannot be written to a snapshot table that
// QEMU accepts: an ID or name longer than 65535 bytes, or more than 1024
// bytes of extra data.
func (s *Snapshot) checkEncodable() error {
	switch {
	case len(s.ID) > maxSnapshotString:
		return fmt.Errorf("qcow2: snapshot ID of %d bytes exceeds %d", len(s.ID), maxSnapshotString)
	case len(s.Name) > maxSnapshotString:
		return fmt.Errorf("qcow2: snapshot name of %d bytes exceeds %d", len(s.Name), maxSnapshotString)
	case len(s.Extra) > maxSnapshotExtra:
		return fmt.Errorf("qcow2: %d bytes of snapshot extra data exceed %d", len(s.Extra), maxSnapshotExtra)
	}
	return nil
}

// decodeSnapshotFixed decodes the fixed part of a snapshot table entry
// and returns the lengths of what follows it.
func decodeSnapshotFixed(fixed []byte) (s Snapshot, idLen, nameLen, extraLen int64) {
	be := binary.BigEndian
	s = Snapshot{
		L1TableOffset: be.Uint64(fixed[0:]),
		L1Size:        be.Uint32(fixed[8:]),
		DateSec:       be.Uint32(fixed[16:]),
		DateNsec:      be.Uint32(fixed[20:]),
		VMClockNsec:   be.Uint64(fixed[24:]),
		VMStateSize:   uint64(be.Uint32(fixed[32:])),
		ICount:        -1,
	}
	return s, int64(be.Uint16(fixed[12:])), int64(be.Uint16(fixed[14:])), int64(be.Uint32(fixed[36:]))
}

// decodeExtra sets the fields s.Extra carries, as far as it is long
// enough to carry them.
func (s *Snapshot) decodeExtra() {
	be := binary.BigEndian
	n := len(s.Extra)
	if n >= extraVMStateSize+8 {
		s.VMStateSize = be.Uint64(s.Extra[extraVMStateSize:])
	}
	if n >= extraDiskSize+8 {
		s.DiskSize, s.HasDiskSize = be.Uint64(s.Extra[extraDiskSize:]), true
	}
	if n >= extraICount+8 {
		s.ICount = int64(be.Uint64(s.Extra[extraICount:]))
	}
}

// encodeExtra returns the extra data of s for an image of the given
// version; see encodeSnapshotTable.
func (s *Snapshot) encodeExtra(version uint32) []byte {
	n := len(s.Extra)
	if s.VMStateSize > math.MaxUint32 {
		n = max(n, extraVMStateSize+8)
	}
	if version >= 3 || s.HasDiskSize {
		n = max(n, snapshotExtraV3)
	}
	if s.ICount != -1 {
		n = max(n, extraICount+8)
	}
	extra := make([]byte, n)
	copy(extra, s.Extra)
	be := binary.BigEndian
	if n >= extraVMStateSize+8 {
		be.PutUint64(extra[extraVMStateSize:], s.VMStateSize)
	}
	if n >= extraDiskSize+8 {
		be.PutUint64(extra[extraDiskSize:], s.DiskSize)
	}
	if n >= extraICount+8 {
		be.PutUint64(extra[extraICount:], uint64(s.ICount))
	}
	return extra
}

// treeRefsFitLocked reports whether addTreeRefsLocked(l1, delta) (delta
// 1 or -1) would succeed, before anything is changed, so that a snapshot
// create, apply or delete fails leaving the image as it was (or, for a
// delete, its clusters leaked). A count past the refcount width or below
// zero is EINVAL, as QEMU's update_refcount fails. A referenced cluster no
// refcount block covers can only come from a corrupt entry (its refcount
// would be 0): counting it would create a block where the entry points,
// growing the file by whatever the entry names, so it is refused with
// QEMU's EAGAIN (QEMU allocates the block, leaks it and fails). Only
// inside exclusive. fromZero reports a cluster of the tree with refcount
// 0 (a corrupt image), whose count the change would make 1.
//
// Damage QEMU meets there first is a corruption event, as QEMU's
// qcow2_update_snapshot_refcount signals it: a misaligned L2 table or
// cluster, or an L2 table (whose COPIED flags are rewritten) on other
// metadata, which QEMU's overlap check refuses. delta 0 checks only that.
func (img *Image) treeRefsFitLocked(l1 []uint64, delta int64) (fromZero bool, err error) {
	adds := map[int64]uint64{}
	cs := uint64(img.clusterSize)
	// A refcount block past the end of the file reads as all free: the
	// clusters allocated next would land on metadata, and the block be
	// written where the entry points. QEMU's allocator takes cluster 0
	// then, which its overlap check refuses.
	fileSize, err := img.file.Size()
	if err != nil {
		return false, err
	}
	for i, e := range img.refTable {
		if off := e & refTableMask; off != 0 && off >= uint64(fileSize) {
			if i == 0 {
				return false, img.corruptionEventLocked("Preventing invalid write on metadata (overlaps with qcow2_header)")
			}
			return false, img.corruptionEventLocked("Refblock offset %#x beyond the end of the image (reftable index: %#x)", off, i)
		}
	}
	if err := img.metadataCountedLocked(); err != nil {
		return false, err
	}
	v := &treeVisitor{img: img}
	v.ref = func(r hostRef) error {
		switch {
		case r.kind == refL2 && r.off%cs != 0:
			return img.corruptionEventLocked("L2 table offset %#x unaligned (L1 index: %#x)", r.off, r.index)
		case r.kind == refL2:
			adds[int64(r.off>>img.clusterBits)]++
			return nil
		case r.kind == refData && r.off%cs != 0:
			return img.corruptionEventLocked("Cluster allocation offset %#x unaligned (L2 offset: %#x, L2 index: %#x)", r.off, r.table, r.index)
		}
		for _, c := range img.clustersOf(r) {
			adds[c]++
		}
		return nil
	}
	v.l2Done = func(t *l2Visit) error {
		if what := img.overlapLocked(t.off, cs, "active L2 table"); what != "" {
			return img.corruptionEventLocked("Preventing invalid write on metadata (overlaps with %s)", what)
		}
		return nil
	}
	if err := v.tree(l1, false); err != nil {
		return false, err
	}
	if delta == 0 {
		return false, nil
	}
	clusters := make([]int64, 0, len(adds))
	for c := range adds {
		clusters = append(clusters, c)
	}
	slices.Sort(clusters)
	for _, c := range clusters {
		var blk *cacheEntry
		err := img.retryExclusiveLocked(func() (err error) {
			blk, err = img.refBlockLocked(c)
			return err
		})
		if err != nil {
			return false, err
		}
		if blk == nil {
			return false, fmt.Errorf("qcow2: cluster %#x is referenced but no refcount block covers it: %w", c*img.clusterSize, syscall.EAGAIN)
		}
		rc, n := getRefcount(blk.buf, c%img.rcPerBlock, img.rcBits), adds[c]
		fromZero = fromZero || rc == 0
		if delta > 0 && img.maxRefcount()-rc < n {
			return false, fmt.Errorf("qcow2: refcount of cluster %#x would overflow %d bits: %w", c*img.clusterSize, img.rcBits, syscall.EINVAL)
		}
		if delta < 0 && rc < n {
			return false, fmt.Errorf("qcow2: refcount of cluster %#x would drop below zero (is %d): %w", c*img.clusterSize, rc, syscall.EINVAL)
		}
	}
	return fromZero, nil
}

// CorruptionEvent is a corruption QEMU reports through
// qcow2_signal_corruption: the image is marked corrupt on disk and the
// operation fails with EIO. qemu-img prints Message on stderr before its
// error.
type CorruptionEvent struct {
	What string
}

func (e *CorruptionEvent) Error() string { return "qcow2: corrupt image: " + e.What }

// Unwrap makes the event an EIO, as QEMU returns it.
func (e *CorruptionEvent) Unwrap() error { return syscall.EIO }

// Message is QEMU's line for a writable image.
func (e *CorruptionEvent) Message() string {
	return "qcow2: Marking image as corrupt: " + e.What + "; further corruption events will be suppressed"
}

// corruptionEventLocked marks the image corrupt on disk, as QEMU does on
// a fatal corruption event, and returns the event.
func (img *Image) corruptionEventLocked(format string, args ...any) error {
	ev := &CorruptionEvent{What: fmt.Sprintf(format, args...)}
	img.corruptSignalled = true
	img.hdr.IncompatibleFeatures |= IncompatCorrupt
	if err := img.writeHeaderLocked(); err != nil {
		return fmt.Errorf("%w (marking the image corrupt: %v)", ev, err)
	}
	return ev
}

// metadataCountedLocked refuses an image whose refcounts call a metadata
// cluster free: the clusters a snapshot operation allocates could land on
// it. QEMU's allocator takes the lowest free cluster and its overlap
// check refuses the write, naming what it would overwrite; so does this,
// for the lowest such cluster.
func (img *Image) metadataCountedLocked() error {
	cs := img.clusterSize
	var clusters []int64
	span := func(off uint64, n int64) {
		if n <= 0 {
			return
		}
		for c := int64(off) / cs; c <= (int64(off)+n-1)/cs; c++ {
			clusters = append(clusters, c)
		}
	}
	h := &img.hdr
	span(0, cs)
	span(h.L1TableOffset, int64(len(img.l1))*8)
	for _, e := range img.l1 {
		if o := e & l1OffsetMask; o != 0 {
			span(o, cs)
		}
	}
	span(h.RefcountTableOffset, int64(len(img.refTable))*8)
	for _, e := range img.refTable {
		if o := e & refTableMask; o != 0 {
			span(o, cs)
		}
	}
	if len(img.snapshots) > 0 {
		span(h.SnapshotsOffset, snapshotTableLen(img.snapshots))
	}
	for _, sn := range img.snapshots {
		span(sn.L1TableOffset, int64(sn.L1Size)*8)
	}
	slices.Sort(clusters)
	for _, c := range slices.Compact(clusters) {
		var blk *cacheEntry
		err := img.retryExclusiveLocked(func() (err error) {
			blk, err = img.refBlockLocked(c)
			return err
		})
		if err != nil {
			return err
		}
		if blk == nil || getRefcount(blk.buf, c%img.rcPerBlock, img.rcBits) == 0 {
			return img.corruptionEventLocked("Preventing invalid write on metadata (overlaps with %s)", img.overlapLocked(uint64(c*cs), uint64(cs), ""))
		}
	}
	return nil
}
