package qcow2

import (
	"context"
	"errors"
	"fmt"
	"syscall"

	"github.com/ovis-storage/ovis/block"
)

// WriteAt writes p at guest offset off. With FUA, the data and the
// metadata that maps it are durable before WriteAt returns.
func (img *Image) WriteAt(ctx context.Context, p []byte, off int64, f block.Flags) (int, error) {
	img.gate.RLock()
	defer img.gate.RUnlock()
	return img.writeAt(ctx, p, off, f.Has(block.FUA))
}

func (img *Image) writeAt(ctx context.Context, p []byte, off int64, fua bool) (int, error) {
	if err := img.beginWrite(off, int64(len(p))); err != nil {
		return 0, err
	}
	meta := false
	done := 0
	for done < len(p) {
		n, changed, err := img.writeRun(ctx, off+int64(done), p[done:])
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
	closed, need := img.closed, img.needRebuild || (img.lazy && !img.markedDirty) || img.bm.pending.Load()
	fatal := img.fatalEvent
	img.mu.Unlock()
	if closed {
		return block.ErrClosed
	}
	if fatal != nil {
		// QEMU makes the node unusable after a fatal corruption event.
		return fmt.Errorf("qcow2: image marked corrupt (%v): %w", errors.Unwrap(fatal), syscall.ENOMEDIUM)
	}
	if need {
		if err := img.beforeFirstWrite(); err != nil {
			return err
		}
	}
	img.markBitmaps(off, n)
	return nil
}

// beforeFirstWrite repairs refcounts after an unclean shutdown, sets the
// dirty bit of a lazy-refcounts image and flags enabled bitmaps in-use,
// once.
func (img *Image) beforeFirstWrite() error {
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
	if img.bm.pending.Load() {
		if err := img.startBitmaps(); err != nil {
			// Bitmaps that cannot record this write must not be
			// trusted afterwards: drop them.
			if derr := img.dropBitmapsLocked(); derr != nil {
				return errors.Join(err, derr)
			}
		}
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
func (img *Image) claim(ctx context.Context, c int64, fast func() (bool, error)) (claimed bool, err error) {
	for {
		var wait chan struct{}
		done := false
		err := img.withMetadata(ctx, func() error {
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
			if err := waitFor(ctx, wait); err != nil {
				return false, err
			}
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
func (img *Image) writeCluster(ctx context.Context, c, in int64, p []byte) (bool, error) {
	s0 := int(in / img.subSize)
	s1 := int((in + int64(len(p)) - 1) / img.subSize)
	var host, epoch uint64
	claimed, err := img.claim(ctx, c, func() (bool, error) {
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
		_, err := img.writeHost(img.data, p, int64(host)+in)
		img.exit(epoch)
		if err != nil {
			return false, fmt.Errorf("qcow2: writing data at host offset %#x: %w", int64(host)+in, err)
		}
		return false, nil
	}
	defer img.release(c)
	return true, img.allocWrite(ctx, c, in, p)
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
func (img *Image) allocWrite(ctx context.Context, c, in int64, p []byte) error {
	var (
		old      mapping
		host     uint64
		newHost  bool
		allocErr error
	)
	err := img.withMetadata(ctx, func() error {
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
			if err := img.fillSub(ctx, buf, c, i, old, &cluster); err != nil {
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
		if _, err := img.writeHost(img.data, buf, dst); err != nil {
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
	return img.withMetadata(ctx, func() error {
		return img.setEntryLocked(c, nm, newHost)
	})
}

// fillSub fills buf with the old contents of subcluster i (the whole
// cluster without extended L2) of guest cluster c.
func (img *Image) fillSub(ctx context.Context, buf []byte, c int64, i int, old mapping, cluster *[]byte) error {
	start := int64(i) * img.subSize
	kind, h := img.sub(old, i)
	switch kind {
	case kindUnalloc:
		return img.readBacking(ctx, buf, c<<img.clusterBits+start)
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

// runKind is how writeRun writes the start of a request.
type runKind uint8

const (
	// runInPlace: clusters written where they are, at contiguous host
	// offsets; no claim, registered as data I/O (enterLocked).
	runInPlace runKind = iota
	// runFresh: clusters that all move to one new contiguous host run;
	// claimed.
	runFresh
	// runSingle: one cluster through allocWrite; claimed.
	runSingle
)

// runPlan is what planRunLocked decided for the start of a request.
type runPlan struct {
	kind     runKind
	n        int    // bytes of the request the run covers
	clusters int64  // guest clusters it covers
	host     uint64 // runInPlace: host offset of its first byte
	epoch    uint64 // runInPlace: the data I/O registration
	claim    chan struct{}
	// head and tail are the old entries of the first and last cluster
	// of a runFresh run, read when it is claimed.
	head, tail mapping
}

// writeRun writes a prefix of p at guest offset pos and reports how many
// bytes that was and whether metadata changed. A run of clusters that
// are written in place at contiguous host offsets takes one pwrite; so
// does a run of clusters that all need a new host cluster, which get one
// contiguous host run. Anything else goes one cluster at a time through
// allocWrite.
func (img *Image) writeRun(ctx context.Context, pos int64, p []byte) (int, bool, error) {
	c0 := pos >> img.clusterBits
	in := pos & (img.clusterSize - 1)
	var plan runPlan
	for {
		var wait chan struct{}
		err := img.withMetadata(ctx, func() error {
			// The closure reruns after each table load: start afresh.
			var err error
			plan, wait, err = img.planRunLocked(c0, in, p)
			return err
		})
		if err != nil {
			return 0, false, err
		}
		if wait == nil {
			break
		}
		if err := waitFor(ctx, wait); err != nil {
			return 0, false, err
		}
	}
	switch plan.kind {
	case runInPlace:
		_, err := img.writeHost(img.data, p[:plan.n], int64(plan.host))
		img.exit(plan.epoch)
		if err != nil {
			return 0, false, fmt.Errorf("qcow2: writing %d bytes at host offset %#x: %w", plan.n, plan.host, err)
		}
		return plan.n, false, nil
	case runFresh:
		defer img.releaseRun(c0, plan.clusters, plan.claim)
		return plan.n, true, img.writeFresh(ctx, c0, in, p[:plan.n], &plan)
	}
	defer img.releaseRun(c0, 1, plan.claim)
	return plan.n, true, img.allocWrite(ctx, c0, in, p[:plan.n])
}

// maxRunClusters bounds a run, so that mu is not held for long while it
// is planned and its entries are set.
const maxRunClusters = 8192

// planRunLocked decides how writeRun writes the start of p, which lands
// at offset in of guest cluster c0. It returns a claim to wait for when
// c0 is claimed by another writer. Its only side effects, the claims and
// the data I/O registration, come last, after every lookup that may ask
// for a table load.
func (img *Image) planRunLocked(c0, in int64, p []byte) (runPlan, chan struct{}, error) {
	if ch := img.inflight[c0]; ch != nil {
		return runPlan{}, ch, nil
	}
	cs := img.clusterSize
	m, err := img.lookupLocked(c0)
	if err != nil {
		return runPlan{}, nil, err
	}
	n0 := int(min(int64(len(p)), cs-in))
	// next looks at the cluster after a run of k clusters and n bytes: its
	// entry and how many bytes of p land in it. ok is false at the end of
	// p, at a claimed cluster, at the run limit, or when its table is not
	// cached (the rest comes in the next run).
	next := func(k int64, n int) (mapping, int, bool, error) {
		if n == len(p) || k == maxRunClusters || img.inflight[c0+k] != nil {
			return mapping{}, 0, false, nil
		}
		m, err := img.lookupLocked(c0 + k)
		if _, ok := isNeedLoad(err); ok {
			return mapping{}, 0, false, nil
		}
		return m, min(len(p)-n, int(cs)), err == nil, err
	}

	if h, ok := img.inPlace(m, in, int64(n0)); ok {
		plan := runPlan{kind: runInPlace, n: n0, clusters: 1, host: h + uint64(in)}
		for {
			m, k, ok, err := next(plan.clusters, plan.n)
			if err != nil {
				return runPlan{}, nil, err
			}
			if !ok {
				break
			}
			if h2, ok := img.inPlace(m, 0, int64(k)); !ok || h2 != h+uint64(plan.clusters*cs) {
				break
			}
			plan.n += k
			plan.clusters++
		}
		plan.epoch = img.enterLocked()
		return plan, nil, nil
	}

	plan := runPlan{kind: runSingle, n: n0, clusters: 1, head: m, tail: m}
	if img.freshOK(m, in, int64(n0)) {
		plan.kind = runFresh
		// The run stays inside one L2 slice: its entries are set in one
		// table, which planning and linking find cached.
		_, idx, _ := img.l2SlotLocked(c0)
		limit := img.slEntries - idx%img.slEntries
		for plan.clusters < limit {
			m, k, ok, err := next(plan.clusters, plan.n)
			if err != nil {
				return runPlan{}, nil, err
			}
			if !ok || !img.freshOK(m, 0, int64(k)) {
				break
			}
			plan.n += k
			plan.clusters++
			plan.tail = m
		}
	}
	plan.claim = make(chan struct{})
	for k := int64(0); k < plan.clusters; k++ {
		img.inflight[c0+k] = plan.claim
	}
	return plan, nil, nil
}

// inPlace reports whether n bytes at offset in of a cluster with entry m
// can be written where they are (the cluster is ours alone and every
// touched subcluster holds data), and the cluster's host offset.
func (img *Image) inPlace(m mapping, in, n int64) (uint64, bool) {
	h, ok := img.host(m)
	if !ok || m.entry&flagCopied == 0 {
		return 0, false
	}
	for i := int(in / img.subSize); i <= int((in+n-1)/img.subSize); i++ {
		if k, _ := img.sub(m, i); k != kindData {
			return 0, false
		}
	}
	return h, true
}

// freshOK reports whether a write of n bytes at offset in of a cluster
// with entry m can join a fresh run: the data moves to a new host
// cluster, and with extended L2 the write covers the whole cluster (a
// partial one keeps its untouched subclusters unallocated, which
// allocWrite handles).
func (img *Image) freshOK(m mapping, in, n int64) bool {
	if img.hasDataFile {
		return false
	}
	if _, ok := img.host(m); ok && m.entry&flagCopied != 0 {
		return false
	}
	return !img.extL2 || (in == 0 && n == img.clusterSize)
}

// releaseRun ends the claim on guest clusters [c0, c0+n).
func (img *Image) releaseRun(c0, n int64, ch chan struct{}) {
	img.mu.Lock()
	for k := int64(0); k < n; k++ {
		delete(img.inflight, c0+k)
	}
	img.mu.Unlock()
	close(ch)
}

// writeFresh writes p, which starts at offset in of guest cluster c0 and
// covers the plan's claimed clusters, into one new contiguous host run:
// the run is allocated (with the L2 table made writable first, so that
// the table does not split the run), the data is written with one pwrite
// straight from p (plus one for each partial cluster at either end,
// built over the cluster's old contents), and then the L2 entries are
// set. As in allocWrite, the data is written before the entries that map
// it, and the run's refcounts are raised before them.
func (img *Image) writeFresh(ctx context.Context, c0, in int64, p []byte, plan *runPlan) error {
	cs := img.clusterSize
	n := plan.clusters
	var run uint64
	allocated := false
	err := img.withMetadata(ctx, func() error {
		if _, _, err := img.writableL2Locked(c0); err != nil {
			return err
		}
		if !allocated {
			var err error
			if run, err = img.allocRunLocked(n); err != nil {
				return err
			}
			allocated = true
		}
		return nil
	})
	if err != nil {
		if allocated {
			img.freeRun(run, n)
		}
		return err
	}

	// The partial clusters at either end, whole, over their old contents.
	end := in + int64(len(p)) // within the run's first cluster
	var head, tail []byte
	if in != 0 || (n == 1 && end != cs) {
		if head, err = img.overlay(ctx, c0, plan.head, in, p[:min(int64(len(p)), cs-in)]); err != nil {
			img.freeRun(run, n)
			return err
		}
	}
	if n > 1 && end%cs != 0 {
		from := (n-1)*cs - in
		if tail, err = img.overlay(ctx, c0+n-1, plan.tail, 0, p[from:]); err != nil {
			img.freeRun(run, n)
			return err
		}
	}
	mid, midAt := p, int64(run)
	if head != nil {
		if err := img.writeData(head, midAt); err != nil {
			img.freeRun(run, n)
			return err
		}
		mid, midAt = mid[min(int64(len(mid)), cs-in):], midAt+cs
	}
	if tail != nil {
		mid = mid[:int64(len(mid))-(end%cs)]
	}
	if len(mid) > 0 {
		if err := img.writeData(mid, midAt); err != nil {
			img.freeRun(run, n)
			return err
		}
	}
	if tail != nil {
		if err := img.writeData(tail, int64(run)+(n-1)*cs); err != nil {
			img.freeRun(run, n)
			return err
		}
	}

	var bitmap uint64
	if img.extL2 {
		bitmap = 1<<img.nsub - 1 // every subcluster allocated, none zero
	}
	return img.withMetadata(ctx, func() error {
		for k := int64(0); k < n; k++ {
			nm := mapping{entry: (run + uint64(k*cs)) | flagCopied, bitmap: bitmap}
			// Skip entries set before a table load made this rerun.
			if m, err := img.lookupLocked(c0 + k); err == nil && m == nm {
				continue
			}
			if err := img.setEntryLocked(c0+k, nm, true); err != nil {
				return err
			}
		}
		return nil
	})
}

// overlay returns guest cluster c, whose entry is old, as it reads with
// p written at offset in.
func (img *Image) overlay(ctx context.Context, c int64, old mapping, in int64, p []byte) ([]byte, error) {
	buf := make([]byte, img.clusterSize)
	var cluster []byte
	if err := img.fillSub(ctx, buf, c, 0, old, &cluster); err != nil {
		return nil, err
	}
	copy(buf[in:], p)
	return buf, nil
}

func (img *Image) writeData(p []byte, at int64) error {
	if _, err := img.writeHost(img.data, p, at); err != nil {
		return fmt.Errorf("qcow2: writing %d bytes at host offset %#x: %w", len(p), at, err)
	}
	return nil
}

// freeRun gives back n host clusters from run that were allocated but
// never linked; like every release, it takes effect at the next flush.
func (img *Image) freeRun(run uint64, n int64) {
	img.mu.Lock()
	for k := int64(0); k < n; k++ {
		img.pendingFree = append(img.pendingFree, run+uint64(k*img.clusterSize))
	}
	img.mu.Unlock()
}
