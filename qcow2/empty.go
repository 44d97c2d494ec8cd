package qcow2

import (
	"context"
	"encoding/binary"
	"fmt"
)

// This file empties an image wholesale, as QEMU's make_completely_empty
// does for qemu-img commit: the header stays in cluster 0, a one-cluster
// refcount table follows in cluster 1, its one refcount block in cluster
// 2, an empty L1 table of the same size from cluster 3, and the file ends
// there. The layout is QEMU's byte for byte; the order of the writes is
// not. QEMU marks the image dirty and overwrites the live tables in
// place, so a crash in between leaves refcounts that only a repair on the
// next open makes right. Here every state a crash can leave is a sound,
// clean image: the image passes through a temporary set of tables written
// past the end of the file.
//
//  1. Past the end of the file (or past cluster 2+L1, if the file is
//     shorter), a temporary empty L1 table, refcount table and refcount
//     blocks are written and synced. They count only the header and
//     themselves. The header still names the old tables, which nothing
//     has touched; the new clusters are unreferenced and, lying past the
//     end of the file, counted 0 by the old refcount blocks, as every
//     cluster there is on a sound image.
//  2. The header is pointed at the temporary tables (one write of cluster
//     0) and synced. The image now reads entirely from its backing file.
//     Every old cluster, cluster 1 onwards, is unreferenced and counted 0:
//     free space, not even a leak.
//  3. The final tables are written over clusters 1 to 2+L1, which the
//     header in use does not reference and counts free, and synced.
//  4. The header is pointed at the final tables and synced. The
//     temporary tables are now unreferenced and counted 0 in turn.
//  5. The file is cut after the final L1 table and synced. Until then it
//     is only longer than it needs to be.
//
// A header write only follows a sync of every table it names, so no
// crash leaves a header naming tables that are not on disk whole.

// canEmptyWholeLocked reports whether the image can be emptied wholesale:
// QEMU's conditions in qcow2_make_empty (a version 3 image without
// snapshots, bitmaps or external data file, whose new tables fit in one
// refcount block). A damaged image (fatalEvent) is left to MakeEmpty's
// discard path, which refuses it as every write does.
func (img *Image) canEmptyWholeLocked() bool {
	for _, e := range img.hdr.Extensions {
		if e.Type == extBitmaps {
			return false
		}
	}
	return img.v3 && len(img.snapshots) == 0 && !img.hasDataFile && img.fatalEvent == nil &&
		3+img.clustersFor(int64(img.hdr.L1Size)*8) <= img.rcPerBlock
}

