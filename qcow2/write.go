package qcow2

import (
	"fmt"

	"github.com/ovis-storage/ovis/block"
)

// WriteAt writes p at guest offset off. With fua, the data and the
// metadata that maps it are durable before WriteAt returns.
func (img *Image) WriteAt(p []byte, off int64, fua bool) (int, error) {
	img.gate.RLock()
	defer img.gate.RUnlock()
	return img.writeAt(p, off, fua)
}

func (img *Image) writeAt(p []byte, off int64, fua bool) (int, error) {
	if err := img.beginWrite(off, int64(len(p))); err != nil {
		return 0, err
	}
	meta := false
	done := 0
	for done < len(p) {
		pos := off + int64(done)
		c := pos >> img.clusterBits
		in := pos & (img.clusterSize - 1)
		n := int(min(int64(len(p)-done), img.clusterSize-in))
		changed, err := img.writeCluster(c, in, p[done:done+n])
		if err != nil {
			return done, err
		}
		meta = meta || changed
		done += n
	}
	return done, img.endWrite(meta, fua)
}

// beginWrite checks a write request and, before the first write, repairs
// refcounts after an unclean shutdown and sets the dirty bit of a
// lazy-refcounts image.
func (img *Image) beginWrite(off, n int64) error {
	if img.ro {
		return errReadOnly
	}
	if err := block.CheckRange(off, n, img.size); err != nil {
		return err
	}
	img.mu.Lock()
	closed, need := img.closed, img.needRebuild || (img.lazy && !img.markedDirty)
	img.mu.Unlock()
	if closed {
		return block.ErrClosed
	}
	if !need {
		return nil
	}
	img.flushMu.Lock()
	defer img.flushMu.Unlock()
	img.mu.Lock()
	defer img.mu.Unlock()
	if img.needRebuild {
		if err := img.rebuildRefcountsLocked(); err != nil {
			return err
		}
		img.needRebuild = false
		img.hdr.IncompatibleFeatures &^= IncompatDirty
		if err := img.writeHeaderLocked(); err != nil {
			return err
		}
	}
	if img.lazy && !img.markedDirty {
		img.hdr.IncompatibleFeatures |= IncompatDirty
		if err := img.writeHeaderLocked(); err != nil {
			return err
		}
		img.markedDirty = true
	}
	return nil
}

// endWrite makes a FUA write durable and relieves cache pressure.
func (img *Image) endWrite(meta, fua bool) error {
	if fua {
		// Even a write that changed no metadata may land in a cluster
		// whose L2 entry an earlier write changed and nobody flushed
		// yet: flush writes back whatever is dirty (and is a single
		// fdatasync when nothing is).
		return img.flush()
	}
	img.mu.Lock()
	l2Full, rcFull := img.l2.overfullLocked(), img.rc.overfullLocked()
	img.mu.Unlock()
	switch {
	case l2Full:
		return img.flush()
	case rcFull:
		return img.writeBackRefBlocks()
	}
	return nil
}

// writeBackRefBlocks writes dirty refcount blocks without syncing, so that
// they can be evicted. This is safe at any time: a block in memory differs
// from disk only by increments (which at worst leak) and by drops whose
// L2 changes are already durable (see Flush).
func (img *Image) writeBackRefBlocks() error {
	img.flushMu.Lock()
	defer img.flushMu.Unlock()
	img.mu.Lock()
	ts := img.rc.dirtyLocked()
	img.mu.Unlock()
	if err := img.rc.writeTables(ts); err != nil {
		return err
	}
	img.mu.Lock()
	img.rc.cleanLocked(ts)
	img.mu.Unlock()
	return nil
}

// claim waits until no other writer changes guest cluster c's L2 entry and
// then claims it; fast is called under mu first and may finish the lookup
// without claiming (it returns true). release ends the claim.
func (img *Image) claim(c int64, fast func() (bool, error)) (claimed bool, err error) {
	for {
		var wait chan struct{}
		done := false
		err := img.withMetadata(func() error {
			// The closure reruns after each table load: start afresh.
			wait, done = nil, false
			if ch := img.inflight[c]; ch != nil {
				wait = ch
				return nil
			}
			ok, err := fast()
			if err != nil {
				return err
			}
			if ok {
				done = true
				return nil
			}
			img.inflight[c] = make(chan struct{})
			return nil
		})
		if err != nil {
			return false, err
		}
		if wait != nil {
			<-wait
			continue
		}
		return !done, nil
	}
}

func (img *Image) release(c int64) {
	img.mu.Lock()
	ch := img.inflight[c]
	delete(img.inflight, c)
	img.mu.Unlock()
	close(ch)
}

