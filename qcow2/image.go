package qcow2

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ovis-storage/ovis/block"
)

// Entry masks and flags (spec: "L1 table entry", "L2 table entry").
const (
	l1OffsetMask   = 0x00fffffffffffe00
	l2OffsetMask   = 0x00fffffffffffe00
	refTableMask   = 0xfffffffffffffe00
	flagCopied     = uint64(1) << 63
	flagCompressed = uint64(1) << 62
	flagZero       = uint64(1)

	subclustersPerCluster = 32
)

// Image is an open qcow2 image, served as a block.Device.
//
// Locking: the order is gate, flushMu, mu, then the leaves bm.mu and
// hostRunsMu (docs/architecture.md, "Locks", has the table). Data I/O
// never happens under mu, and metadata tables are read with mu released
// (tableCache.load). The I/O done with mu held is rare and listed there:
// refcount table growth, beforeFirstWrite, markClean, the corrupt bit of
// an overlap event, and everything inside exclusive.
//
// Safe for concurrent use. Release with Close.
type Image struct {
	path    string
	file    block.File
	data    block.File // == file unless the image has an external data file
	backing block.Device
	backRef string // resolved backing path
	ro      bool

	// Immutable after Open.
	clusterBits  uint32
	clusterSize  int64
	l2Entries    int64
	sliceSize    int64 // L2 cache entry size (l2-cache-entry-size)
	l2policyName string
	slEntries    int64 // L2 entries per slice
	extL2        bool
	subSize      int64 // subcluster size (== clusterSize without extended L2)
	nsub         int   // subclusters per cluster (1 without extended L2)
	rcBits       int
	rcPerBlock   int64
	size         int64
	compression  uint8
	hasDataFile  bool
	dataFileRaw  bool
	lazy         bool
	v3           bool
	snapshots    []Snapshot
	backingSize  int64
	hdrClustersN int64
	// forCheck: opened with Options.ForCheck, so the tables may hold
	// entries Open otherwise refuses.
	forCheck bool

	// gate is held shared by every I/O method and exclusively by
	// operations that rewrite metadata wholesale (exclusive: snapshots,
	// amend, resize, bitmap changes; also CheckContext, LoadSnapshot):
	// they run with no I/O in flight.
	gate sync.RWMutex
	// flushMu makes one flusher at a time: Flush, refcount writeback and
	// table growth, beforeFirstWrite, markClean, exclusive. Taken before
	// mu; Flush holds it across its writeback with mu released.
	flushMu sync.Mutex
	// mu guards the metadata in memory; the table caches and usersCond
	// use it too.
	mu sync.Mutex
	// Fields below are guarded by mu.
	hdr      Header
	l1       []uint64
	l1Dirty  map[int]struct{} // L1 indices changed since the last flush
	refTable []uint64
	rtDirty  map[int]struct{}
	l2       *tableCache
	rc       *tableCache
	// freeHint is a cluster index below which every cluster is in use.
	freeHint int64
	// runHint is where the search for a run of clusters starts.
	runHint int64
	// allocGen counts refcount increments; a saved runScan is only
	// valid while it is unchanged.
	allocGen uint64
	// scan is the allocRunLocked search a table load interrupted.
	scan runScan
	// compTail is the host byte offset where the next compressed cluster
	// may be packed, 0 when none.
	compTail uint64
	// inflight holds guest clusters whose L2 entry a writer is changing;
	// other writers to the same cluster wait for done.
	inflight map[int64]chan struct{}
	// pendingFree lists host clusters whose refcount drops once the L2
	// change that stopped referencing them is durable (see Flush).
	pendingFree []uint64
	// markedDirty is set once the header's dirty bit is on disk (lazy
	// refcounts).
	markedDirty bool
	// bm holds the persistent dirty bitmaps (bitmap.go).
	bm          bitmapState
	needRebuild bool
	closed      bool
	// checkSnapSize is the size of the snapshot table as Check read it
	// (QEMU's snapshots_size), on images opened ForCheck.
	checkSnapSize int64
	// corruptSignalled: Check has reported a corruption event (QEMU's
	// qcow2_signal_corruption prints only the first).
	corruptSignalled bool
	// metaAtOpen indexes the host clusters of metadata, for the
	// allocation overlap check (overlap.go); nil until first needed.
	metaAtOpen map[int64]struct{}
	// passDiscard passes guest discards down to the file (QEMU's
	// pass-discard-request): the host clusters a Discard or an unmapping
	// WriteZeroes frees are punched once their refcount drops to 0.
	// pendingPunch holds those clusters until Flush drops them.
	passDiscard  bool
	pendingPunch map[uint64]struct{}
	// fatalEvent is the overlap corruption event that made the image
	// unusable for writes, as QEMU drops the driver after one.
	fatalEvent error

	stopClean, cleanDone chan struct{} // cache-clean-interval goroutine

	// users counts data I/O in flight per epoch, for I/O that mapped a
	// guest range to host clusters and then released mu. Flush bumps
	// usersEpoch and waits for the older epochs to drain before it lets
	// freed clusters be reused, so no reader or in-place writer touches a
	// cluster that now belongs to another guest offset.
	usersEpoch uint64
	users      map[uint64]int
	usersCond  *sync.Cond

	// hostRuns are runs of the data file found to be data or holes, and
	// hostGen counts the writes that can fill holes (hostholes.go).
	// hostRunsMu (a leaf lock) serialises the copies made to insert into
	// hostRuns; hostLookups counts the lseeks made to find runs.
	hostRuns    atomic.Pointer[hostRuns]
	hostGen     atomic.Uint64
	hostRunsMu  sync.Mutex
	hostLookups atomic.Int64
}

