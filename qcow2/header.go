package qcow2

import (
	"encoding/binary"
	"fmt"
	"sort"
	"strings"
)

// Spec constants (docs/interop/qcow2.rst) and QEMU's implementation limits.
const (
	Magic = 0x514649fb // "QFI\xfb"

	MinClusterBits = 9  // 512 B
	MaxClusterBits = 21 // 2 MiB

	v2HeaderLen = 72
	v3HeaderLen = 104

	maxL1Bytes            = 32 << 20 // QEMU_MAX_L1_SIZE
	maxRefcountTableBytes = 8 << 20  // QEMU_MAX_REFCOUNT_TABLE_SIZE
	maxBackingNameLen     = 1023
	maxSnapshots          = 65536

	extEnd          = 0x00000000
	extBackingFmt   = 0xe2792aca
	extFeatureTable = 0x6803f857
	extBitmaps      = 0x23852875
	extCrypto       = 0x0537be77
	extDataFile     = 0x44415441
)

// Incompatible feature bits.
const (
	IncompatDirty       = 1 << 0
	IncompatCorrupt     = 1 << 1
	IncompatDataFile    = 1 << 2
	IncompatCompression = 1 << 3
	IncompatExtendedL2  = 1 << 4
	incompatKnown       = IncompatDirty | IncompatCorrupt | IncompatDataFile | IncompatCompression | IncompatExtendedL2
)

// Compatible and autoclear feature bits.
const (
	CompatLazyRefcounts = 1 << 0

	AutoclearBitmaps     = 1 << 0
	AutoclearDataFileRaw = 1 << 1
	autoclearKnown       = AutoclearBitmaps | AutoclearDataFileRaw
)

// Compression types (header byte 104).
const (
	CompressionDeflate = 0
	CompressionZstd    = 1
)

// Extension is a header extension ovis keeps as raw bytes, so that unknown
// ones survive a header rewrite.
type Extension struct {
	Type uint32
	Data []byte
}

// FeatureName is one entry of the feature name table.
type FeatureName struct {
	Kind uint8 // 0 incompatible, 1 compatible, 2 autoclear
	Bit  uint8
	Name string
}

// Header is the parsed first cluster of an image: the header fields, the
// header extensions and the backing file name.
type Header struct {
	Version               uint32
	BackingFileOffset     uint64
	BackingFileSize       uint32
	ClusterBits           uint32
	Size                  uint64
	CryptMethod           uint32
	L1Size                uint32
	L1TableOffset         uint64
	RefcountTableOffset   uint64
	RefcountTableClusters uint32
	NbSnapshots           uint32
	SnapshotsOffset       uint64

	IncompatibleFeatures uint64
	CompatibleFeatures   uint64
	AutoclearFeatures    uint64
	RefcountOrder        uint32
	HeaderLength         uint32
	CompressionType      uint8
	// Trailing holds header bytes from 105 to HeaderLength that ovis does
	// not interpret; they are written back unchanged.
	Trailing []byte

	BackingFile   string
	BackingFormat string
	DataFile      string
	FeatureNames  []FeatureName
	// Extensions holds every extension other than backing format,
	// feature names and data file, in file order (bitmaps, crypto,
	// unknown).
	Extensions []Extension
}

// ClusterSize is 1 << ClusterBits.
func (h *Header) ClusterSize() int64 { return 1 << h.ClusterBits }

// RefcountBits is the refcount width in bits.
func (h *Header) RefcountBits() int { return 1 << h.RefcountOrder }

// ExtendedL2 reports whether L2 entries have subcluster bitmaps.
func (h *Header) ExtendedL2() bool { return h.IncompatibleFeatures&IncompatExtendedL2 != 0 }

// HasDataFile reports whether guest data lives in an external file.
func (h *Header) HasDataFile() bool { return h.IncompatibleFeatures&IncompatDataFile != 0 }

// DataFileRaw reports the data_file_raw autoclear bit.
func (h *Header) DataFileRaw() bool { return h.AutoclearFeatures&AutoclearDataFileRaw != 0 }

