package qcow2

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"
	"strings"
	"syscall"
)

// RepairMode selects what Check repairs (qemu-img check -r).
type RepairMode int

const (
	RepairNone  RepairMode = iota
	RepairLeaks            // -r leaks
	RepairAll              // -r all
)

// Reserved bits QEMU's check reports (spec: L1, L2 and refcount table
// entries).
const (
	l1ReservedMask    = 0x7f000000000001ff
	l2StdReservedMask = 0x3f000000000001fe
	refTableReserved  = 0x1ff
)

// ErrNeedRebuild is returned by Check with RepairLeaks when the refcount
// structures are too broken to repair in place (QEMU fails with EIO and
// "ERROR need to rebuild refcount structures"; -r all rebuilds them).
var ErrNeedRebuild = fmt.Errorf("qcow2: refcount structures need a rebuild: %w", syscall.EIO)

// maxCheckClusters bounds the clusters a repair grows the file to so that
// a refcount block lies inside it: 2^26 clusters, 512 MiB of counts.
const maxCheckClusters = 1 << 26

// RepairKind says what one repair changed.
type RepairKind int

const (
	// RepairRefcount set cluster Cluster's refcount from Before to After.
	RepairRefcount RepairKind = iota + 1
	// RepairCopiedL1 rewrote L1 entry Index from Before to After (COPIED).
	RepairCopiedL1
	// RepairCopiedL2 rewrote an L2 entry from Before to After (COPIED);
	// Offset is the entry's position in the file.
	RepairCopiedL2
	// RepairMisaligned turned a misaligned preallocated zero entry at
	// Offset (Before) into a plain zero entry (After).
	RepairMisaligned
	// RepairRefblockOutside grew the file so that refcount block Index,
	// at Offset, lies inside it.
	RepairRefblockOutside
	// RepairRebuild wrote a new refcount table at Offset (After clusters)
	// and new refcount blocks in free clusters.
	RepairRebuild
)

// Repair is one change Check made to the image, in the order made.
type Repair struct {
	Kind          RepairKind
	Cluster       int64
	Index         int64
	Offset        uint64
	Before, After uint64
}

// CheckResult is what Check found, with qemu-img check's counters.
type CheckResult struct {
	CheckErrors        int
	Corruptions        int
	Leaks              int
	CorruptionsFixed   int
	LeaksFixed         int
	ImageEndOffset     int64
	TotalClusters      int64
	AllocatedClusters  int64
	FragmentedClusters int64
	CompressedClusters int64
	// Messages are the lines qemu-img prints on stderr for each problem
	// found or repaired, in order and in QEMU's wording.
	Messages []string
	// Repairs are the changes made to the image, in order.
	Repairs []Repair
}

func (r *CheckResult) msg(format string, args ...any) {
	r.Messages = append(r.Messages, fmt.Sprintf(format, args...))
}

// counters returns r without its message and repair lists: QEMU saves and
// restores its counters between passes, but what it printed stays printed.
func (r *CheckResult) counters() CheckResult {
	c := *r
	c.Messages, c.Repairs = nil, nil
	return c
}

func (r *CheckResult) setCounters(c CheckResult) {
	c.Messages, c.Repairs = r.Messages, r.Repairs
	*r = c
}

// repairing is QEMU's prefix for a problem that is being repaired.
func repairing(fixing bool) string {
	if fixing {
		return "Repairing"
	}
	return "ERROR"
}

// checker walks the metadata as it is on disk, counting references and
// recording problems instead of failing on them (QEMU's
// calculate_refcounts).
type checker struct {
	ctx      context.Context
	img      *Image
	res      *CheckResult
	fix      RepairMode
	fileSize int64
	refs     []uint64 // computed references per host cluster
	// rebuild is set when the refcount structures cannot be repaired in
	// place.
	rebuild bool
}

// readZeroFilled reads n bytes at off; bytes past the end of the file read as
// zeros, as QEMU's block layer reads them.
func (img *Image) readZeroFilled(off uint64, n int64) ([]byte, error) {
	buf := make([]byte, n)
	got, err := img.file.ReadAt(buf, int64(off))
	if err != nil && !errors.Is(err, io.EOF) && got < len(buf) {
		return nil, fmt.Errorf("qcow2: reading %d bytes at %#x: %w", n, off, err)
	}
	return buf, nil
}

// inc counts one reference to each cluster of [off, off+n) (QEMU's
// qcow2_inc_refcounts_imrt). Less than a cluster past the end of the file
// is allowed, as the last cluster may be partly written.
func (k *checker) inc(off uint64, n int64) {
	if n <= 0 {
		return
	}
	cs := uint64(k.img.clusterSize)
	if end := off + uint64(n); end < off || end >= uint64(k.fileSize) && end-uint64(k.fileSize) >= cs {
		k.res.Corruptions++
		k.res.msg("ERROR: counting reference for region exceeding the end of the file by one cluster or more: offset %#x size %#x", off, n)
		return
	}
	first, last := off/cs, (off+uint64(n)-1)/cs
	if last >= uint64(len(k.refs)) {
		k.refs = append(k.refs, make([]uint64, last+1-uint64(len(k.refs)))...)
	}
	for i := first; i <= last; i++ {
		k.incCluster(i)
	}
}

// incCluster counts one reference to cluster i. The count saturates at
// the largest refcount the image's width holds, each reference past it a
// corruption, as QEMU counts: a repair must never write a count that
// wraps to a smaller one (0 would free a cluster in use).
func (k *checker) incCluster(i uint64) {
	if k.refs[i] >= k.img.maxRefcount() {
		k.res.Corruptions++
		k.res.msg("ERROR: overflow cluster offset=%#x", i*uint64(k.img.clusterSize))
		k.res.msg("Use qemu-img amend to increase the refcount entry width or qemu-img convert to create a clean copy if the image cannot be opened for writing")
		return
	}
	k.refs[i]++
}