// enterLocked registers data I/O about to use a mapping just looked up.
func (img *Image) enterLocked() uint64 {
	e := img.usersEpoch
	img.users[e]++
	return e
}

// exit ends data I/O registered by enterLocked.
func (img *Image) exit(e uint64) {
	img.mu.Lock()
	if img.users[e]--; img.users[e] == 0 {
		delete(img.users, e)
		img.usersCond.Broadcast()
	}
	img.mu.Unlock()
}

// waitUsersLocked waits until all data I/O that mapped before now is done.
func (img *Image) waitUsersLocked() {
	old := img.usersEpoch
	img.usersEpoch++
	for {
		busy := false
		for e := range img.users {
			if e <= old {
				busy = true
				break
			}
		}
		if !busy {
			return
		}
		img.usersCond.Wait()
	}
}

var _ block.Device = (*Image)(nil)

// Open opens the qcow2 image at path, its external data file and its
// backing chain.
func Open(path string, o Options) (*Image, error) {
	if isPseudoFilename(path) { // file: and json: names
		p, _, err := SplitFilename(path, "qcow2")
		if err != nil {
			return nil, err
		}
		path = p
	}
	return openChain(path, o, o.seen)
}

func openChain(path string, o Options, seen map[string]bool) (*Image, error) {
	f, err := o.openLocked(path, roleImage)
	if err != nil {
		return nil, fmt.Errorf("qcow2: %w", err)
	}
	img, err := openFile(f, path, o, seen)
	if err != nil {
		f.Close()
		return nil, err
	}
	return img, nil
}

// readFirstCluster reads what parseHeader needs: the first cluster (the
// header, its extensions, the backing file's name), or the whole file if
// it is shorter. Its size is known from cluster_bits once the start is
// read; the largest cluster size, 2 MiB, was read and allocated for every
// image before, in each short `ovis img` run too. With cluster_bits out
// of range, parseHeader gets the 2 MiB and refuses the image as before.
func readFirstCluster(f block.File, fileSize int64) ([]byte, error) {
	n := min(fileSize, 1<<MaxClusterBits)
	var start [24]byte // to cluster_bits
	if fileSize >= int64(len(start)) {
		if err := block.ReadFull(f, start[:], 0); err != nil {
			return nil, err
		}
		if bits := binary.BigEndian.Uint32(start[20:]); bits >= MinClusterBits && bits <= MaxClusterBits {
			n = min(fileSize, 1<<bits)
		}
	}
	first := make([]byte, n)
	if err := block.ReadFull(f, first, 0); err != nil {
		return nil, err
	}
	return first, nil
}

