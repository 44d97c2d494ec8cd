package qcow2

import (
	"encoding/binary"
)

// subKind is what one (sub)cluster of the guest disk maps to.
type subKind uint8

const (
	kindUnalloc    subKind = iota // read from the backing file, or zeros
	kindZero                      // reads as zeros; the backing file is not read
	kindData                      // at host offset in the data file
	kindCompressed                // compressed cluster
)

// mapping is the L2 entry of one guest cluster, as read under mu.
type mapping struct {
	entry  uint64 // first 64 bits of the L2 entry
	bitmap uint64 // extended L2 subcluster bitmap; 0 for standard entries
}

// l2Slot locates the L2 entry of guest cluster c. ok is false when the L1
// entry has no L2 table.
func (img *Image) l2SlotLocked(c int64) (l1i int, idx int64, l2off uint64) {
	l1i = int(c / img.l2Entries)
	idx = c % img.l2Entries
	if l1i < len(img.l1) {
		l2off = img.l1[l1i] & l1OffsetMask
	}
	return
}

// lookupLocked returns guest cluster c's L2 entry, or a *needLoad error.
func (img *Image) lookupLocked(c int64) (mapping, error) {
	_, idx, l2off := img.l2SlotLocked(c)
	if l2off == 0 {
		return mapping{}, nil
	}
	soff, sidx := img.sliceOf(l2off, idx)
	e, err := img.l2.peekLocked(soff)
	if err != nil {
		return mapping{}, err
	}
	return img.readEntry(e.buf, sidx), nil
}

// sliceOf returns the host offset of the L2 cache slice holding entry idx
// of the L2 table at l2off, and the entry's index in that slice.
func (img *Image) sliceOf(l2off uint64, idx int64) (uint64, int64) {
	return l2off + uint64(idx/img.slEntries*img.sliceSize), idx % img.slEntries
}

// forgetTableLocked drops every cached slice of the table at off.
func (img *Image) forgetTableLocked(off uint64) {
	for s := int64(0); s < img.clusterSize; s += img.sliceSize {
		img.l2.forgetLocked(off + uint64(s))
	}
}

func (img *Image) readEntry(buf []byte, idx int64) mapping {
	if img.extL2 {
		return mapping{
			entry:  binary.BigEndian.Uint64(buf[idx*16:]),
			bitmap: binary.BigEndian.Uint64(buf[idx*16+8:]),
		}
	}
	return mapping{entry: binary.BigEndian.Uint64(buf[idx*8:])}
}

func (img *Image) writeEntry(buf []byte, idx int64, m mapping) {
	if img.extL2 {
		binary.BigEndian.PutUint64(buf[idx*16:], m.entry)
		binary.BigEndian.PutUint64(buf[idx*16+8:], m.bitmap)
		return
	}
	binary.BigEndian.PutUint64(buf[idx*8:], m.entry)
}

// host returns the host cluster offset of a standard (non-compressed)
// entry and whether the entry has one.
func (img *Image) host(m mapping) (uint64, bool) {
	if m.entry&flagCompressed != 0 {
		return 0, false
	}
	off := m.entry & l2OffsetMask
	if off != 0 {
		return off, true
	}
	// Offset 0 is a real host offset only in an external data file, and
	// then only with the COPIED bit set.
	return 0, img.hasDataFile && m.entry&flagCopied != 0
}

// sub classifies subcluster i (0 without extended L2) of a mapping.
func (img *Image) sub(m mapping, i int) (subKind, uint64) {
	if m.entry&flagCompressed != 0 {
		return kindCompressed, 0
	}
	host, has := img.host(m)
	if img.extL2 {
		switch {
		case m.bitmap&(1<<i) != 0:
			return kindData, host + uint64(i)*uint64(img.subSize)
		case m.bitmap&(1<<(32+i)) != 0:
			return kindZero, 0
		}
		return kindUnalloc, 0
	}
	if img.v3 && m.entry&flagZero != 0 {
		return kindZero, 0
	}
	if has {
		return kindData, host
	}
	return kindUnalloc, 0
}

// compressedRange decodes a compressed descriptor into the host byte
// offset and the number of bytes to read (to the end of its last sector).
func (img *Image) compressedRange(entry uint64) (off uint64, n int64) {
	x := 62 - (img.clusterBits - 8)
	off = entry & (uint64(1)<<x - 1)
	sectors := (entry & (uint64(1)<<62 - 1)) >> x
	n = int64(sectors+1)*512 - int64(off&511)
	return off, n
}

// compressedEntry encodes a compressed descriptor for n bytes at off.
func (img *Image) compressedEntry(off uint64, n int64) uint64 {
	x := 62 - (img.clusterBits - 8)
	sectors := (off+uint64(n)-1)>>9 - off>>9
	return flagCompressed | sectors<<x | off
}