// LazyRefcounts reports the lazy refcounts compatible bit.
func (h *Header) LazyRefcounts() bool { return h.CompatibleFeatures&CompatLazyRefcounts != 0 }

// L2EntrySize is 8, or 16 with extended L2 entries.
func (h *Header) L2EntrySize() int {
	if h.ExtendedL2() {
		return 16
	}
	return 8
}

// L2Entries is the number of entries in one L2 table.
func (h *Header) L2Entries() int64 { return h.ClusterSize() / int64(h.L2EntrySize()) }

// l1EntriesFor returns how many L1 entries cover size bytes.
func l1EntriesFor(size uint64, clusterBits uint32, l2EntrySize int) uint64 {
	perL2 := uint64(1) << (clusterBits + clusterBits - uint32(trailingZeros(l2EntrySize)))
	return (size + perL2 - 1) / perL2
}

func trailingZeros(n int) int {
	z := 0
	for n > 1 {
		n >>= 1
		z++
	}
	return z
}

// ParseHeader decodes the first cluster of an image. fileSize bounds every
// table the header points at. buf must hold at least the first cluster,
// or the whole file if it is shorter.
func ParseHeader(buf []byte, fileSize int64) (*Header, error) {
	return parseHeader(buf, fileSize, false)
}

// parseHeader is ParseHeader; forCheck leaves the snapshot table pointer
// unchecked, for Check to report (Options.ForCheck).
func parseHeader(buf []byte, fileSize int64, forCheck bool) (*Header, error) {
	if len(buf) < v2HeaderLen {
		return nil, corruptf("header: file is %d bytes, shorter than a qcow2 header", len(buf))
	}
	be := binary.BigEndian
	if m := be.Uint32(buf[0:]); m != Magic {
		return nil, &FormatError{Msg: fmt.Sprintf("header: bad magic %#x, not a qcow2 image", m)}
	}
	h := &Header{
		Version:               be.Uint32(buf[4:]),
		BackingFileOffset:     be.Uint64(buf[8:]),
		BackingFileSize:       be.Uint32(buf[16:]),
		ClusterBits:           be.Uint32(buf[20:]),
		Size:                  be.Uint64(buf[24:]),
		CryptMethod:           be.Uint32(buf[32:]),
		L1Size:                be.Uint32(buf[36:]),
		L1TableOffset:         be.Uint64(buf[40:]),
		RefcountTableOffset:   be.Uint64(buf[48:]),
		RefcountTableClusters: be.Uint32(buf[56:]),
		NbSnapshots:           be.Uint32(buf[60:]),
		SnapshotsOffset:       be.Uint64(buf[64:]),
		RefcountOrder:         4,
		HeaderLength:          v2HeaderLen,
	}
	switch h.Version {
	case 2:
	case 3:
		if len(buf) < v3HeaderLen {
			return nil, corruptf("header: v3 header truncated at %d bytes", len(buf))
		}
		h.IncompatibleFeatures = be.Uint64(buf[72:])
		h.CompatibleFeatures = be.Uint64(buf[80:])
		h.AutoclearFeatures = be.Uint64(buf[88:])
		h.RefcountOrder = be.Uint32(buf[96:])
		h.HeaderLength = be.Uint32(buf[100:])
		if h.HeaderLength < v3HeaderLen || h.HeaderLength%8 != 0 {
			return nil, corruptf("header: header_length %d is not a multiple of 8 of at least %d", h.HeaderLength, v3HeaderLen)
		}
	default:
		return nil, &UnsupportedError{Feature: fmt.Sprintf("version %d", h.Version)}
	}
	if h.ClusterBits < MinClusterBits || h.ClusterBits > MaxClusterBits {
		return nil, corruptf("header: cluster_bits %d out of range %d..%d", h.ClusterBits, MinClusterBits, MaxClusterBits)
	}
	cs := h.ClusterSize()
	if int64(h.HeaderLength) > cs || int(h.HeaderLength) > len(buf) {
		return nil, corruptf("header: header_length %d exceeds the first cluster", h.HeaderLength)
	}
	if h.HeaderLength > v3HeaderLen {
		h.CompressionType = buf[104]
		h.Trailing = append([]byte(nil), buf[105:h.HeaderLength]...)
	}
	if h.RefcountOrder > 6 {
		return nil, corruptf("header: refcount_order %d exceeds 6", h.RefcountOrder)
	}

	// Extensions come before the feature check so that unknown bits can be
	// named from the feature name table.
	if err := h.parseExtensions(buf[:min(int64(len(buf)), cs)]); err != nil {
		return nil, err
	}
	if unknown := h.IncompatibleFeatures &^ incompatKnown; unknown != 0 {
		return nil, &FeaturesError{List: h.unsupportedFeatures(unknown)}
	}
	if h.CryptMethod != 0 {
		return nil, &UnsupportedError{Feature: fmt.Sprintf("encryption method %d", h.CryptMethod)}
	}
	hasCT := h.IncompatibleFeatures&IncompatCompression != 0
	switch {
	case hasCT && h.CompressionType == CompressionDeflate:
		return nil, corruptf("header: compression type bit set but compression_type is 0")
	case !hasCT && h.CompressionType != CompressionDeflate:
		return nil, corruptf("header: compression_type %d without the compression type bit", h.CompressionType)
	case h.CompressionType > CompressionZstd:
		return nil, &UnsupportedError{Feature: fmt.Sprintf("compression type %d", h.CompressionType)}
	}
	if h.ExtendedL2() && h.ClusterBits < 14 {
		return nil, corruptf("header: extended L2 entries need clusters of at least 16 KiB, have %d", cs)
	}
	if h.DataFileRaw() && !h.HasDataFile() {
		return nil, corruptf("header: data_file_raw set without an external data file")
	}

	// Bound every table by the file and by QEMU's limits before anyone
	// allocates for it.
	if h.Size > 1<<62 {
		return nil, corruptf("header: virtual size %d too large", h.Size)
	}
	if int64(h.L1Size)*8 > maxL1Bytes {
		return nil, corruptf("header: L1 table of %d entries exceeds %d bytes", h.L1Size, maxL1Bytes)
	}
	if need := l1EntriesFor(h.Size, h.ClusterBits, h.L2EntrySize()); uint64(h.L1Size) < need {
		return nil, corruptf("header: L1 table of %d entries too small for %d bytes (need %d)", h.L1Size, h.Size, need)
	}
	if err := checkTable("L1 table", h.L1TableOffset, uint64(h.L1Size)*8, cs, fileSize); err != nil {
		return nil, err
	}
	rtBytes := uint64(h.RefcountTableClusters) * uint64(cs)
	if rtBytes > maxRefcountTableBytes {
		return nil, corruptf("header: refcount table of %d clusters exceeds %d bytes", h.RefcountTableClusters, maxRefcountTableBytes)
	}
	// QEMU opens such an image only for check, which rebuilds the table.
	if h.RefcountTableClusters == 0 && !forCheck {
		return nil, corruptf("header: refcount table has 0 clusters")
	}
	if err := checkTable("refcount table", h.RefcountTableOffset, rtBytes, cs, fileSize); err != nil {
		return nil, err
	}
	if h.NbSnapshots > maxSnapshots && !forCheck {
		return nil, corruptf("header: %d snapshots exceed %d", h.NbSnapshots, maxSnapshots)
	}
	if h.NbSnapshots > 0 && !forCheck {
		if err := checkTable("snapshot table", h.SnapshotsOffset, 40, cs, fileSize); err != nil {
			return nil, err
		}
	}

	if h.BackingFileOffset != 0 {
		if h.BackingFileSize > maxBackingNameLen {
			return nil, corruptf("header: backing file name of %d bytes exceeds %d", h.BackingFileSize, maxBackingNameLen)
		}
		end := h.BackingFileOffset + uint64(h.BackingFileSize)
		if end > uint64(cs) || end > uint64(len(buf)) {
			return nil, corruptf("header: backing file name at %#x+%d is outside the first cluster", h.BackingFileOffset, h.BackingFileSize)
		}
		h.BackingFile = string(buf[h.BackingFileOffset:end])
	}
	return h, nil
}