// writeCluster writes p at offset in inside guest cluster c. It reports
// whether metadata changed.
func (img *Image) writeCluster(c, in int64, p []byte) (bool, error) {
	s0 := int(in / img.subSize)
	s1 := int((in + int64(len(p)) - 1) / img.subSize)
	var host, epoch uint64
	claimed, err := img.claim(c, func() (bool, error) {
		m, err := img.lookupLocked(c)
		if err != nil {
			return false, err
		}
		h, ok := img.host(m)
		if !ok || m.entry&flagCopied == 0 {
			return false, nil
		}
		for i := s0; i <= s1; i++ {
			if k, _ := img.sub(m, i); k != kindData {
				return false, nil
			}
		}
		host = h
		epoch = img.enterLocked()
		return true, nil
	})
	if err != nil {
		return false, err
	}
	if !claimed {
		_, err := img.data.WriteAt(p, int64(host)+in)
		img.exit(epoch)
		if err != nil {
			return false, fmt.Errorf("qcow2: writing data at host offset %#x: %w", int64(host)+in, err)
		}
		return false, nil
	}
	defer img.release(c)
	return true, img.allocWrite(c, in, p)
}

// writableL2Locked returns the L2 cache slice holding guest cluster c's
// entry and the entry's index in it, first allocating the L2 table or
// copying it away from a snapshot.
func (img *Image) writableL2Locked(c int64) (*cacheEntry, int64, error) {
	l1i, idx, l2off := img.l2SlotLocked(c)
	if l1i >= len(img.l1) {
		return nil, 0, fmt.Errorf("qcow2: guest cluster %d beyond the L1 table", c)
	}
	if l2off != 0 && img.l1[l1i]&flagCopied == 0 {
		rc, err := img.refcountLocked(int64(l2off) >> img.clusterBits)
		if err != nil {
			return nil, 0, err
		}
		if rc == 1 {
			img.l1[l1i] |= flagCopied
			img.l1Dirty[l1i] = struct{}{}
		}
	}
	if l2off != 0 && img.l1[l1i]&flagCopied != 0 {
		soff, sidx := img.sliceOf(l2off, idx)
		e, err := img.l2.peekLocked(soff)
		return e, sidx, err
	}
	// A new table, or a copy of one shared with a snapshot. The clusters a
	// copy maps keep their refcounts: the snapshot's table still
	// references them too.
	var old [][]byte
	if l2off != 0 {
		for s := int64(0); s < img.clusterSize; s += img.sliceSize {
			e, err := img.l2.peekLocked(l2off + uint64(s))
			if err != nil {
				return nil, 0, err
			}
			old = append(old, e.buf)
		}
	}
	off, err := img.allocClusterLocked()
	if err != nil {
		return nil, 0, err
	}
	for i, s := 0, int64(0); s < img.clusterSize; i, s = i+1, s+img.sliceSize {
		buf := make([]byte, img.sliceSize)
		if old != nil {
			copy(buf, old[i])
		}
		img.l2.insertLocked(off+uint64(s), buf)
	}
	img.l1[l1i] = off | flagCopied
	img.l1Dirty[l1i] = struct{}{}
	if l2off != 0 {
		img.pendingFree = append(img.pendingFree, l2off)
	}
	soff, sidx := img.sliceOf(off, idx)
	e, err := img.l2.peekLocked(soff)
	return e, sidx, err
}

// setEntryLocked stores guest cluster c's new L2 entry in its (writable)
// table and schedules the release of what the old entry referenced.
func (img *Image) setEntryLocked(c int64, m mapping, freeOld bool) error {
	e, idx, err := img.writableL2Locked(c)
	if err != nil {
		return err
	}
	if freeOld {
		img.freeEntryLocked(img.readEntry(e.buf, idx))
	}
	img.writeEntry(e.buf, idx, m)
	img.l2.markDirtyLocked(e)
	return nil
}

// freeEntryLocked schedules the refcount drop of the host clusters an L2
// entry references.
func (img *Image) freeEntryLocked(m mapping) {
	if img.hasDataFile {
		return
	}
	if m.entry&flagCompressed != 0 {
		off, n := img.compressedRange(m.entry)
		start := (off &^ 511) >> img.clusterBits
		end := ((off &^ 511) + uint64(n) - 1) >> img.clusterBits
		for i := start; i <= end; i++ {
			img.pendingFree = append(img.pendingFree, i<<img.clusterBits)
		}
		return
	}
	if h, ok := img.host(m); ok {
		img.pendingFree = append(img.pendingFree, h)
	}
}

