package qcow2

import (
	"encoding/binary"
	"errors"
	"fmt"
)

// getRefcount reads entry i of a refcount block of the given width.
// Sub-byte widths count from bit 0 as the least significant bit.
func getRefcount(buf []byte, i int64, bits int) uint64 {
	switch bits {
	case 64:
		return binary.BigEndian.Uint64(buf[i*8:])
	case 32:
		return uint64(binary.BigEndian.Uint32(buf[i*4:]))
	case 16:
		return uint64(binary.BigEndian.Uint16(buf[i*2:]))
	case 8:
		return uint64(buf[i])
	}
	bit := i * int64(bits)
	return uint64(buf[bit/8]>>(bit%8)) & (1<<bits - 1)
}

func setRefcount(buf []byte, i int64, bits int, v uint64) {
	switch bits {
	case 64:
		binary.BigEndian.PutUint64(buf[i*8:], v)
	case 32:
		binary.BigEndian.PutUint32(buf[i*4:], uint32(v))
	case 16:
		binary.BigEndian.PutUint16(buf[i*2:], uint16(v))
	case 8:
		buf[i] = byte(v)
	default:
		bit := i * int64(bits)
		mask := byte(1<<bits-1) << (bit % 8)
		buf[bit/8] = buf[bit/8]&^mask | byte(v)<<(bit%8)&mask
	}
}

func (img *Image) maxRefcount() uint64 {
	if img.rcBits == 64 {
		return ^uint64(0)
	}
	return 1<<img.rcBits - 1
}

// refBlockLocked returns the cached refcount block covering host cluster
// idx, or nil when the refcount table has no block for it.
func (img *Image) refBlockLocked(idx int64) (*cacheEntry, error) {
	b := idx / img.rcPerBlock
	if b >= int64(len(img.refTable)) {
		return nil, nil
	}
	off := img.refTable[b] & refTableMask
	if off == 0 {
		return nil, nil
	}
	return img.rc.peekLocked(off)
}

// refcountLocked returns the refcount of host cluster idx.
func (img *Image) refcountLocked(idx int64) (uint64, error) {
	e, err := img.refBlockLocked(idx)
	if err != nil || e == nil {
		return 0, err
	}
	return getRefcount(e.buf, idx%img.rcPerBlock, img.rcBits), nil
}

// addRefLocked adds delta to the refcount of host cluster idx. The block
// covering idx must exist unless delta is positive, in which case one is
// allocated.
func (img *Image) addRefLocked(idx int64, delta int64) error {
	e, err := img.refBlockLocked(idx)
	if err != nil {
		return err
	}
	if e == nil {
		if delta < 0 {
			return corruptf("refcount of cluster %#x would drop below zero (no refcount block)", idx*img.clusterSize)
		}
		if e, err = img.newRefBlockLocked(idx); err != nil {
			return err
		}
	}
	i := idx % img.rcPerBlock
	v := getRefcount(e.buf, i, img.rcBits)
	switch {
	case delta < 0 && v < uint64(-delta):
		return corruptf("refcount of cluster %#x would drop below zero (is %d)", idx*img.clusterSize, v)
	case delta > 0 && img.maxRefcount()-v < uint64(delta):
		return fmt.Errorf("qcow2: refcount of cluster %#x would overflow %d bits", idx*img.clusterSize, img.rcBits)
	}
	setRefcount(e.buf, i, img.rcBits, uint64(int64(v)+delta))
	img.rc.markDirtyLocked(e)
	if delta > 0 {
		img.allocGen++
	}
	if delta < 0 && uint64(int64(v)+delta) == 0 {
		img.freeHint = min(img.freeHint, idx)
		if img.compTail != 0 && int64(img.compTail/uint64(img.clusterSize)) == idx {
			img.compTail = 0
		}
	}
	return nil
}