func checkTable(what string, off, n uint64, clusterSize, fileSize int64) error {
	if off%uint64(clusterSize) != 0 {
		return corruptf("header: %s offset %#x is not cluster aligned", what, off)
	}
	if n > 0 && (off == 0 || off > uint64(fileSize) || n > uint64(fileSize)-off) {
		return corruptf("header: %s at %#x (%d bytes) is beyond the end of the file (%d bytes)", what, off, n, fileSize)
	}
	return nil
}

func (h *Header) parseExtensions(buf []byte) error {
	be := binary.BigEndian
	off := int(h.HeaderLength)
	end := len(buf)
	if h.BackingFileOffset != 0 && h.BackingFileOffset < uint64(end) {
		end = int(h.BackingFileOffset)
	}
	for {
		if off+8 > end {
			// QEMU tolerates a missing end marker at the end of the area.
			return nil
		}
		typ := be.Uint32(buf[off:])
		n := int(be.Uint32(buf[off+4:]))
		if typ == extEnd {
			return nil
		}
		off += 8
		if n > end-off {
			return corruptf("header: extension %#x at %#x of %d bytes runs past the header area", typ, off-8, n)
		}
		data := buf[off : off+n]
		switch typ {
		case extBackingFmt:
			h.BackingFormat = string(data)
		case extDataFile:
			h.DataFile = string(data)
		case extFeatureTable:
			for i := 0; i+48 <= len(data); i += 48 {
				name := data[i+2 : i+48]
				if j := strings.IndexByte(string(name), 0); j >= 0 {
					name = name[:j]
				}
				h.FeatureNames = append(h.FeatureNames, FeatureName{Kind: data[i], Bit: data[i+1], Name: string(name)})
			}
		default:
			h.Extensions = append(h.Extensions, Extension{Type: typ, Data: append([]byte(nil), data...)})
		}
		off += (n + 7) &^ 7
	}
}