func openFile(f block.File, path string, o Options, seen map[string]bool) (*Image, error) {
	fileSize, err := f.Size()
	if err != nil {
		return nil, fmt.Errorf("qcow2: %s: %w", path, err)
	}
	first, err := readFirstCluster(f, fileSize)
	if err != nil {
		return nil, fmt.Errorf("qcow2: %s: reading header: %w", path, err)
	}
	h, err := parseHeader(first, fileSize, o.ForCheck)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	img := &Image{
		path:        path,
		file:        f,
		data:        f,
		ro:          o.ReadOnly,
		hdr:         *h,
		clusterBits: h.ClusterBits,
		clusterSize: h.ClusterSize(),
		l2Entries:   h.L2Entries(),
		extL2:       h.ExtendedL2(),
		rcBits:      h.RefcountBits(),
		size:        int64(h.Size),
		compression: h.CompressionType,
		hasDataFile: h.HasDataFile(),
		dataFileRaw: h.DataFileRaw(),
		lazy:        h.LazyRefcounts(),
		v3:          h.Version >= 3,
		inflight:    make(map[int64]chan struct{}),
		users:       make(map[uint64]int),
		l1Dirty:     make(map[int]struct{}),
		rtDirty:     make(map[int]struct{}),
	}
	img.usersCond = sync.NewCond(&img.mu)
	img.nsub, img.subSize = 1, img.clusterSize
	if img.extL2 {
		img.nsub, img.subSize = subclustersPerCluster, img.clusterSize/subclustersPerCluster
	}
	img.rcPerBlock = img.clusterSize * 8 / int64(img.rcBits)
	img.hdrClustersN = 1
	img.freeHint = 1
	if h.IncompatibleFeatures&IncompatCorrupt != 0 && !o.ReadOnly {
		return nil, fmt.Errorf("%s: %w", path, ErrCorruptFlag)
	}
	img.forCheck = o.ForCheck
	if err := img.loadTables(fileSize); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	// Check reads the snapshot table itself, as QEMU's does.
	if !o.ForCheck {
		if img.snapshots, err = parseSnapshotTable(f, h.SnapshotsOffset, h.NbSnapshots, img.clusterSize, fileSize); err != nil {
			return nil, fmt.Errorf("%s: %w", path, err)
		}
	}
	// An unusable directory leaves the image without bitmaps: read-only
	// opens list none, and a writable one drops them.
	if img.loadBitmapDirectory(fileSize) != nil {
		img.bm.list = nil
	}
	staleBitmaps := img.bitmapExt() != nil && (!img.v3 || h.AutoclearFeatures&AutoclearBitmaps == 0)
	if staleBitmaps && o.Warn != nil {
		w := "a program lacking bitmap support modified this file, so all bitmaps are now considered inconsistent"
		if !img.v3 {
			w = "This qcow2 v2 image contains bitmaps, but they may have been modified by a program without persistent bitmap support; so now they must all be considered inconsistent"
		}
		o.Warn(w, "Some clusters may be leaked, run 'qemu-img check -r' on the image file to fix.")
	}

	l2n, slice, rcn, err := o.cacheSizes(img.clusterSize, img.size, h.L2EntrySize())
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	img.sliceSize = slice
	img.slEntries = slice / int64(h.L2EntrySize())
	img.l2policyName = o.L2CachePolicy
	img.l2 = newTableCache("L2 table", f, int(slice), l2n, o.L2CachePolicy, &img.mu)
	img.rc = newTableCache("refcount block", f, int(img.clusterSize), rcn, PolicyLRU, &img.mu)

	ok := false
	defer func() {
		if !ok {
			img.closeFiles()
		}
	}()
	if img.hasDataFile {
		if err := img.openDataFile(o); err != nil {
			return nil, err
		}
	}
	if h.BackingFile != "" && !o.NoBacking {
		// Probing an untrusted backing file is the classic attack: a raw
		// guest disk can hold a qcow2 header naming any host file.
		if o.Untrusted && h.BackingFormat == "" {
			return nil, fmt.Errorf("qcow2: %s: backing file %s has no backing format recorded in the image, and probing its format is %w", path, h.BackingFile, ErrUntrusted)
		}
		if err := img.openBacking(o, seen); err != nil {
			return nil, err
		}
	}
	if !o.ReadOnly {
		if h.IncompatibleFeatures&IncompatDirty != 0 {
			img.needRebuild = true
		}
		// Autoclear bits of features ovis does not maintain must be
		// cleared before it writes. Bitmaps it keeps (bitmap.go) unless
		// their directory is unusable; QEMU then drops them.
		keep := uint64(AutoclearDataFileRaw)
		if len(img.bm.list) > 0 {
			keep |= AutoclearBitmaps
		}
		if h.AutoclearFeatures&^keep != 0 || staleBitmaps {
			// As QEMU, a writer also drops a bitmaps extension that no
			// longer counts (its clusters stay leaked).
			img.hdr.AutoclearFeatures &= keep
			if staleBitmaps {
				img.setBitmapExt(nil, 0, 0)
			}
			if err := img.writeHeaderLocked(); err != nil {
				return nil, err
			}
		}
		for _, b := range img.bm.list {
			if b.Auto && !b.InUse {
				img.bm.pending.Store(true)
			}
		}
	}
	if o.CacheCleanInterval > 0 {
		img.stopClean = make(chan struct{})
		img.cleanDone = make(chan struct{})
		go img.cleanLoop(time.Duration(o.CacheCleanInterval) * time.Second)
	}
	ok = true
	return img, nil
}