// emptyWhole empties the image wholesale when canEmptyWholeLocked allows,
// under the exclusive gate, and reports whether it did. It is not
// interrupted once begun: it writes a few clusters of tables.
func (img *Image) emptyWhole(ctx context.Context) (bool, error) {
	if img.ro {
		return false, nil // MakeEmpty's discard path refuses it
	}
	done := false
	err := img.exclusive(ctx, func() error {
		if !img.canEmptyWholeLocked() {
			return nil
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		done = true
		return img.emptyWholeLocked()
	})
	if err != nil {
		return done, fmt.Errorf("qcow2: make empty: %w", err)
	}
	return done, nil
}

// emptyWholeLocked runs the steps above. Only inside exclusive.
func (img *Image) emptyWholeLocked() error {
	cs := img.clusterSize
	l1c := img.clustersFor(int64(img.hdr.L1Size) * 8)
	fileSize, err := img.file.Size()
	if err != nil {
		return err
	}
	final := 3 + l1c // clusters of the emptied file

	// 1. The temporary tables.
	start := max(img.clustersFor(fileSize), final)
	tmp, tmpTable, tmpRefTable, err := img.emptyTables(start, l1c)
	if err != nil {
		return err
	}
	if _, err := img.file.WriteAt(tmp, start*cs); err != nil {
		return fmt.Errorf("writing temporary tables at %#x: %w", start*cs, err)
	}
	if err := img.file.Sync(); err != nil {
		return err
	}
	// 2. The header names them. The refcounts they hold are exact, so a
	// lazy-refcounts image is clean from here on.
	old := img.hdr
	img.hdr.L1TableOffset = uint64(start * cs)
	img.hdr.RefcountTableOffset = uint64(tmpTable * cs)
	img.hdr.RefcountTableClusters = uint32(int64(len(tmpRefTable)) * 8 / cs)
	img.hdr.IncompatibleFeatures &^= IncompatDirty
	if err := img.writeHeaderLocked(); err != nil {
		img.hdr = old
		return err
	}
	// The in-memory state follows the header: nothing refers to an old
	// cluster any more. Should a later step fail, the image is left
	// sound on the temporary tables.
	img.resetEmptyLocked(tmpRefTable)
	tmpHdr := img.hdr

	// 3. The final tables: QEMU's layout.
	tables := make([]byte, (2+l1c)*cs)
	binary.BigEndian.PutUint64(tables, uint64(2*cs))
	for i := int64(0); i < final; i++ {
		setRefcount(tables[cs:2*cs], i, img.rcBits, 1)
	}
	if _, err := img.file.WriteAt(tables, cs); err != nil {
		return fmt.Errorf("writing tables at %#x: %w", cs, err)
	}
	if err := img.file.Sync(); err != nil {
		return err
	}
	// 4. The header names them.
	img.hdr.L1TableOffset = uint64(3 * cs)
	img.hdr.RefcountTableOffset = uint64(cs)
	img.hdr.RefcountTableClusters = 1
	if err := img.writeHeaderLocked(); err != nil {
		img.hdr = tmpHdr
		return err
	}
	table := make([]uint64, cs/8)
	table[0] = uint64(2 * cs)
	img.resetEmptyLocked(table)
	img.freeHint = final

	// 5. The end of the file.
	if err := img.file.Truncate(final * cs); err != nil {
		return fmt.Errorf("cutting the file at %#x: %w", final*cs, err)
	}
	return img.file.Sync()
}

// emptyTables lays out the temporary tables from host cluster start: an
// empty L1 table of l1c clusters, a refcount table, and one refcount
// block for cluster 0 and one for each block range the tables themselves
// reach, every table counted once. It returns their bytes, the host
// cluster of the refcount table and its entries.
func (img *Image) emptyTables(start, l1c int64) (buf []byte, table int64, entries []uint64, err error) {
	cs, per := img.clusterSize, img.rcPerBlock
	// The blocks needed depend on how far the tables reach, which depends
	// on how many blocks there are: grow both until they hold.
	tableClusters, blocks := int64(1), int64(1)
	var first, last int64 // block ranges the tables reach
	for {
		end := start + l1c + tableClusters + blocks // exclusive
		first, last = start/per, (end-1)/per
		nb := last - first + 1
		if first > 0 {
			nb++ // and block 0, for the header
		}
		nt := max(((last+1)*8+cs-1)/cs, 1)
		if nb <= blocks && nt <= tableClusters {
			break
		}
		blocks, tableClusters = max(nb, blocks), max(nt, tableClusters)
	}
	if tableClusters*cs > maxRefcountTableBytes {
		return nil, 0, nil, fmt.Errorf("temporary refcount table of %d clusters exceeds %d bytes", tableClusters, maxRefcountTableBytes)
	}
	table = start + l1c
	n := l1c + tableClusters + blocks
	buf = make([]byte, n*cs)
	// The blocks, in order of the range they count: block 0 (unless the
	// tables reach into its range too), then first..last.
	ranges := make([]int64, 0, blocks)
	if first > 0 {
		ranges = append(ranges, 0)
	}
	for b := first; b <= last; b++ {
		ranges = append(ranges, b)
	}
	entries = make([]uint64, tableClusters*cs/8)
	blockAt := make(map[int64][]byte, len(ranges))
	for i, b := range ranges {
		at := table + tableClusters + int64(i)
		entries[b] = uint64(at * cs)
		binary.BigEndian.PutUint64(buf[l1c*cs+b*8:], entries[b])
		blockAt[b] = buf[(at-start)*cs : (at-start+1)*cs]
	}
	count := func(c int64) { setRefcount(blockAt[c/per], c%per, img.rcBits, 1) }
	count(0)
	for c := start; c < start+n; c++ {
		count(c)
	}
	return buf, table, entries, nil
}

// resetEmptyLocked makes the in-memory state that of an empty image with
// the given refcount table: no L1 entry, nothing cached, nothing waiting
// to be freed.
func (img *Image) resetEmptyLocked(refTable []uint64) {
	img.refTable = refTable
	img.l1 = make([]uint64, img.hdr.L1Size)
	clear(img.l1Dirty)
	clear(img.rtDirty)
	img.l2 = newTableCache(img.l2.name, img.file, img.l2.entrySize, img.l2.capacity, img.l2policyName, &img.mu)
	img.rc = newTableCache(img.rc.name, img.file, int(img.clusterSize), img.rc.capacity, PolicyLRU, &img.mu)
	img.pendingFree = nil
	clear(img.pendingPunch)
	img.freeHint, img.runHint, img.compTail = 1, 0, 0
	img.allocGen++
	img.scan = runScan{}
	img.needRebuild, img.markedDirty = false, false
	// The overlap index is rebuilt from the new tables when next needed;
	// the host runs found before may now be holes.
	img.metaAtOpen = nil
	img.hostRuns.Store(nil)
	img.hostGen.Add(1)
}