// FeaturesError reports incompatible feature bits ovis does not know. It
// is an *UnsupportedError too (errors.As).
type FeaturesError struct {
	// List is QEMU's list of them: "Test feature, Unknown incompatible
	// feature: 6000000000000000".
	List string
}

func (e *FeaturesError) Error() string { return "qcow2: Unsupported qcow2 feature(s): " + e.List }

// Unwrap makes it an *UnsupportedError.
func (e *FeaturesError) Unwrap() error {
	return &UnsupportedError{Feature: "incompatible features " + e.List}
}

// unsupportedFeatures lists the incompatible bits of mask as QEMU's
// report_unsupported_feature does: the names the image's feature name
// table gives them, in table order (up to the first unnamed entry), then
// the bits left unnamed as one hex mask.
func (h *Header) unsupportedFeatures(mask uint64) string {
	var parts []string
	for _, f := range h.FeatureNames {
		if f.Name == "" {
			break
		}
		if f.Kind != 0 || f.Bit >= 64 || mask&(1<<f.Bit) == 0 {
			continue
		}
		parts = append(parts, f.Name)
		mask &^= 1 << f.Bit
	}
	if mask != 0 {
		parts = append(parts, fmt.Sprintf("Unknown incompatible feature: %x", mask))
	}
	return strings.Join(parts, ", ")
}