// l1 counts one L1 table and the L2 tables and data it maps. active
// selects the fragmentation bookkeeping and allows repairs of entries.
func (k *checker) l1(off uint64, size uint32, active bool) error {
	if size == 0 {
		return nil
	}
	k.inc(off, int64(size)*8)
	raw, err := k.img.readZeroFilled(off, int64(size)*8)
	if err != nil {
		k.res.CheckErrors++
		k.res.msg("ERROR: I/O error in check_refcounts_l1")
		return err
	}
	cs := uint64(k.img.clusterSize)
	for i := uint32(0); i < size; i++ {
		e := binary.BigEndian.Uint64(raw[i*8:])
		if e == 0 {
			continue
		}
		if e&l1ReservedMask != 0 {
			k.res.Corruptions++
			k.res.msg("ERROR found L1 entry with reserved bits set: %x", e)
		}
		l2off := e & l1OffsetMask
		k.inc(l2off, int64(cs))
		if l2off%cs != 0 {
			k.res.Corruptions++
			k.res.msg("ERROR l2_offset=%x: Table is not cluster aligned; L1 entry corrupted", l2off)
		}
		if err := k.l2(l2off, active); err != nil {
			return err
		}
		// Between tables: a repair of one (zeroEntry) is complete.
		if err := k.ctx.Err(); err != nil {
			return err
		}
	}
	return nil
}

// l2 counts the clusters one L2 table maps (QEMU's check_refcounts_l2).
// With RepairAll it turns misaligned preallocated zero clusters into
// plain zero clusters.
func (k *checker) l2(l2off uint64, active bool) error {
	img := k.img
	cs := uint64(img.clusterSize)
	buf, err := img.readZeroFilled(l2off, int64(cs))
	if err != nil {
		k.res.CheckErrors++
		k.res.msg("ERROR: I/O error in check_refcounts_l2")
		return err
	}
	// Fragmentation is judged within each table, as QEMU does.
	var next uint64
	for j := int64(0); j < img.l2Entries; j++ {
		m := img.readEntry(buf, j)
		compressed := m.entry&flagCompressed != 0
		if !compressed && m.entry&l2StdReservedMask != 0 {
			k.res.Corruptions++
			k.res.msg("ERROR found l2 entry with reserved bits set: %x", m.entry)
		}
		if compressed {
			if m.entry&flagCopied != 0 {
				k.res.Corruptions++
				k.res.msg("ERROR: coffset=%#x: copied flag must never be set for compressed clusters", m.entry&img.compOffsetMask())
				m.entry &^= flagCopied
			}
			if img.hasDataFile {
				k.res.Corruptions++
				k.res.msg("ERROR compressed cluster %d with data file, entry=%#x", j, m.entry)
				continue
			}
			if img.extL2 && m.bitmap != 0 {
				k.res.Corruptions++
				k.res.msg("ERROR compressed cluster %d with non-zero subcluster allocation bitmap, entry=%#x", j, m.entry)
				continue
			}
			off, n := img.compressedRange(m.entry)
			// QEMU counts from the unaligned offset (same clusters).
			k.inc(off, n)
			if active {
				k.res.AllocatedClusters++
				k.res.CompressedClusters++
				k.res.FragmentedClusters++
			}
			continue
		}
		h, has := img.host(m)
		if !has {
			if img.extL2 && uint32(m.bitmap) != 0 {
				k.res.Corruptions++
				k.res.msg("ERROR: Unallocated cluster has non-zero subcluster allocation map")
			}
			continue
		}
		if img.extL2 && uint32(m.bitmap)&uint32(m.bitmap>>32) != 0 {
			k.res.Corruptions++
			k.res.msg("ERROR offset=%x: Allocated cluster has corrupted subcluster allocation bitmap", h)
		}
		if h%cs != 0 {
			k.res.Corruptions++
			data := m.entry&flagZero == 0
			if img.extL2 {
				data = uint32(m.bitmap) != 0
			}
			if data {
				k.res.msg("ERROR offset=%x: Data cluster is not properly aligned; L2 entry corrupted.", h)
			} else {
				fixing := k.fix == RepairAll
				k.res.msg("%s offset=%x: Preallocated cluster is not properly aligned; L2 entry corrupted.", repairing(fixing), h)
				if fixing {
					if err := k.zeroEntry(l2off, buf, j, m); err != nil {
						return err
					}
					// The cluster is no longer referenced.
					continue
				}
			}
		}
		if active {
			k.res.AllocatedClusters++
			if next != 0 && h != next {
				k.res.FragmentedClusters++
			}
			next = h + cs
		}
		if !img.hasDataFile {
			k.inc(h, int64(cs))
		}
	}
	return nil
}