// newRefBlockLocked creates the refcount block covering idx, which the
// caller is about to count. The block is placed in the first other free
// cluster of the range it covers, so that it counts itself. Its table
// entry reaches disk only after the block (Flush step 2).
func (img *Image) newRefBlockLocked(idx int64) (*cacheEntry, error) {
	b := idx / img.rcPerBlock
	if b >= int64(len(img.refTable)) {
		return nil, fmt.Errorf("qcow2: internal error: refcount block %d beyond table", b)
	}
	first := b * img.rcPerBlock
	// No block covers this range, so every cluster in it is free.
	at := max(first, img.hdrClustersN)
	if at == idx {
		at++ // idx is the cluster the caller is counting
	}
	if at >= first+img.rcPerBlock {
		return nil, fmt.Errorf("qcow2: internal error: no room for refcount block %d", b)
	}
	if err := img.checkAllocOverlapLocked(at, 1); err != nil {
		return nil, err
	}
	buf := make([]byte, img.clusterSize)
	setRefcount(buf, at-first, img.rcBits, 1)
	off := uint64(at * img.clusterSize)
	e := img.rc.insertLocked(off, buf)
	img.refTable[b] = off
	img.rtDirty[int(b)] = struct{}{}
	return e, nil
}

// allocClusterLocked finds a free host cluster, sets its refcount to 1
// and returns its offset.
func (img *Image) allocClusterLocked() (uint64, error) {
	return img.allocRunLocked(1)
}

// allocRunLocked allocates n contiguous free host clusters, for any n.
// Refcount blocks missing for the run are placed in free clusters just
// before it, inside the same free stretch, so a run never has to make
// room for its own blocks (placing a block inside the run and searching
// again, as before, never ended for runs longer than a block's range).
//
// A *needLoad or *needGrow return keeps the search's progress in
// img.scan, so that a run spanning more refcount blocks than the cache
// holds still completes.
func (img *Image) allocRunLocked(n int64) (off uint64, err error) {
	if n < 1 {
		return 0, fmt.Errorf("qcow2: internal error: allocating %d clusters", n)
	}
	idx := max(img.freeHint, img.hdrClustersN)
	if n > 1 {
		// Runs start after the last run, so that small holes below it
		// are not rescanned for every run (they still serve single
		// clusters).
		idx = max(idx, img.runHint)
	}
	s := &img.scan
	if s.rc != img.rc || s.gen != img.allocGen || s.from < idx {
		s.reset()
	} else {
		idx = s.from
	}
	defer func() {
		var ng *needGrow
		if _, ok := isNeedLoad(err); ok || errors.As(err, &ng) {
			s.rc, s.gen, s.from = img.rc, img.allocGen, idx
			return
		}
		s.reset()
	}()
	for {
		// k new blocks go at idx..idx+k-1 and the run follows; k is the
		// number of uncovered ranges the whole stretch overlaps, which
		// grows with the stretch, so iterate to the fixed point.
		var k int64
		for {
			m := img.missingBlocks(idx, idx+n+k)
			if m <= k {
				break
			}
			k = m
		}
		total := n + k
		if (idx+total-1)/img.rcPerBlock >= int64(len(img.refTable)) {
			return 0, &needGrow{need: idx + total}
		}
		used, err := img.firstUsedLocked(idx, total)
		if err != nil {
			return 0, err
		}
		if used >= 0 {
			if used == idx && idx == img.freeHint {
				img.freeHint++
			}
			idx = used + 1
			s.unpin()
			continue
		}
		if err := img.checkAllocOverlapLocked(idx, total); err != nil {
			return 0, err
		}
		if err := img.placeRunLocked(idx, total, k); err != nil {
			return 0, err
		}
		if idx == img.freeHint {
			img.freeHint = idx + total
		}
		if n > 1 {
			img.runHint = idx + total
		}
		return uint64((idx + k) * img.clusterSize), nil
	}
}

// runScan is the state of an allocRunLocked search between retries.
type runScan struct {
	rc   *tableCache // the cache it was made with (a rebuild replaces it)
	gen  uint64      // img.allocGen when saved
	from int64       // the candidate run's first cluster
	free int64       // [from, free) is known to be free
	// pins holds the blocks of [from, free) in the cache, so that loading
	// the next one cannot evict them; last is the last pinned block.
	pins []*cacheEntry
	last int64
}