// Encode writes the header, its extensions and the backing file name into
// a buffer of one cluster. It fails if they do not fit.
func (h *Header) Encode() ([]byte, error) {
	cs := h.ClusterSize()
	buf := make([]byte, cs)
	be := binary.BigEndian
	be.PutUint32(buf[0:], Magic)
	be.PutUint32(buf[4:], h.Version)
	be.PutUint32(buf[20:], h.ClusterBits)
	be.PutUint64(buf[24:], h.Size)
	be.PutUint32(buf[32:], h.CryptMethod)
	be.PutUint32(buf[36:], h.L1Size)
	be.PutUint64(buf[40:], h.L1TableOffset)
	be.PutUint64(buf[48:], h.RefcountTableOffset)
	be.PutUint32(buf[56:], h.RefcountTableClusters)
	be.PutUint32(buf[60:], h.NbSnapshots)
	be.PutUint64(buf[64:], h.SnapshotsOffset)
	off := v2HeaderLen
	if h.Version >= 3 {
		hl := h.HeaderLength
		if hl < v3HeaderLen {
			hl = v3HeaderLen
		}
		if h.CompressionType != 0 && hl < 112 {
			hl = 112
		}
		h.HeaderLength = hl
		be.PutUint64(buf[72:], h.IncompatibleFeatures)
		be.PutUint64(buf[80:], h.CompatibleFeatures)
		be.PutUint64(buf[88:], h.AutoclearFeatures)
		be.PutUint32(buf[96:], h.RefcountOrder)
		be.PutUint32(buf[100:], hl)
		if hl > v3HeaderLen {
			buf[104] = h.CompressionType
			copy(buf[105:hl], h.Trailing)
		}
		off = int(hl)
	} else if h.IncompatibleFeatures|h.CompatibleFeatures|h.AutoclearFeatures != 0 || h.RefcountOrder != 4 {
		return nil, fmt.Errorf("qcow2: version 2 images cannot carry feature bits or refcount_order %d", h.RefcountOrder)
	}

	put := func(typ uint32, data []byte) error {
		n := 8 + (len(data)+7)&^7
		if off+n+8 > len(buf) {
			return fmt.Errorf("qcow2: header extensions do not fit in a %d-byte cluster", cs)
		}
		be.PutUint32(buf[off:], typ)
		be.PutUint32(buf[off+4:], uint32(len(data)))
		copy(buf[off+8:], data)
		off += n
		return nil
	}
	if h.BackingFormat != "" {
		if err := put(extBackingFmt, []byte(h.BackingFormat)); err != nil {
			return nil, err
		}
	}
	if h.DataFile != "" {
		if err := put(extDataFile, []byte(h.DataFile)); err != nil {
			return nil, err
		}
	}
	// The feature name table is optional: like QEMU, leave it out when it
	// would not fit beside the rest (512-byte clusters).
	rest := 8 + len(h.BackingFile)
	for _, e := range h.Extensions {
		rest += 8 + (len(e.Data)+7)&^7
	}
	if h.Version >= 3 && len(h.FeatureNames) > 0 && off+8+48*len(h.FeatureNames)+rest <= len(buf) {
		ft := make([]byte, 48*len(h.FeatureNames))
		for i, f := range h.FeatureNames {
			ft[i*48] = f.Kind
			ft[i*48+1] = f.Bit
			copy(ft[i*48+2:i*48+48], f.Name)
		}
		if err := put(extFeatureTable, ft); err != nil {
			return nil, err
		}
	}
	for _, e := range h.Extensions {
		if err := put(e.Type, e.Data); err != nil {
			return nil, err
		}
	}
	off += 8 // end marker, already zero
	h.BackingFileOffset, h.BackingFileSize = 0, 0
	if h.BackingFile != "" {
		if len(h.BackingFile) > maxBackingNameLen || off+len(h.BackingFile) > len(buf) {
			return nil, fmt.Errorf("qcow2: backing file name of %d bytes does not fit in the header cluster", len(h.BackingFile))
		}
		h.BackingFileOffset = uint64(off)
		h.BackingFileSize = uint32(len(h.BackingFile))
		copy(buf[off:], h.BackingFile)
	}
	be.PutUint64(buf[8:], h.BackingFileOffset)
	be.PutUint32(buf[16:], h.BackingFileSize)
	return buf, nil
}

// defaultFeatureNames is the feature name table QEMU writes into new v3
// images.
func defaultFeatureNames() []FeatureName {
	f := []FeatureName{
		{0, 0, "dirty bit"},
		{0, 1, "corrupt bit"},
		{0, 2, "external data file"},
		{0, 3, "compression type"},
		{0, 4, "extended L2 entries"},
		{1, 0, "lazy refcounts"},
		{2, 0, "bitmaps"},
		{2, 1, "raw external data"},
	}
	sort.SliceStable(f, func(i, j int) bool { return f[i].Kind < f[j].Kind })
	return f
}
