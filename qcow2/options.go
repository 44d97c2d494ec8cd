package qcow2

import (
	"fmt"

	"github.com/ovis-storage/ovis/block"
)

// Options configure Open. The zero value opens read-write with QEMU's
// defaults.
type Options struct {
	// ReadOnly opens the image and its data file read-only. Backing files
	// are always opened read-only.
	ReadOnly bool
	// NoBacking leaves the backing file closed: unallocated clusters read
	// as zeros (qemu-img's -U/--image-opts backing=null, used by
	// info and by rebase -u).
	NoBacking bool
	// L2CacheSize is the L2 cache size in bytes (QEMU's l2-cache-size).
	// The default (0) covers the whole disk up to 32 MiB, as QEMU's does;
	// it is never larger than all L2 tables together.
	L2CacheSize int64
	// L2CacheEntrySize is the size of one L2 cache entry, a power of two
	// from 512 bytes to the cluster size (l2-cache-entry-size). Entries
	// smaller than a cluster cache slices of L2 tables. The default (0) is
	// the cluster size when the L2 cache covers the whole disk, and 4 KiB
	// (or the cluster size, if smaller) when it does not, as in QEMU.
	L2CacheEntrySize int64
	// RefcountCacheSize is the refcount block cache size in bytes
	// (refcount-cache-size). The default (0) is four clusters.
	RefcountCacheSize int64
	// CacheSize caps L2 and refcount caches together (cache-size), split
	// as QEMU splits it. It may not be set together with both of the
	// above.
	CacheSize int64
	// L2CachePolicy is the L2 cache eviction policy: "lru" (the default),
	// "hitcount" (QEMU's original) or "hitcount-floor" (its patched form).
	L2CachePolicy string
	// CacheCleanInterval, in seconds, drops cache entries unused for that
	// long (cache-clean-interval). 0 disables it, the default here; QEMU
	// defaults to 600.
	CacheCleanInterval int
	// Untrusted refuses backing and external data files outside the
	// image's own folder (after resolving symlinks) and files that are not
	// regular files, and a backing file whose format the image does not
	// record (it would have to be probed), so that an image from someone
	// else cannot make ovis read arbitrary host files. The default
	// (false) follows QEMU, which opens whatever the image names.
	Untrusted bool
	// ForCheck opens the image for Check alone, as QEMU opens one for
	// qemu-img check: L1 entries naming misaligned L2 tables or tables
	// past the end of the file, and refcount table entries naming
	// misaligned blocks, are left for Check to report instead of being
	// refused. Such an image must not be read or written; the default
	// (false) refuses it with a *CorruptError.
	ForCheck bool
	// ForceShare is qemu-img's -U for a read-only open: the image opens
	// even while another process writes it, and this open does not keep
	// writers out. Read-write opens ignore it.
	ForceShare bool
	// FixedSize is for an image whose size its user has told others (an
	// NBD export): other processes may not resize it, as QEMU's block
	// exports refuse to share resizing. Backing files ignore it.
	FixedSize bool
	// Resize is for a writer that resizes a raw image (qemu-img resize):
	// it holds the resize permission, which an NBD export of the file
	// refuses to share. Writable qcow2 images always hold it.
	Resize bool
	// NoLock takes and tests no image locks on the image's own file
	// (QEMU's file.locking=off); its backing and data files are locked
	// as always.
	NoLock bool
	// NoShare keeps other holders from writing or resizing any file of
	// the chain, as qemu-img convert's sources (BDRV_O_NO_SHARE); with
	// ForceShare a read-only open still shares all.
	NoShare bool
	// Reopen is for an image this process has open already, which QEMU
	// would reopen (commit's base, read-write): its own file and data file
	// are not checked against the other holders in this process
	// (block.LockReopen). Backing files ignore it.
	Reopen bool
	// OpenFile opens the image's own file, its data file and backing
	// files. nil means block.OpenFile. The files it returns are locked as
	// QEMU locks them (block.Perm) if they are block.ImageLockers.
	OpenFile func(name string, readOnly bool) (block.File, error)
	// Warn, when set, receives the warnings QEMU prints while it opens an
	// image (bitmaps another program invalidated), as QEMU words them:
	// the warning, then its hint without a final newline.
	Warn func(warning, hint string)
	// OpenBacking, when set, opens a backing file: name is its path,
	// resolved against the image's folder (or a file: or json: name),
	// format the backing format the image records ("" to probe), and o
	// the options to open it with (read-only, and this hook again). A
	// qcow2 backing file must be opened with Open and o as given, which
	// carries what finds backing loops. Package image sets it to open
	// any registered format. nil opens qcow2 and raw backing files only,
	// probing between the two.
	OpenBacking func(name, format string, o Options) (block.Device, error)

	// seen holds the files of the chain opened so far, for loop
	// detection across OpenBacking (see openBacking).
	seen map[string]bool
}