// zeroEntry rewrites L2 entry j of the table at l2off as a plain zero
// cluster (QEMU's fix_l2_entry_by_zero).
func (k *checker) zeroEntry(l2off uint64, buf []byte, j int64, m mapping) error {
	img := k.img
	nm := mapping{entry: flagZero}
	if img.extL2 {
		// Allocated subclusters become zero ones.
		nm = mapping{bitmap: (m.bitmap | m.bitmap<<32) &^ 0xffffffff}
	}
	img.writeEntry(buf, j, nm)
	esz := int64(8)
	if img.extL2 {
		esz = 16
	}
	pos := int64(l2off) + j*esz
	if _, err := img.file.WriteAt(buf[j*esz:(j+1)*esz], pos); err != nil {
		k.res.CheckErrors++
		k.res.msg("ERROR: Failed to overwrite L2 table entry: %v", err)
		return nil
	}
	if err := img.file.Sync(); err != nil {
		return fmt.Errorf("qcow2: syncing L2 entry at %#x: %w", pos, err)
	}
	img.forgetTableLocked(l2off &^ uint64(img.clusterSize-1))
	k.res.Corruptions--
	k.res.CorruptionsFixed++
	k.res.Repairs = append(k.res.Repairs, Repair{Kind: RepairMisaligned, Offset: uint64(pos), Before: m.entry, After: nm.entry})
	return nil
}

// compOffsetMask is the host-offset part of a compressed descriptor.
func (img *Image) compOffsetMask() uint64 {
	return uint64(1)<<(62-(img.clusterBits-8)) - 1
}

// refblocks counts the refcount blocks the refcount table names (QEMU's
// check_refblocks); with RepairAll a block past the end of the file is
// brought inside it by growing the file.
func (k *checker) refblocks() error {
	img := k.img
	cs := uint64(img.clusterSize)
	for i, e := range img.refTable {
		off := e & refTableMask
		c := off / cs
		if e&refTableReserved != 0 {
			k.res.Corruptions++
			k.res.msg("ERROR refcount table entry %d has reserved bits set", i)
			k.rebuild = true
			continue
		}
		if off%cs != 0 {
			k.res.Corruptions++
			k.res.msg("ERROR refcount block %d is not cluster aligned; refcount table entry corrupted", i)
			k.rebuild = true
			continue
		}
		if c >= uint64(len(k.refs)) {
			k.res.Corruptions++
			fixing := k.fix == RepairAll
			k.res.msg("%s refcount block %d is outside image", repairing(fixing), i)
			if !fixing {
				continue
			}
			// QEMU cannot grow the file past the largest int64, and
			// refuses to check more than INT_MAX clusters.
			if off > math.MaxInt64-cs {
				k.rebuild = true
				k.res.msg("ERROR could not resize image: Invalid argument")
				continue
			}
			// QEMU grows the file to whatever the entry names (a
			// file system refuses past its largest file: EFBIG) and
			// counts every cluster up to it (4 TiB of 4 KiB clusters:
			// 8 GiB of counts here). Past maxCheckClusters the file is
			// only grown to learn whether it can be, then cut back,
			// and the table is rebuilt without the entry.
			if err := img.file.Truncate(int64(off + cs)); err != nil {
				k.rebuild = true
				reason := strerrorOf(err)
				k.res.msg(ErrorReport+"Could not resize file: %s", reason)
				k.res.msg("ERROR could not resize image: %s", reason)
				continue
			}
			if c >= maxCheckClusters {
				if err := img.file.Truncate(k.fileSize); err != nil {
					return fmt.Errorf("qcow2: check: restoring the file size: %w", err)
				}
				k.rebuild = true
				if c >= math.MaxInt32 {
					// QEMU refuses to check more than INT_MAX clusters.
					k.res.msg("ERROR could not resize image: File too large")
				} else {
					k.res.msg("ERROR could not resize image: Cannot allocate memory")
				}
				continue
			}
			k.fileSize = int64(off + cs)
			k.refs = append(k.refs, make([]uint64, c+1-uint64(len(k.refs)))...)
			k.res.Corruptions--
			k.res.CorruptionsFixed++
			k.res.Repairs = append(k.res.Repairs, Repair{Kind: RepairRefblockOutside, Index: int64(i), Offset: off})
			// A fresh cluster: its only reference is this one.
			k.inc(off, int64(cs))
			continue
		}
		if off == 0 {
			continue
		}
		k.inc(off, int64(cs))
		if n := k.refs[c]; n != 1 {
			k.res.Corruptions++
			k.res.msg("ERROR refcount block %d refcount=%d", i, n)
			k.rebuild = true
		}
	}
	return nil
}

// calculate counts the references of every cluster: header, active L1
// and its tables, snapshots, refcount table, bitmaps, refcount blocks.
func (img *Image) calculateLocked(ctx context.Context, res *CheckResult, fix RepairMode) (*checker, error) {
	fileSize, err := img.file.Size()
	if err != nil {
		return nil, fmt.Errorf("qcow2: check: file size: %w", err)
	}
	cs := img.clusterSize
	k := &checker{ctx: ctx, img: img, res: res, fix: fix, fileSize: fileSize, refs: make([]uint64, (fileSize+cs-1)/cs)}
	k.inc(0, cs)
	if err := k.l1(img.hdr.L1TableOffset, img.hdr.L1Size, true); err != nil {
		return nil, err
	}
	// Snapshots share no data clusters with an external data file, so
	// QEMU counts their mere presence as one corruption (and still walks
	// their tables).
	if img.hasDataFile && len(img.snapshots) > 0 {
		res.Corruptions++
		res.msg("ERROR %d snapshots in image with data file", len(img.snapshots))
	}
	for _, s := range img.snapshots {
		if s.L1TableOffset%uint64(cs) != 0 {
			res.Corruptions++
			res.msg("ERROR snapshot %s (%s) l1_offset=%#x: L1 table is not cluster aligned; snapshot table entry corrupted", s.ID, s.Name, s.L1TableOffset)
			continue
		}
		if int64(s.L1Size) > maxL1Bytes/8 {
			res.Corruptions++
			res.msg("ERROR snapshot %s (%s) l1_size=%#x: L1 table is too large; snapshot table entry corrupted", s.ID, s.Name, s.L1Size)
			continue
		}
		if err := k.l1(s.L1TableOffset, s.L1Size, false); err != nil {
			return nil, err
		}
	}
	if img.forCheck {
		k.inc(img.hdr.SnapshotsOffset, img.checkSnapSize)
	} else if len(img.snapshots) > 0 {
		k.inc(img.hdr.SnapshotsOffset, snapshotTableLen(img.snapshots))
	}
	k.inc(img.hdr.RefcountTableOffset, int64(len(img.refTable))*8)
	bm := &refCounter{img: img, refs: make([]uint32, len(k.refs))}
	if err := img.countBitmaps(bm, fileSize); err != nil {
		res.Corruptions++
		res.msg("ERROR bitmaps: %v", err)
	}
	for i, n := range bm.refs {
		for range n {
			k.incCluster(uint64(i))
		}
	}
	if err := k.refblocks(); err != nil {
		return nil, err
	}
	return k, nil
}