// cleanLoop drops idle cache entries every interval until Close.
func (img *Image) cleanLoop(interval time.Duration) {
	defer close(img.cleanDone)
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-img.stopClean:
			return
		case <-t.C:
			img.mu.Lock()
			img.l2.cleanTickLocked()
			img.rc.cleanTickLocked()
			img.mu.Unlock()
		}
	}
}

// loadTables reads the L1 and refcount tables, checked against the file.
func (img *Image) loadTables(fileSize int64) error {
	h := &img.hdr
	l1 := make([]byte, int64(h.L1Size)*8)
	if err := block.ReadFull(img.file, l1, int64(h.L1TableOffset)); err != nil {
		return fmt.Errorf("qcow2: reading L1 table at %#x: %w", h.L1TableOffset, err)
	}
	img.l1 = make([]uint64, h.L1Size)
	for i := range img.l1 {
		e := binary.BigEndian.Uint64(l1[i*8:])
		img.l1[i] = e
		if off := e & l1OffsetMask; off != 0 && !img.forCheck {
			if off%uint64(img.clusterSize) != 0 {
				return corruptf("L1 entry %d: L2 table offset %#x is not cluster aligned", i, off)
			}
			if int64(off) >= fileSize {
				return corruptf("L1 entry %d: L2 table offset %#x is beyond the end of the file (%d bytes)", i, off, fileSize)
			}
		}
	}
	rt := make([]byte, int64(h.RefcountTableClusters)*img.clusterSize)
	if err := block.ReadFull(img.file, rt, int64(h.RefcountTableOffset)); err != nil {
		return fmt.Errorf("qcow2: reading refcount table at %#x: %w", h.RefcountTableOffset, err)
	}
	img.refTable = make([]uint64, len(rt)/8)
	for i := range img.refTable {
		e := binary.BigEndian.Uint64(rt[i*8:])
		img.refTable[i] = e
		if off := e & refTableMask; off != 0 && !img.forCheck {
			if off%uint64(img.clusterSize) != 0 {
				return corruptf("refcount table entry %d: block offset %#x is not cluster aligned", i, off)
			}
		}
	}
	return nil
}

func (img *Image) openDataFile(o Options) error {
	name := img.hdr.DataFile
	if name == "" {
		return fmt.Errorf("qcow2: %s: image uses an external data file but names none", img.path)
	}
	p := img.resolve(name)
	if o.Untrusted {
		real, err := Confine(img.path, p)
		if err != nil {
			return fmt.Errorf("qcow2: %s: data file refused: %w", img.path, err)
		}
		p = real
	}
	f, err := o.openLocked(p, roleData)
	if err != nil {
		return fmt.Errorf("qcow2: %s: opening data file: %w", img.path, err)
	}
	img.data = f
	return nil
}

// resolve interprets a backing or data file name relative to the image's
// folder, as QEMU does.
func (img *Image) resolve(name string) string {
	// A protocol name is not relative to the image (QEMU's
	// bdrv_get_full_backing_filename_from_filename).
	if filepath.IsAbs(name) || isPseudoFilename(name) {
		return name
	}
	return filepath.Join(filepath.Dir(img.path), name)
}

// Size returns the virtual size in bytes.
// SetPassDiscardRequest turns QEMU's pass-discard-request on or off: with
// it on, the host space of the clusters that guest discards (Discard, and
// WriteZeroes with mayUnmap) free is given back to the file system, as
// QEMU does for an image opened with discard=unmap (qemu-nbd
// --discard=unmap). Off, the default, keeps the space in the file for
// reuse, as QEMU's default discard=ignore.
func (img *Image) SetPassDiscardRequest(on bool) {
	img.mu.Lock()
	img.passDiscard = on
	img.mu.Unlock()
}

func (img *Image) Size() int64 {
	img.gate.RLock()
	defer img.gate.RUnlock()
	return img.size
}

