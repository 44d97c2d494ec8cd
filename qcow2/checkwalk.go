package qcow2

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
)

// This file holds Check's callbacks on the tree walk (treewalk.go), QEMU's
// calculate_refcounts: counting the references of every cluster from the
// header, the active and snapshot L1 and L2 tables, the refcount table and
// blocks, reporting the damage met on the way and repairing what is
// repaired while walking (misaligned zero entries, refcount blocks past
// the end of the file).

// Reserved bits QEMU's check reports (spec: L1, L2 and refcount table
// entries).
const (
	l1ReservedMask    = 0x7f000000000001ff
	l2StdReservedMask = 0x3f000000000001fe
	refTableReserved  = 0x1ff
)

// maxCheckClusters bounds the clusters a repair grows the file to so that
// a refcount block lies inside it: 2^26 clusters, 512 MiB of counts.
const maxCheckClusters = 1 << 26

// checker is check's visitor of the metadata as it is on disk, counting
// references and recording problems instead of failing on them (QEMU's
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
	// next is the host offset that would continue the last cluster of
	// the active L2 table being walked (0 at a table's start).
	next uint64
	// bitmapRefs holds the bitmap references until the bitmap walk is
	// done (nil before the first).
	bitmapRefs []uint32
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

// readTable reads a table for the walk, bytes past the end of the file
// as zeros, and reports a failure as QEMU's check does.
func (k *checker) readTable(kind refKind, off uint64, n int64) ([]byte, error) {
	buf, err := k.img.readZeroFilled(off, n)
	if err != nil {
		k.res.CheckErrors++
		if kind == refL1 {
			k.res.msg("ERROR: I/O error in check_refcounts_l1")
		} else {
			k.res.msg("ERROR: I/O error in check_refcounts_l2")
		}
	}
	return buf, err
}

// ref counts one reference. Bitmap references are counted only after
// the whole bitmap walk, as QEMU counts them.
func (k *checker) ref(r hostRef) error {
	switch r.kind {
	case refL2:
		k.inc(r.off, r.n)
		if r.off%uint64(k.img.clusterSize) != 0 {
			k.res.Corruptions++
			k.res.msg("ERROR l2_offset=%x: Table is not cluster aligned; L1 entry corrupted", r.off)
		}
	case refBitmapDir, refBitmapTable, refBitmapData:
		if r.n <= 0 {
			return nil
		}
		if k.bitmapRefs == nil {
			k.bitmapRefs = make([]uint32, len(k.refs))
		}
		// Bitmap clusters past the end of the file are not counted.
		first, last := k.img.refClusters(r)
		for i := first; i <= last && i < uint64(len(k.bitmapRefs)); i++ {
			k.bitmapRefs[i]++
		}
	default:
		k.inc(r.off, r.n)
	}
	return nil
}

// l1Entry reports reserved bits of an L1 entry; every nonzero entry's
// table is walked, even at offset 0.
func (k *checker) l1Entry(_ int, e uint64) bool {
	if e&l1ReservedMask != 0 {
		k.res.Corruptions++
		k.res.msg("ERROR found L1 entry with reserved bits set: %x", e)
	}
	return true
}

// l2Done runs between tables: a repair of one (zeroEntry) is complete.
// Fragmentation is judged within each table, as QEMU does.
func (k *checker) l2Done(*l2Visit) error {
	k.next = 0
	return k.ctx.Err()
}

// l2Entry checks one L2 entry (QEMU's check_refcounts_l2) and says
// whether its clusters count. With RepairAll it turns misaligned
// preallocated zero clusters into plain zero clusters.
func (k *checker) l2Entry(t *l2Visit, j int64, m mapping) (bool, error) {
	img := k.img
	cs := uint64(img.clusterSize)
	compressed := m.entry&flagCompressed != 0
	if !compressed && m.entry&l2StdReservedMask != 0 {
		k.res.Corruptions++
		k.res.msg("ERROR found l2 entry with reserved bits set: %x", m.entry)
	}
	if compressed {
		if m.entry&flagCopied != 0 {
			k.res.Corruptions++
			k.res.msg("ERROR: coffset=%#x: copied flag must never be set for compressed clusters", m.entry&img.compOffsetMask())
		}
		if img.hasDataFile {
			k.res.Corruptions++
			k.res.msg("ERROR compressed cluster %d with data file, entry=%#x", j, m.entry)
			return false, nil
		}
		if img.extL2 && m.bitmap != 0 {
			k.res.Corruptions++
			k.res.msg("ERROR compressed cluster %d with non-zero subcluster allocation bitmap, entry=%#x", j, m.entry)
			return false, nil
		}
		if t.active {
			k.res.AllocatedClusters++
			k.res.CompressedClusters++
			k.res.FragmentedClusters++
		}
		// QEMU counts from the unaligned offset (same clusters).
		return true, nil
	}
	h, has := img.host(m)
	if !has {
		if img.extL2 && uint32(m.bitmap) != 0 {
			k.res.Corruptions++
			k.res.msg("ERROR: Unallocated cluster has non-zero subcluster allocation map")
		}
		return false, nil
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
				// The cluster is no longer referenced.
				return false, k.zeroEntry(t.off, t.buf, j, m)
			}
		}
	}
	if t.active {
		k.res.AllocatedClusters++
		if k.next != 0 && h != k.next {
			k.res.FragmentedClusters++
		}
		k.next = h + cs
	}
	return true, nil
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