func (s *runScan) unpin() {
	for _, e := range s.pins {
		e.pins--
	}
	s.pins, s.free, s.last = s.pins[:0], 0, -1
}

func (s *runScan) reset() {
	s.unpin()
	s.rc, s.from = nil, 0
}

// missingBlocks counts the refcount ranges overlapping clusters
// [from, to) that the table covers but has no block for.
func (img *Image) missingBlocks(from, to int64) int64 {
	var m int64
	last := min((to-1)/img.rcPerBlock, int64(len(img.refTable))-1)
	for b := from / img.rcPerBlock; b <= last; b++ {
		if img.refTable[b]&refTableMask == 0 {
			m++
		}
	}
	return m
}

// firstUsedLocked returns the first cluster in [idx, idx+n) whose
// refcount is not zero, or -1 when all are free. Ranges without a block
// are free and skipped whole. It resumes after what img.scan already
// found free, and pins the blocks it reads there.
func (img *Image) firstUsedLocked(idx, n int64) (int64, error) {
	s := &img.scan
	if s.free < idx {
		s.unpin()
		s.free = idx
	}
	for s.free < idx+n {
		c := s.free
		e, err := img.refBlockLocked(c)
		if err != nil {
			return 0, err
		}
		end := min((c/img.rcPerBlock+1)*img.rcPerBlock, idx+n)
		if e != nil {
			for ; c < end; c++ {
				if getRefcount(e.buf, c%img.rcPerBlock, img.rcBits) != 0 {
					return c, nil
				}
			}
			if b := (end - 1) / img.rcPerBlock; b > s.last {
				e.pins++
				s.pins = append(s.pins, e)
				s.last = b
			}
		}
		s.free = end
	}
	return -1, nil
}

// placeRunLocked marks the free clusters [idx, idx+total) in use, first
// creating the k missing refcount blocks at idx..idx+k-1. The existing
// blocks are pinned first, so that inserting the new ones cannot evict
// them half way: either nothing changes (a needLoad) or all of it does.
func (img *Image) placeRunLocked(idx, total, k int64) error {
	first, last := idx/img.rcPerBlock, (idx+total-1)/img.rcPerBlock
	var pinned []*cacheEntry
	defer func() {
		for _, e := range pinned {
			e.pins--
		}
	}()
	for b := first; b <= last; b++ {
		e, err := img.refBlockLocked(b * img.rcPerBlock)
		if err != nil {
			return err
		}
		if e != nil {
			e.pins++
			pinned = append(pinned, e)
		}
	}
	at := idx
	for b := first; b <= last; b++ {
		if img.refTable[b]&refTableMask != 0 {
			continue
		}
		if at >= idx+k {
			return fmt.Errorf("qcow2: internal error: run at cluster %d needs more than %d refcount blocks", idx, k)
		}
		off := uint64(at * img.clusterSize)
		e := img.rc.insertLocked(off, make([]byte, img.clusterSize))
		e.pins++
		pinned = append(pinned, e)
		img.refTable[b] = off
		img.rtDirty[int(b)] = struct{}{}
		at++
	}
	for c := idx; c < idx+total; c++ {
		if err := img.addRefLocked(c, 1); err != nil {
			return fmt.Errorf("qcow2: counting cluster %d of a new run: %w", c, err)
		}
	}
	return nil
}

// needGrow asks withMetadata to grow the refcount table (with flushMu
// taken, so that no flush writes refcount blocks meanwhile) and retry.
type needGrow struct{ need int64 }

func (n *needGrow) Error() string {
	return fmt.Sprintf("qcow2: refcount table must grow to cover cluster %d", n.need)
}