// ClusterSize returns the cluster size in bytes.
func (img *Image) ClusterSize() int64 { return img.clusterSize }

// Header returns a copy of the image header as it is now.
func (img *Image) Header() Header {
	img.mu.Lock()
	defer img.mu.Unlock()
	h := img.hdr
	return h
}

// QemuSnapshots reads the snapshot table of an image opened ForCheck as
// QEMU's qcow2_open does, for describing an image (qemu-img info): the
// count and the table offset are validated, entries past the end of the
// file read as zeros, and the snapshots' L1 tables are not looked at.
// Errors carry QEMU's text, its hint on a line of its own.
func (img *Image) QemuSnapshots() ([]Snapshot, error) {
	if !img.forCheck {
		return img.snapshots, nil
	}
	nb, off := uint64(img.hdr.NbSnapshots), img.hdr.SnapshotsOffset
	if nb > maxSnapshots {
		return nil, errors.New("Snapshot table too large")
	}
	if math.MaxInt64-nb*snapshotFixedLen < off || off%uint64(img.clusterSize) != 0 {
		return nil, errors.New("Snapshot table offset invalid")
	}
	snaps, _, _, _, err := img.readSnapshotsForCheck(&CheckResult{}, off, int(nb), false)
	var h snapshotHintError
	if errors.As(err, &h) && h.hint != "" {
		return nil, fmt.Errorf("%s\n%s", h.msg, h.hint)
	}
	return snaps, err
}

// Snapshots returns the internal snapshot table. The caller must not
// modify the returned slice.
func (img *Image) Snapshots() []Snapshot { return img.snapshots }

// Backing returns the open backing device, or nil if there is none (or
// it was not opened).
func (img *Image) Backing() block.Device { return img.backing }

// BackingPath returns the backing file name resolved against the image's
// folder, or "" if the image has no backing file.
func (img *Image) BackingPath() string {
	if img.hdr.BackingFile == "" {
		return ""
	}
	return img.resolve(img.hdr.BackingFile)
}

// CacheStats returns the counters of the L2 and refcount caches.
func (img *Image) CacheStats() (l2, refcount CacheStats) {
	img.mu.Lock()
	defer img.mu.Unlock()
	return img.l2.statsLocked(), img.rc.statsLocked()
}

// Close flushes, marks the image clean and closes its files and its
// backing chain. A second Close returns block.ErrClosed.
func (img *Image) Close() error {
	img.mu.Lock()
	if img.closed {
		img.mu.Unlock()
		return block.ErrClosed
	}
	img.mu.Unlock()
	var first error
	if img.bm.tracking.Load() {
		// The tracked bitmaps are stored, and their in-use flag
		// cleared, before the final flush.
		first = img.exclusive(context.Background(), img.storeOnCloseLocked)
	}
	if !img.ro && first == nil {
		first = img.Flush(context.Background())
		if first == nil {
			first = img.markClean()
		}
	}
	img.mu.Lock()
	img.closed = true
	img.mu.Unlock()
	if img.stopClean != nil {
		close(img.stopClean)
		<-img.cleanDone
	}
	if err := img.closeFiles(); err != nil && first == nil {
		first = err
	}
	return first
}

func (img *Image) closeFiles() error {
	var first error
	if img.backing != nil {
		if err := img.backing.Close(); err != nil {
			first = err
		}
	}
	if img.data != img.file {
		if err := img.data.Close(); err != nil && first == nil {
			first = err
		}
	}
	if err := img.file.Close(); err != nil && first == nil {
		first = err
	}
	return first
}

func (img *Image) checkOpen() error {
	img.mu.Lock()
	defer img.mu.Unlock()
	if img.closed {
		return block.ErrClosed
	}
	return nil
}

// writeHeaderLocked encodes the header and writes and syncs cluster 0.
// Called with mu held (or before the image is shared); header updates are
// rare and must not interleave with each other.
func (img *Image) writeHeaderLocked() error {
	buf, err := img.hdr.Encode()
	if err != nil {
		return err
	}
	if _, err := img.file.WriteAt(buf, 0); err != nil {
		return fmt.Errorf("qcow2: writing header: %w", err)
	}
	return img.file.Sync()
}

var errReadOnly = block.ErrReadOnly

func isNeedLoad(err error) (*needLoad, bool) {
	var nl *needLoad
	if errors.As(err, &nl) {
		return nl, true
	}
	return nil, false
}