// fileRole is what a file is to the image being opened, which decides
// the permissions QEMU locks on it.
type fileRole int

const (
	roleImage fileRole = iota // a qcow2 image's own file
	roleData                  // its external data file
	roleRaw                   // a raw image
)

// openLocked opens name as openFile does and takes the image locks QEMU
// takes on a file in that role: a reader refuses to share writing and
// resizing of qcow2 metadata, which it caches; a writer also holds them.
func (o *Options) openLocked(name string, role fileRole) (block.File, error) {
	f, err := o.openFile(name, o.ReadOnly)
	if err != nil {
		return nil, err
	}
	perm := block.PermConsistentRead
	if !o.ReadOnly {
		perm |= block.PermWrite
		if role != roleRaw || o.Resize {
			perm |= block.PermResize
		}
	}
	var unshared block.Perm
	switch role {
	case roleImage:
		unshared = block.PermWrite | block.PermResize
	case roleData:
		unshared = block.PermResize
	}
	if o.NoShare {
		unshared |= block.PermWrite | block.PermResize
	}
	if o.ForceShare && o.ReadOnly {
		unshared = 0
	}
	if o.FixedSize {
		unshared |= block.PermResize
	}
	if o.NoLock && role != roleData {
		return f, nil
	}
	if o.Reopen {
		perm |= block.LockReopen
	}
	if err := block.LockFile(f, name, perm, unshared); err != nil {
		f.Close()
		return nil, err
	}
	return f, nil
}

func (o *Options) openFile(name string, readOnly bool) (block.File, error) {
	if o.OpenFile != nil {
		return o.OpenFile(name, readOnly)
	}
	f, err := block.OpenFile(name, readOnly)
	if err != nil {
		return nil, err
	}
	return f, nil
}

// Preallocation modes of CreateOptions.
const (
	PreallocOff      = "off"
	PreallocMetadata = "metadata"
	PreallocFalloc   = "falloc"
	PreallocFull     = "full"
)

// CreateOptions are qemu-img create's -o options for qcow2.
type CreateOptions struct {
	// Size is the virtual size in bytes. With a backing file it defaults
	// (when 0) to the backing file's size.
	Size int64
	// ClusterSize defaults to 65536.
	ClusterSize int64
	// Compat is "0.10" (v2) or "1.1" (v3, the default). "v2"/"v3" are
	// accepted too.
	Compat string
	// Preallocation is off (the default), metadata, falloc or full.
	Preallocation string
	// LazyRefcounts sets the lazy refcounts compatible bit (v3 only).
	LazyRefcounts bool
	// RefcountBits defaults to 16.
	RefcountBits int
	// ExtendedL2 gives L2 entries subcluster bitmaps (v3, clusters of at
	// least 16 KiB).
	ExtendedL2 bool
	// CompressionType is "zlib" (the default) or "zstd".
	CompressionType string
	// BackingFile is stored as given; relative names resolve against the
	// new image's folder.
	BackingFile string
	// BackingFormat is stored in the backing format extension.
	BackingFormat string
	// DataFile names an external data file, created if missing.
	DataFile string
	// DataFileRaw sets data_file_raw.
	DataFileRaw bool
}