// liveRefcounts reads and writes the refcounts stored in the image
// through the in-memory refcount table, writing through to the file.
// A misaligned refcount block is a corruption event reported on res.
type liveRefcounts struct {
	img    *Image
	res    *CheckResult
	blocks map[uint64][]byte
}

func (img *Image) liveRefcountsLocked(res *CheckResult) *liveRefcounts {
	return &liveRefcounts{img: img, res: res, blocks: make(map[uint64][]byte)}
}

// block returns the refcount block covering cluster i, or nil if none.
func (l *liveRefcounts) block(i int64) (uint64, []byte, error) {
	img := l.img
	b := i / img.rcPerBlock
	if b >= int64(len(img.refTable)) {
		return 0, nil, nil
	}
	off := img.refTable[b] & refTableMask
	if off == 0 {
		return 0, nil, nil
	}
	if off%uint64(img.clusterSize) != 0 {
		img.signalCorruptionLocked(l.res, "Refblock offset %s unaligned (reftable index: %s)", cHex(off), cHex(uint64(b)))
		return 0, nil, errIO
	}
	if buf, ok := l.blocks[off]; ok {
		return off, buf, nil
	}
	// QEMU's block layer refuses a request past the largest int64 with
	// EIO; short of that, bytes past the end of the file read as zeros.
	if off > math.MaxInt64-uint64(img.clusterSize) {
		return 0, nil, errIO
	}
	buf, err := img.readZeroFilled(off, img.clusterSize)
	if err != nil {
		return 0, nil, err
	}
	l.blocks[off] = buf
	return off, buf, nil
}

func (l *liveRefcounts) get(i int64) (uint64, error) {
	_, buf, err := l.block(i)
	if buf == nil || err != nil {
		return 0, err
	}
	return getRefcount(buf, i%l.img.rcPerBlock, l.img.rcBits), nil
}

func (l *liveRefcounts) set(i int64, v uint64) error {
	off, buf, err := l.block(i)
	if err != nil {
		return err
	}
	if buf == nil {
		return fmt.Errorf("qcow2: no refcount block for cluster %d", i)
	}
	setRefcount(buf, i%l.img.rcPerBlock, l.img.rcBits, v)
	if _, err := l.img.file.WriteAt(buf, int64(off)); err != nil {
		return fmt.Errorf("qcow2: writing refcount block at %#x: %w", off, err)
	}
	return nil
}

// compare compares the computed references with the stored refcounts
// (QEMU's compare_refcounts), repairing what fix allows: leaks with
// RepairLeaks or RepairAll, refcounts too low (but not 0) with RepairAll.
// A refcount of 0 under a reference needs a rebuild. It returns the
// highest cluster in use.
func (k *checker) compare(fix RepairMode) (int64, error) {
	img := k.img
	live := img.liveRefcountsLocked(k.res)
	res := k.res
	var highest int64
	for i := range int64(len(k.refs)) {
		rc, err := live.get(i)
		if err != nil {
			res.msg("Can't get refcount for cluster %d: %v", i, err)
			res.CheckErrors++
			continue
		}
		ref := k.refs[i]
		if rc > 0 || ref > 0 {
			highest = i
		}
		if rc == ref {
			continue
		}
		var fixed *int
		switch {
		case rc == 0:
			k.rebuild = true
		case rc > ref && fix != RepairNone:
			fixed = &res.LeaksFixed
		case rc < ref && fix == RepairAll:
			fixed = &res.CorruptionsFixed
		}
		word := "Leaked"
		switch {
		case fixed != nil:
			word = "Repairing"
		case rc < ref:
			word = "ERROR"
		}
		if fixed != nil {
			// Each repair is one refcount (and the freed cluster's
			// zeroing): stopping between them leaves leaks at worst.
			if err := k.ctx.Err(); err != nil {
				return highest, k.stopCompare(live, err)
			}
		}
		res.msg("%s cluster %d refcount=%d reference=%d", word, i, rc, ref)
		if fixed != nil {
			if err := live.set(i, ref); err == nil {
				if ref == 0 {
					// QEMU discards a cluster it frees; ovis never punches
					// holes (see hostholes.go), so it zeroes it instead and
					// the file reads as QEMU's repaired copy does.
					if err := img.zeroClusterLocked(i); err != nil {
						return highest, err
					}
				}
				*fixed++
				res.Repairs = append(res.Repairs, Repair{Kind: RepairRefcount, Cluster: i, Before: rc, After: ref})
				continue
			}
		}
		if rc < ref {
			res.Corruptions++
		} else {
			res.Leaks++
		}
	}
	if len(live.blocks) > 0 && fix != RepairNone {
		if err := img.file.Sync(); err != nil {
			return highest, fmt.Errorf("qcow2: syncing refcount repairs: %w", err)
		}
	}
	return highest, nil
}