// allocWrite writes p into guest cluster c, which the caller has claimed,
// allocating or copying the host cluster as needed.
func (img *Image) allocWrite(c, in int64, p []byte) error {
	var (
		old      mapping
		host     uint64
		newHost  bool
		allocErr error
	)
	err := img.withMetadata(func() error {
		e, idx, err := img.writableL2Locked(c)
		if err != nil {
			return err
		}
		old = img.readEntry(e.buf, idx)
		if h, ok := img.host(old); ok && old.entry&flagCopied != 0 {
			host = h
			return nil
		}
		if img.hasDataFile {
			host = uint64(c << img.clusterBits)
			return nil
		}
		if !newHost {
			if host, allocErr = img.allocClusterLocked(); allocErr != nil {
				return allocErr
			}
			newHost = true
		}
		return nil
	})
	if err != nil {
		if newHost {
			img.mu.Lock()
			img.pendingFree = append(img.pendingFree, host)
			img.mu.Unlock()
		}
		return err
	}

	// Which subclusters to write: the touched ones, plus, when the data
	// moves to a new cluster, everything the old cluster held.
	var write uint32
	s0 := int(in / img.subSize)
	s1 := int((in + int64(len(p)) - 1) / img.subSize)
	for i := s0; i <= s1; i++ {
		write |= 1 << i
	}
	moving := newHost && (old.entry&flagCompressed != 0 || old.entry&l2OffsetMask != 0)
	if moving || !img.extL2 {
		for i := 0; i < img.nsub; i++ {
			if k, _ := img.sub(old, i); k == kindData || k == kindCompressed || !img.extL2 {
				write |= 1 << i
			}
		}
	}
	// Build the pieces to write. A touched subcluster that already holds
	// data in place gets only p's bytes: a concurrent in-place writer to
	// its other bytes (which takes no claim) must not be undone by a
	// read-modify-write. Every other subcluster is written whole, its old
	// contents (backing, zeros, the old or decompressed cluster) under p.
	type piece struct {
		off  int64 // within the cluster
		data []byte
	}
	var pieces []piece
	var cluster []byte // decompressed old cluster, loaded on demand
	end := in + int64(len(p))
	for i := 0; i < img.nsub; i++ {
		if write&(1<<i) == 0 {
			continue
		}
		start := int64(i) * img.subSize
		ps, pe := max(start, in), min(start+img.subSize, end)
		if kind, _ := img.sub(old, i); !newHost && img.extL2 && kind == kindData {
			pieces = append(pieces, piece{ps, p[ps-in : pe-in]})
			continue
		}
		buf := make([]byte, img.subSize)
		if ps != start || pe != start+img.subSize {
			if err := img.fillSub(buf, c, i, old, &cluster); err != nil {
				return err
			}
		}
		if ps < pe {
			copy(buf[ps-start:], p[ps-in:pe-in])
		}
		pieces = append(pieces, piece{start, buf})
	}
	for k := 0; k < len(pieces); {
		// Coalesce contiguous pieces into one write.
		j, n := k+1, int64(len(pieces[k].data))
		for j < len(pieces) && pieces[j].off == pieces[k].off+n {
			n += int64(len(pieces[j].data))
			j++
		}
		buf := pieces[k].data
		if j > k+1 {
			buf = make([]byte, 0, n)
			for _, pc := range pieces[k:j] {
				buf = append(buf, pc.data...)
			}
		}
		dst := int64(host) + pieces[k].off
		if _, err := img.data.WriteAt(buf, dst); err != nil {
			return fmt.Errorf("qcow2: writing data at host offset %#x: %w", dst, err)
		}
		k = j
	}

	nm := mapping{entry: host | flagCopied}
	if img.extL2 {
		alloc := uint32(old.bitmap) | write
		zero := uint32(old.bitmap>>32) &^ write
		if old.entry&flagCompressed != 0 {
			alloc, zero = write, 0
		}
		nm.bitmap = uint64(alloc) | uint64(zero)<<32
	}
	return img.withMetadata(func() error {
		return img.setEntryLocked(c, nm, newHost)
	})
}

// fillSub fills buf with the old contents of subcluster i (the whole
// cluster without extended L2) of guest cluster c.
func (img *Image) fillSub(buf []byte, c int64, i int, old mapping, cluster *[]byte) error {
	start := int64(i) * img.subSize
	kind, h := img.sub(old, i)
	switch kind {
	case kindUnalloc:
		return img.readBacking(buf, c<<img.clusterBits+start)
	case kindData:
		if err := block.ReadFull(img.data, buf, int64(h)); err != nil {
			return fmt.Errorf("qcow2: copying cluster at %#x: %w", h, err)
		}
	case kindCompressed:
		if *cluster == nil {
			var err error
			if *cluster, err = img.readCompressed(old.entry); err != nil {
				return err
			}
		}
		copy(buf, (*cluster)[start:])
	}
	return nil
}