// refblock counts the refcount block entry i of the refcount table names
// (QEMU's check_refblocks); with RepairAll a block past the end of the
// file is brought inside it by growing the file.
func (k *checker) refblock(i int, e uint64) error {
	img := k.img
	cs := uint64(img.clusterSize)
	off := e & refTableMask
	c := off / cs
	if e&refTableReserved != 0 {
		k.res.Corruptions++
		k.res.msg("ERROR refcount table entry %d has reserved bits set", i)
		k.rebuild = true
		return nil
	}
	if off%cs != 0 {
		k.res.Corruptions++
		k.res.msg("ERROR refcount block %d is not cluster aligned; refcount table entry corrupted", i)
		k.rebuild = true
		return nil
	}
	if c >= uint64(len(k.refs)) {
		k.res.Corruptions++
		fixing := k.fix == RepairAll
		k.res.msg("%s refcount block %d is outside image", repairing(fixing), i)
		if !fixing {
			return nil
		}
		// QEMU cannot grow the file past the largest int64, and
		// refuses to check more than INT_MAX clusters.
		if off > math.MaxInt64-cs {
			k.rebuild = true
			k.res.msg("ERROR could not resize image: Invalid argument")
			return nil
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
			return nil
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
			return nil
		}
		k.fileSize = int64(off + cs)
		k.refs = append(k.refs, make([]uint64, c+1-uint64(len(k.refs)))...)
		k.res.Corruptions--
		k.res.CorruptionsFixed++
		k.res.Repairs = append(k.res.Repairs, Repair{Kind: RepairRefblockOutside, Index: int64(i), Offset: off})
		// A fresh cluster: its only reference is this one.
		k.inc(off, int64(cs))
		return nil
	}
	if off == 0 {
		return nil
	}
	k.inc(off, int64(cs))
	if n := k.refs[c]; n != 1 {
		k.res.Corruptions++
		k.res.msg("ERROR refcount block %d refcount=%d", i, n)
		k.rebuild = true
	}
	return nil
}

// calculateLocked counts the references of every cluster (QEMU's
// calculate_refcounts): header, active L1 and its tables, snapshots,
// snapshot table, refcount table, bitmaps, refcount blocks.
func (img *Image) calculateLocked(ctx context.Context, res *CheckResult, fix RepairMode) (*checker, error) {
	fileSize, err := img.file.Size()
	if err != nil {
		return nil, fmt.Errorf("qcow2: check: file size: %w", err)
	}
	cs := img.clusterSize
	k := &checker{ctx: ctx, img: img, res: res, fix: fix, fileSize: fileSize, refs: make([]uint64, (fileSize+cs-1)/cs)}
	v := &treeVisitor{
		img: img, fileSize: fileSize, refcounts: true,
		read: k.readTable, ref: k.ref, l1Entry: k.l1Entry, l2Entry: k.l2Entry, l2Done: k.l2Done,
		snapshot: k.snapshot, bitmapsDone: k.bitmapsDone, refblock: k.refblock,
	}
	if err := v.walk(); err != nil {
		return nil, err
	}
	return k, nil
}

// snapshot reports a snapshot table entry whose L1 table cannot be
// walked.
func (k *checker) snapshot(i int, s Snapshot) (bool, error) {
	img, res := k.img, k.res
	// Snapshots share no data clusters with an external data file, so
	// QEMU counts their mere presence as one corruption (and still walks
	// their tables).
	if i == 0 && img.hasDataFile {
		res.Corruptions++
		res.msg("ERROR %d snapshots in image with data file", len(img.snapshots))
	}
	if s.L1TableOffset%uint64(img.clusterSize) != 0 {
		res.Corruptions++
		res.msg("ERROR snapshot %s (%s) l1_offset=%#x: L1 table is not cluster aligned; snapshot table entry corrupted", s.ID, s.Name, s.L1TableOffset)
		return false, nil
	}
	if int64(s.L1Size) > maxL1Bytes/8 {
		res.Corruptions++
		res.msg("ERROR snapshot %s (%s) l1_size=%#x: L1 table is too large; snapshot table entry corrupted", s.ID, s.Name, s.L1Size)
		return false, nil
	}
	return true, nil
}

// bitmapsDone counts the bitmap references and reports the bitmap
// walk's failure as a corruption.
func (k *checker) bitmapsDone(err error) error {
	if err != nil {
		k.res.Corruptions++
		k.res.msg("ERROR bitmaps: %v", err)
	}
	for i, n := range k.bitmapRefs {
		for range n {
			k.incCluster(uint64(i))
		}
	}
	return nil
}