// stopCompare syncs the refcount repairs made so far and returns err, the
// context's error that stopped compare.
func (k *checker) stopCompare(live *liveRefcounts, err error) error {
	if len(live.blocks) > 0 {
		if serr := k.img.file.Sync(); serr != nil {
			return fmt.Errorf("qcow2: syncing refcount repairs: %w", serr)
		}
	}
	return err
}

// Check verifies the image's metadata as qemu-img check does, and repairs
// it with RepairLeaks or RepairAll (the image must be open read-write),
// following QEMU's qcow2_check_refcounts: count, compare, then either
// repair refcounts in place or (RepairAll, when a refcount block or a
// refcount of 0 is wrong) rebuild the refcount structures in free
// clusters, then check the COPIED flags. Like QEMU it does not check
// again after repairing: the result's counters describe this pass, and
// callers that want qemu-img's "Double checking" run Check(RepairNone).
// Dirty cached metadata is flushed first. It returns ErrNeedRebuild when
// RepairLeaks meets damage only a rebuild repairs.
func (img *Image) Check(repair RepairMode) (*CheckResult, error) {
	return img.CheckContext(context.Background(), repair)
}

// CheckContext is Check that stops once ctx is done, returning ctx's
// error with the result so far. It stops only between repairs, each of
// which leaves the image consistent: a refcount, an L2 table's COPIED
// flags, a whole refcount rebuild or snapshot table rewrite. A stop
// leaves what was not repaired yet as it was, and at worst leaks
// clusters (the old structures of a rebuild not freed yet).
func (img *Image) CheckContext(ctx context.Context, repair RepairMode) (*CheckResult, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if repair != RepairNone && img.ro {
		return nil, errReadOnly
	}
	img.gate.Lock()
	defer img.gate.Unlock()
	if !img.ro {
		if err := img.flush(); err != nil {
			return nil, err
		}
	}
	img.flushMu.Lock()
	defer img.flushMu.Unlock()
	img.mu.Lock()
	defer img.mu.Unlock()
	cs := img.clusterSize
	res := &CheckResult{TotalClusters: (img.size + cs - 1) / cs}
	// The snapshot table's counters are kept apart until the end, as
	// QEMU keeps them (qcow2_co_check_locked).
	var sres CheckResult
	var err error
	if img.forCheck {
		err = img.checkReadSnapshotsLocked(res, &sres, repair)
	}
	if err == nil {
		err = ctx.Err()
	}
	if err == nil {
		err = img.checkRefcountsLocked(ctx, res, repair)
	}
	if repair != RepairNone {
		// Repairs went around the caches (which the flush left clean):
		// start them afresh.
		img.rc = newTableCache(img.rc.name, img.file, int(cs), img.rc.capacity, PolicyLRU, &img.mu)
		img.l2 = newTableCache(img.l2.name, img.file, img.l2.entrySize, img.l2.capacity, img.l2policyName, &img.mu)
		img.freeHint, img.runHint, img.compTail = 1, 0, 0
	}
	if err == nil && img.forCheck {
		if err = ctx.Err(); err == nil {
			err = img.checkFixSnapshotsLocked(res, &sres, repair)
		}
	}
	res.CheckErrors += sres.CheckErrors
	res.Corruptions += sres.Corruptions
	res.Leaks += sres.Leaks
	res.CorruptionsFixed += sres.CorruptionsFixed
	res.LeaksFixed += sres.LeaksFixed
	// A stopped repair keeps the dirty bit: the refcounts it did not
	// reach may still be too low, as a killed qemu-img leaves them.
	if repair != RepairNone && (err == nil || ctx.Err() == nil) {
		clean := err == nil && res.CheckErrors == 0 && res.Corruptions == 0
		if merr := img.markCheckedLocked(clean); err == nil {
			err = merr
		}
	}
	return res, err
}

// markCheckedLocked updates the header after a repair. QEMU clears the
// dirty bit whenever it closes a writable image, even when the repair
// failed, and the corrupt bit only when no corruption is left
// (qcow2_mark_clean, qcow2_mark_consistent). A dirty image that is still
// corrupt keeps needRebuild, so that ovis rebuilds before writing.
func (img *Image) markCheckedLocked(clean bool) error {
	bits := img.hdr.IncompatibleFeatures & IncompatDirty
	if clean {
		bits |= img.hdr.IncompatibleFeatures & IncompatCorrupt
		img.needRebuild = false
	}
	img.markedDirty = false
	if bits == 0 {
		return nil
	}
	img.hdr.IncompatibleFeatures &^= bits
	return img.writeHeaderLocked()
}

