package qcow2

import (
	"encoding/binary"
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
	if delta < 0 && uint64(int64(v)+delta) == 0 {
		img.freeHint = min(img.freeHint, idx)
		if img.compTail != 0 && int64(img.compTail/uint64(img.clusterSize)) == idx {
			img.compTail = 0
		}
	}
	return nil
}

// newRefBlockLocked creates the refcount block covering idx. The block is
// placed in the first free cluster of the range it covers, so that it
// counts itself. Its table entry reaches disk only after the block (Flush
// step 2).
func (img *Image) newRefBlockLocked(idx int64) (*cacheEntry, error) {
	b := idx / img.rcPerBlock
	if b >= int64(len(img.refTable)) {
		return nil, fmt.Errorf("qcow2: internal error: refcount block %d beyond table", b)
	}
	first := b * img.rcPerBlock
	// No block covers this range, so every cluster in it is free.
	at := first
	if at < img.hdrClustersN {
		at = img.hdrClustersN
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

// allocRunLocked allocates n contiguous free host clusters.
func (img *Image) allocRunLocked(n int64) (uint64, error) {
	idx := max(img.freeHint, img.hdrClustersN)
	if n > 1 {
		// Runs start after the last run, so that small holes below it
		// are not rescanned for every run (they still serve single
		// clusters).
		idx = max(idx, img.runHint)
	}
	for {
		b := idx / img.rcPerBlock
		if b >= int64(len(img.refTable)) {
			return 0, &needGrow{need: idx + n}
		}
		// Find n free clusters starting at idx.
		ok := true
		var j int64
		for j = 0; j < n; j++ {
			if (idx+j)/img.rcPerBlock >= int64(len(img.refTable)) {
				break
			}
			rc, err := img.refcountLocked(idx + j)
			if err != nil {
				return 0, err
			}
			if rc != 0 {
				ok = false
				break
			}
		}
		if !ok {
			if j == 0 && idx == img.freeHint {
				img.freeHint++
			}
			idx += j + 1
			continue
		}
		if j < n {
			return 0, &needGrow{need: idx + n}
		}
		// Make sure every block exists before changing anything: creating
		// a block may take one of the clusters we found.
		retry := false
		for j = 0; j < n; j++ {
			e, err := img.refBlockLocked(idx + j)
			if err != nil {
				return 0, err
			}
			if e == nil {
				if _, err := img.newRefBlockLocked(idx + j); err != nil {
					return 0, err
				}
				retry = true
			}
		}
		if retry {
			continue
		}
		for j = 0; j < n; j++ {
			if err := img.addRefLocked(idx+j, 1); err != nil {
				return 0, err
			}
		}
		if idx == img.freeHint {
			img.freeHint = idx + n
		}
		if n > 1 {
			img.runHint = idx + n
		}
		return uint64(idx * img.clusterSize), nil
	}
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