func (o *CreateOptions) validate() error {
	if o.ClusterSize == 0 {
		o.ClusterSize = 65536
	}
	if o.Compat == "" || o.Compat == "v3" {
		o.Compat = "1.1"
	}
	if o.Compat == "v2" {
		o.Compat = "0.10"
	}
	if o.Preallocation == "" {
		o.Preallocation = PreallocOff
	}
	if o.RefcountBits == 0 {
		o.RefcountBits = 16
	}
	if o.CompressionType == "" {
		o.CompressionType = "zlib"
	}
	cs := o.ClusterSize
	if cs < 1<<MinClusterBits || cs > 1<<MaxClusterBits || cs&(cs-1) != 0 {
		return fmt.Errorf("Cluster size must be a power of two between %d and %dk", 1<<MinClusterBits, (1<<MaxClusterBits)>>10)
	}
	if o.Compat != "0.10" && o.Compat != "1.1" {
		return fmt.Errorf("Invalid parameter '%s'", o.Compat)
	}
	v2 := o.Compat == "0.10"
	switch o.Preallocation {
	case PreallocOff, PreallocMetadata, PreallocFalloc, PreallocFull:
	default:
		return fmt.Errorf("Invalid parameter '%s'", o.Preallocation)
	}
	rb := o.RefcountBits
	if rb < 1 || rb > 64 || rb&(rb-1) != 0 {
		return fmt.Errorf("Refcount width must be a power of two and may not exceed 64 bits")
	}
	if v2 && rb != 16 {
		return fmt.Errorf("Different refcount widths than 16 bits require compatibility level 1.1 or above (use compat=1.1 or greater)")
	}
	if v2 && o.LazyRefcounts {
		return fmt.Errorf("Lazy refcounts only supported with compatibility level 1.1 and above (use compat=1.1 or greater)")
	}
	if o.ExtendedL2 {
		if v2 {
			return fmt.Errorf("Extended L2 entries are only supported with compatibility level 1.1 and above (use compat=1.1 or greater)")
		}
		if cs < 16384 {
			return fmt.Errorf("Extended L2 entries are only supported with cluster sizes of at least 16384 bytes")
		}
	}
	switch o.CompressionType {
	case "zlib":
	case "zstd":
		if v2 {
			return fmt.Errorf("Compression type 'zstd' requires compatibility level 1.1 or above (use compat=1.1 or greater)")
		}
	default:
		return fmt.Errorf("Invalid parameter '%s'", o.CompressionType)
	}
	if o.DataFile != "" && v2 {
		return fmt.Errorf("data-file requires compat version 1.1 or above")
	}
	if o.DataFileRaw && o.DataFile == "" {
		return fmt.Errorf("data-file-raw requires data-file")
	}
	if o.DataFileRaw && o.BackingFile != "" {
		return fmt.Errorf("Backing file and data-file-raw cannot be used at the same time")
	}
	if o.BackingFormat != "" && o.BackingFile == "" {
		return fmt.Errorf("Backing format cannot be used without backing file")
	}
	if o.Size < 0 {
		return fmt.Errorf("Image size must be less than 8 EiB!")
	}
	return nil
}

// cacheSizes resolves QEMU's cache options for an image: the L2 cache in
// entries of entrySize bytes and the refcount cache in clusters.
func (o *Options) cacheSizes(clusterSize, virtualSize int64, l2EntryBytes int) (l2Entries int, entrySize int64, rcEntries int, err error) {
	entrySize = o.L2CacheEntrySize
	if entrySize == 0 {
		entrySize = clusterSize
	}
	if entrySize < 512 || entrySize > clusterSize || entrySize&(entrySize-1) != 0 {
		return 0, 0, 0, fmt.Errorf("L2 cache entry size must be a power of two between 512 and the cluster size (%d)", clusterSize)
	}
	switch o.L2CachePolicy {
	case "", PolicyLRU, PolicyHitCount, PolicyHitCountFloor:
	default:
		return 0, 0, 0, fmt.Errorf("unknown L2 cache policy %q (want lru, hitcount or hitcount-floor)", o.L2CachePolicy)
	}
	maxL2 := (virtualSize + clusterSize - 1) / clusterSize * int64(l2EntryBytes)
	maxL2 = (maxL2 + clusterSize - 1) / clusterSize * clusterSize
	minRC := 4 * clusterSize
	l2, rc := o.L2CacheSize, o.RefcountCacheSize
	if l2 < 0 || rc < 0 || o.CacheSize < 0 {
		return 0, 0, 0, fmt.Errorf("cache sizes must not be negative")
	}
	if o.CacheSize > 0 {
		switch {
		case l2 > 0 && rc > 0:
			return 0, 0, 0, fmt.Errorf("cache-size, l2-cache-size and refcount-cache-size may not be set at the same time")
		case l2 > o.CacheSize:
			return 0, 0, 0, fmt.Errorf("l2-cache-size may not exceed cache-size")
		case rc > o.CacheSize:
			return 0, 0, 0, fmt.Errorf("refcount-cache-size may not exceed cache-size")
		case l2 > 0:
			rc = o.CacheSize - l2
		case rc > 0:
			l2 = o.CacheSize - rc
		case o.CacheSize >= maxL2+minRC:
			l2, rc = maxL2, o.CacheSize-maxL2
		default:
			rc = min(o.CacheSize, minRC)
			l2 = o.CacheSize - rc
		}
	} else {
		if l2 == 0 {
			l2 = min(maxL2, 32<<20)
		}
		if rc == 0 {
			rc = minRC
		}
	}
	// A cache too small for the whole disk defaults to 4 KiB entries, as
	// QEMU's does: a miss then reads 4 KiB instead of a whole table, and
	// the same bytes hold more, smaller pieces of more tables.
	if o.L2CacheEntrySize == 0 && min(l2, maxL2) < maxL2 {
		entrySize = min(clusterSize, 4096)
	}
	// Never more than all L2 tables need.
	l2 = min(l2, max(maxL2, 2*entrySize))
	l2Entries = int(max(l2/entrySize, 2))
	rcEntries = int(max(rc/clusterSize, 4))
	return l2Entries, entrySize, rcEntries, nil
}