// checkRefcountsLocked is one pass of QEMU's qcow2_check_refcounts.
func (img *Image) checkRefcountsLocked(ctx context.Context, res *CheckResult, fix RepairMode) error {
	k, err := img.calculateLocked(ctx, res, fix)
	if err != nil {
		return err
	}
	// Without a rebuild, a repair compares again from these counters.
	pre := res.counters()
	highest, err := k.compare(RepairNone)
	if err != nil {
		return err
	}
	// The comparison repaired nothing yet.
	if err := ctx.Err(); err != nil {
		return err
	}
	switch {
	case k.rebuild && fix == RepairAll:
		old := res.counters()
		res.msg("Rebuilding refcount structure")
		if err := img.rebuildInPlaceLocked(res, k.refs); err != nil {
			res.CheckErrors++
			return err
		}
		res.Corruptions, res.Leaks = 0, 0
		// The new table replaced the old one: count again. Stopping
		// from here on leaves the old structures leaked.
		k, err = img.calculateLocked(ctx, res, RepairNone)
		if err != nil {
			return err
		}
		// The old structures are leaked now; anything else that
		// leaks was made by the rebuild.
		saved := res.counters()
		res.setCounters(CheckResult{})
		highest, err = k.compare(RepairLeaks)
		if err != nil {
			return err
		}
		if k.rebuild {
			res.msg("ERROR rebuilt refcount structure is still broken")
		}
		fresh := res.Leaks
		res.setCounters(saved)
		if res.Corruptions < old.Corruptions {
			res.CorruptionsFixed += old.Corruptions - res.Corruptions
		}
		if res.Leaks < old.Leaks {
			res.LeaksFixed += old.Leaks - res.Leaks
		}
		res.Leaks += fresh
	case fix != RepairNone:
		if k.rebuild {
			res.msg("ERROR need to rebuild refcount structures")
			res.CheckErrors++
			return ErrNeedRebuild
		}
		if res.Leaks != 0 || res.Corruptions != 0 {
			res.setCounters(pre)
			if highest, err = k.compare(fix); err != nil {
				return err
			}
		}
	}
	if err := img.checkCopiedLocked(ctx, res, fix); err != nil {
		return err
	}
	res.ImageEndOffset = (highest + 1) * img.clusterSize
	return nil
}

// rebuildInPlaceLocked writes new refcount blocks and a new refcount
// table for the computed references refs, in clusters refs shows free
// (QEMU's rebuild_refcount_structure), and points the header at them.
// The old structures stay as they are, counted but unreferenced: the
// caller frees them as leaks.
func (img *Image) rebuildInPlaceLocked(res *CheckResult, refs []uint64) error {
	cs := img.clusterSize
	// Work on a copy grown in whole refcount blocks, as the blocks are
	// written as slices of it.
	r := &imrt{refs: append([]uint64(nil), refs...)}
	r.reserveOldBlocks(img.refTable, cs)
	var table []uint64
	grown, err := img.writeRefblocksLocked(r, 0, int64(len(r.refs)), &table)
	if err != nil {
		return err
	}
	var tOff, tClusters int64
	for grown {
		tClusters = (int64(len(table))*8 + cs - 1) / cs
		var free int64
		tOff = r.alloc(tClusters, &free)
		// The table's own clusters changed refcounts that may already
		// be on disk: write their blocks again.
		if grown, err = img.writeRefblocksLocked(r, tOff, tOff+tClusters, &table); err != nil {
			return err
		}
	}
	buf := make([]byte, len(table)*8)
	for i, v := range table {
		binary.BigEndian.PutUint64(buf[i*8:], v)
	}
	if _, err := img.file.WriteAt(buf, tOff*cs); err != nil {
		return fmt.Errorf("qcow2: writing refcount table at %#x: %w", tOff*cs, err)
	}
	if err := img.file.Sync(); err != nil {
		return fmt.Errorf("qcow2: syncing rebuilt refcounts: %w", err)
	}
	img.hdr.RefcountTableOffset = uint64(tOff * cs)
	img.hdr.RefcountTableClusters = uint32(tClusters)
	if err := img.writeHeaderLocked(); err != nil {
		return err
	}
	img.refTable = table
	clear(img.rtDirty)
	img.rc = newTableCache(img.rc.name, img.file, int(cs), img.rc.capacity, PolicyLRU, &img.mu)
	res.Repairs = append(res.Repairs, Repair{Kind: RepairRebuild, Offset: uint64(tOff * cs), After: uint64(tClusters)})
	return nil
}

// imrt is an in-memory refcount table used to place rebuilt structures.
type imrt struct{ refs []uint64 }

// reserveOldBlocks marks used the clusters of every refcount block the
// old table names, even those check could not count (reserved bits set,
// misaligned). Until the header points at the new table the old one
// stays intact, never written over, as QEMU's overlap check demands of a
// rebuild; the clusters reserved only here are leaked by the rebuild and
// freed right after it.
func (r *imrt) reserveOldBlocks(table []uint64, cs int64) {
	for _, e := range table {
		// Unsigned: a corrupt entry may name any offset, even past
		// the largest int64.
		c := (e & refTableMask) / uint64(cs)
		if c == 0 {
			continue
		}
		if c < uint64(len(r.refs)) {
			r.refs[c] = max(r.refs[c], 1)
		}
		// A misaligned block spans two clusters.
		if e&refTableMask%uint64(cs) != 0 && c+1 < uint64(len(r.refs)) {
			r.refs[c+1] = max(r.refs[c+1], 1)
		}
	}
}

func (r *imrt) get(i int64) uint64 {
	if i < int64(len(r.refs)) {
		return r.refs[i]
	}
	return 0
}

// alloc finds n free clusters in a row from *first on, growing the table
// past the end of the image if needed, marks them used and returns the
// first. *first moves to the first free cluster seen.
func (r *imrt) alloc(n int64, first *int64) int64 {
	c, run, gap := *first, int64(0), true
	for ; c < int64(len(r.refs)) && run < n; c++ {
		if r.refs[c] == 0 {
			run++
			if gap {
				*first, gap = c, false
			}
		} else {
			run = 0
		}
	}
	if run < n {
		if end := c + n - run; end > int64(len(r.refs)) {
			r.refs = append(r.refs, make([]uint64, end-int64(len(r.refs)))...)
		}
	}
	c -= run
	for i := range n {
		r.refs[c+i] = 1
	}
	return c
}