// growRefTableLocked grows the refcount table so that it covers host
// clusters below need. The new table and the refcount blocks that count
// it are placed after everything the old table covers.
//
// Called with flushMu and mu held. It writes and syncs with mu held (see
// the Image locking note): dirty
// refcount blocks first, then the new blocks and table, then the header.
func (img *Image) growRefTableLocked(need int64) error {
	cs := img.clusterSize
	oldLen := int64(len(img.refTable))
	if oldLen*img.rcPerBlock >= need {
		return nil // another writer grew it
	}
	// Everything the old table covers is in use (allocation only grows
	// the table once its scan passed the covered range).
	start := max(oldLen*img.rcPerBlock, img.hdrClustersN)
	newLen := max(((need+img.rcPerBlock-1)/img.rcPerBlock+1)*3/2, oldLen+1)
	var tableClusters, newBlocks, end int64
	for {
		tableClusters = (newLen*8 + cs - 1) / cs
		end = start + tableClusters + newBlocks
		if last := (end - 1) / img.rcPerBlock; last >= newLen {
			newLen = last + 1
			continue
		}
		nb := (end-1)/img.rcPerBlock - start/img.rcPerBlock + 1
		if nb <= newBlocks {
			break
		}
		newBlocks = nb
	}
	if newLen*8 > maxRefcountTableBytes {
		return fmt.Errorf("qcow2: refcount table would exceed %d bytes; the image is full", maxRefcountTableBytes)
	}

	if err := img.checkAllocOverlapLocked(start, end-start); err != nil {
		return err
	}
	// 1. Make the existing blocks durable, so the new table may point at them.
	if err := img.writeDirtyRefBlocksLocked(); err != nil {
		return err
	}
	// 2. Build the new blocks: they count the table and themselves.
	table := make([]uint64, newLen)
	copy(table, img.refTable)
	tableOff := start
	blockAt := start + tableClusters
	newBufs := map[int64][]byte{}
	for idx := start; idx < end; idx++ {
		b := idx / img.rcPerBlock
		buf, ok := newBufs[b]
		if !ok {
			buf = make([]byte, cs)
			newBufs[b] = buf
			table[b] = uint64(blockAt * cs)
			blockAt++
		}
		setRefcount(buf, idx%img.rcPerBlock, img.rcBits, 1)
	}
	if blockAt > end {
		return fmt.Errorf("qcow2: internal error: refcount table growth placed %d blocks, planned %d", blockAt-(start+tableClusters), newBlocks)
	}
	for b, buf := range newBufs {
		if _, err := img.file.WriteAt(buf, int64(table[b])); err != nil {
			return fmt.Errorf("qcow2: writing refcount block at %#x: %w", table[b], err)
		}
		img.rc.insertLocked(table[b], buf).dirty = false
	}
	tbuf := make([]byte, tableClusters*cs)
	for i, v := range table {
		binary.BigEndian.PutUint64(tbuf[i*8:], v)
	}
	if _, err := img.file.WriteAt(tbuf, tableOff*cs); err != nil {
		return fmt.Errorf("qcow2: writing refcount table at %#x: %w", tableOff*cs, err)
	}
	if err := img.file.Sync(); err != nil {
		return err
	}
	// 3. Switch the header to the new table.
	oldOff, oldClusters := img.hdr.RefcountTableOffset, int64(img.hdr.RefcountTableClusters)
	img.hdr.RefcountTableOffset = uint64(tableOff * cs)
	img.hdr.RefcountTableClusters = uint32(tableClusters)
	if err := img.writeHeaderLocked(); err != nil {
		return err
	}
	img.refTable = table
	clear(img.rtDirty)
	for i := int64(0); i < oldClusters; i++ {
		img.pendingFree = append(img.pendingFree, oldOff+uint64(i*cs))
	}
	if img.freeHint < end && img.freeHint >= start {
		img.freeHint = end
	}
	return nil
}

// writeDirtyRefBlocksLocked writes every dirty refcount block and syncs,
// with mu held. Used only by growth.
func (img *Image) writeDirtyRefBlocksLocked() error {
	ts := img.rc.dirtyLocked()
	if len(ts) == 0 {
		return nil
	}
	if err := img.rc.writeTables(ts); err != nil {
		return err
	}
	if err := img.file.Sync(); err != nil {
		return err
	}
	img.rc.cleanLocked(ts)
	return nil
}