// writeRefblocksLocked writes the refcount block of every block-sized
// range with a used cluster in [first, end), allocating the blocks not
// yet in table. It reports whether table had to grow.
func (img *Image) writeRefblocksLocked(r *imrt, first, end int64, table *[]uint64) (bool, error) {
	cs := img.clusterSize
	per := img.rcPerBlock
	var free int64
	grown := false
	buf := make([]byte, cs)
	for c := first; c < end; c++ {
		if r.get(c) == 0 {
			continue
		}
		b := c / per
		start := b * per
		var off int64
		if b < int64(len(*table)) && (*table)[b] != 0 {
			off = int64((*table)[b])
		} else {
			// Never place a block in a range already written.
			free = max(free, start)
			bc := r.alloc(1, &free)
			off = bc * cs
			if bc >= end {
				// The block holding this block's refcount must be
				// written too.
				end = bc + 1
			}
			if b >= int64(len(*table)) {
				n := ((b+1)*8 + cs - 1) / cs * cs / 8
				*table = append(*table, make([]uint64, n-int64(len(*table)))...)
				grown = true
			}
			(*table)[b] = uint64(off)
		}
		clear(buf)
		for i := range per {
			v := r.get(start + i)
			if v > img.maxRefcount() {
				return false, fmt.Errorf("qcow2: cluster %d has %d references, more than %d-bit refcounts hold", start+i, v, img.rcBits)
			}
			setRefcount(buf, i, img.rcBits, v)
		}
		if _, err := img.file.WriteAt(buf, off); err != nil {
			return false, fmt.Errorf("qcow2: writing refcount block at %#x: %w", off, err)
		}
		c = start + per - 1
	}
	return grown, nil
}

// checkCopiedLocked checks the COPIED flags of the active tables against
// the stored refcounts (QEMU's check_oflag_copied). RepairAll repairs
// them; RepairLeaks only when nothing else is wrong, as only then are the
// refcounts trustworthy.
func (img *Image) checkCopiedLocked(ctx context.Context, res *CheckResult, fix RepairMode) error {
	repair := fix == RepairAll ||
		(fix == RepairLeaks && res.CheckErrors == 0 && res.Corruptions == 0 && res.Leaks == 0)
	cs := uint64(img.clusterSize)
	live := img.liveRefcountsLocked(res)
	for i, e := range img.l1 {
		l2off := e & l1OffsetMask
		if l2off == 0 {
			continue
		}
		// Between tables: each table's flags are written at once.
		if err := ctx.Err(); err != nil {
			return img.stopCopied(fix, err)
		}
		if r, err := live.get(int64(l2off / cs)); err == nil && (r == 1) != (e&flagCopied != 0) {
			res.Corruptions++
			res.msg("%s OFLAG_COPIED L2 cluster: l1_index=%d l1_entry=%x refcount=%d", repairing(repair), i, e, r)
			if repair {
				ne := e &^ flagCopied
				if r == 1 {
					ne |= flagCopied
				}
				// QEMU's overlap check refuses this write when the L1
				// table is also the entry's L2 table, and fails the
				// check with the refcount repairs unwritten; ovis
				// wrote them already, and only this flag makes the
				// result consistent.
				if err := img.writeL1EntryLocked(i, ne); err != nil {
					res.CheckErrors++
					return err
				}
				res.Corruptions--
				res.CorruptionsFixed++
				res.Repairs = append(res.Repairs, Repair{Kind: RepairCopiedL1, Index: int64(i), Before: e, After: ne})
			}
		}
		buf, err := img.readZeroFilled(l2off, int64(cs))
		if err != nil {
			res.msg("ERROR: Could not read L2 table: %v", err)
			res.CheckErrors++
			return err
		}
		var changed []Repair
		for j := int64(0); j < img.l2Entries; j++ {
			m := img.readEntry(buf, j)
			h, has := img.host(m)
			if !has || m.entry&flagCompressed != 0 {
				continue
			}
			r := uint64(1)
			if !img.hasDataFile {
				if r, err = live.get(int64(h / cs)); err != nil {
					continue
				}
			}
			if (r == 1) == (m.entry&flagCopied != 0) {
				continue
			}
			res.Corruptions++
			res.msg("%s OFLAG_COPIED data cluster: l2_entry=%x refcount=%d", repairing(repair), m.entry, r)
			if repair {
				nm := m
				nm.entry &^= flagCopied
				if r == 1 {
					nm.entry |= flagCopied
				}
				img.writeEntry(buf, j, nm)
				changed = append(changed, Repair{Kind: RepairCopiedL2, Offset: l2off + uint64(j)*uint64(len(buf))/uint64(img.l2Entries), Before: m.entry, After: nm.entry})
			}
		}
		if len(changed) > 0 {
			// QEMU's overlap check: an L2 table a corrupt L1 entry
			// places on other metadata is never written.
			if what := img.overlapLocked(l2off, cs, "active L2 table"); what != "" {
				img.signalCorruptionLocked(res, "Preventing invalid write on metadata (overlaps with %s)", what)
				res.msg("ERROR: Could not write L2 table; metadata overlap check failed: Input/output error")
				res.CheckErrors++
				return img.stopCopied(fix, errIO)
			}
			img.forgetTableLocked(l2off)
			if _, err := img.file.WriteAt(buf, int64(l2off)); err != nil {
				res.msg("ERROR: Could not write L2 table: %v", err)
				res.CheckErrors++
				return fmt.Errorf("qcow2: writing L2 table at %#x: %w", l2off, err)
			}
			res.Corruptions -= len(changed)
			res.CorruptionsFixed += len(changed)
			res.Repairs = append(res.Repairs, changed...)
		}
	}
	if fix != RepairNone {
		if err := img.file.Sync(); err != nil {
			return fmt.Errorf("qcow2: syncing COPIED repairs: %w", err)
		}
	}
	return nil
}

// overlapLocked returns the name QEMU gives the metadata that a write of
// [off, off+n) would overlap, other than the kind ign the write is meant
// for, or "" (qcow2_check_metadata_overlap in QEMU's default "cached"
// mode, which leaves out inactive L2 tables; ranges are whole clusters).
func (img *Image) overlapLocked(off, n uint64, ign string) string {
	cs := uint64(img.clusterSize)
	start := off &^ (cs - 1)
	end := (off + n + cs - 1) &^ (cs - 1)
	hit := func(o, l uint64) bool { return l > 0 && o < end && start < o+l }
	h := &img.hdr
	if start < cs && ign != "qcow2_header" {
		return "qcow2_header"
	}
	if ign != "active L1 table" && hit(h.L1TableOffset, uint64(len(img.l1))*8) {
		return "active L1 table"
	}
	if ign != "active L2 table" {
		for _, e := range img.l1 {
			if o := e & l1OffsetMask; o != 0 && hit(o, cs) {
				return "active L2 table"
			}
		}
	}
	if ign != "refcount table" && hit(h.RefcountTableOffset, uint64(len(img.refTable))*8) {
		return "refcount table"
	}
	if ign != "refcount block" {
		for _, e := range img.refTable {
			if o := e & refTableMask; o != 0 && hit(o, cs) {
				return "refcount block"
			}
		}
	}
	snapLen := img.checkSnapSize
	if !img.forCheck {
		snapLen = snapshotTableLen(img.snapshots)
	}
	if ign != "snapshot table" && hit(h.SnapshotsOffset, uint64(max(snapLen, 0))) {
		return "snapshot table"
	}
	if ign != "inactive L1 table" {
		for _, sn := range img.snapshots {
			if hit(sn.L1TableOffset, uint64(sn.L1Size)*8) {
				return "inactive L1 table"
			}
		}
	}
	if ign != "bitmap directory" && h.Version >= 3 && h.AutoclearFeatures&AutoclearBitmaps != 0 {
		for _, e := range h.Extensions {
			if e.Type == extBitmaps && len(e.Data) >= 24 {
				be := binary.BigEndian
				if hit(be.Uint64(e.Data[16:]), be.Uint64(e.Data[8:])) {
					return "bitmap directory"
				}
			}
		}
	}
	return ""
}

// stopCopied syncs the COPIED repairs made so far and returns err, the
// context's error that stopped checkCopiedLocked.
func (img *Image) stopCopied(fix RepairMode, err error) error {
	if fix != RepairNone {
		if serr := img.file.Sync(); serr != nil {
			return fmt.Errorf("qcow2: syncing COPIED repairs: %w", serr)
		}
	}
	return err
}

// writeL1EntryLocked sets active L1 entry i in memory and on disk.
func (img *Image) writeL1EntryLocked(i int, e uint64) error {
	img.l1[i] = e
	var b [8]byte
	binary.BigEndian.PutUint64(b[:], e)
	off := int64(img.hdr.L1TableOffset) + int64(i)*8
	if _, err := img.file.WriteAt(b[:], off); err != nil {
		return fmt.Errorf("qcow2: writing L1 entry %d at %#x: %w", i, off, err)
	}
	return nil
}

// zeroClusterLocked overwrites host cluster i with zeros, up to the end
// of the file: like QEMU's discard, it never grows the file.
func (img *Image) zeroClusterLocked(i int64) error {
	off := i * img.clusterSize
	size, err := img.file.Size()
	if err != nil {
		return fmt.Errorf("qcow2: zeroing freed cluster at %#x: %w", off, err)
	}
	n := min(img.clusterSize, size-off)
	if n <= 0 {
		return nil
	}
	if _, err := img.file.WriteAt(make([]byte, n), off); err != nil {
		return fmt.Errorf("qcow2: zeroing freed cluster at %#x: %w", off, err)
	}
	return nil
}

// strerrorOf is err's errno as C's strerror words it, or err's text.
func strerrorOf(err error) string {
	var errno syscall.Errno
	if errors.As(err, &errno) {
		s := errno.Error()
		return strings.ToUpper(s[:1]) + s[1:]
	}
	return err.Error()
}

// errIO is EIO as qemu-img prints it; errors.Is(errIO, syscall.EIO).
var errIO error = ioError{}

type ioError struct{}

func (ioError) Error() string        { return "Input/output error" }
func (ioError) Is(target error) bool { return target == syscall.EIO }

// cHex formats v as C's %#x does: 0 has no prefix.
func cHex(v uint64) string {
	if v == 0 {
		return "0"
	}
	return fmt.Sprintf("%#x", v)
}

// signalCorruptionLocked reports a corruption event as QEMU's
// qcow2_signal_corruption does: only the first one is printed, and a
// writable image is marked corrupt on disk.
func (img *Image) signalCorruptionLocked(res *CheckResult, format string, args ...any) {
	if img.corruptSignalled {
		return
	}
	img.corruptSignalled = true
	what := fmt.Sprintf(format, args...)
	if img.ro {
		res.msg("qcow2: Image is corrupt: %s; further non-fatal corruption events will be suppressed", what)
		return
	}
	res.msg("qcow2: Marking image as corrupt: %s; further corruption events will be suppressed", what)
	img.hdr.IncompatibleFeatures |= IncompatCorrupt
	if err := img.writeHeaderLocked(); err != nil {
		res.CheckErrors++
		res.msg("ERROR: marking the image corrupt: %v", err)
	}
}
