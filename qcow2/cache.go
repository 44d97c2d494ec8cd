package qcow2

import (
	"container/list"
	"context"
	"fmt"
	"sync"

	"github.com/ovis-storage/ovis/block"
)

// tableCache holds metadata tables (L2 table slices or refcount blocks),
// each entrySize bytes, keyed by host offset.
//
// Locking: every method is called with the owning Image's mu held. load
// releases mu while it reads, so callers re-validate what they looked up
// before (withMetadata retries them). Misses on different tables load in
// parallel; concurrent misses on one table share one read.
//
// Memory: the cache holds at most capacity entries, except that entries
// pinned by an operation in progress or dirty since the last flush are
// never dropped; a writer that leaves the cache over capacity flushes
// (Image.endWrite), and pins last for one metadata step.
type tableCache struct {
	name      string
	file      block.File
	entrySize int
	capacity  int
	mu        *sync.Mutex
	policy    evictionPolicy

	entries map[uint64]*cacheEntry
	// free holds buffers of evicted entries for the next loads, so that
	// a cache that misses all the time does not allocate (and, being
	// aligned, O_DIRECT reads land in them without a bounce buffer).
	free [][]byte
	// epoch advances once per cache-clean-interval; an entry whose
	// lastUse is older than the previous epoch has been idle a whole
	// interval.
	epoch uint64

	stats CacheStats
}

// CacheStats counts a cache's traffic. Read it with Image.CacheStats.
type CacheStats struct {
	Hits, Misses, Evictions, Writebacks uint64
	// Loads counts table reads from the file; Loading is how many are in
	// flight right now and MaxLoading the most ever in flight at once.
	Loads, Loading, MaxLoading uint64
	Entries, Capacity          int
	EntrySize                  int
}

type cacheEntry struct {
	off uint64
	buf []byte
	// loading is non-nil while the table is being read; it is closed when
	// buf is set (or the load failed and the entry was removed).
	loading chan struct{}
	pins    int
	dirty   bool
	// gen counts modifications, so that a writeback can tell whether the
	// entry changed while it was being written.
	gen uint64
	// lastUse is the clean-interval epoch of the last hit.
	lastUse uint64

	// Policy state.
	elem *list.Element // lru
	slot int           // hitcount: index in slots
	hits int           // hitcount
}

// Cache eviction policies, for Options.L2CachePolicy.
const (
	PolicyLRU           = "lru"
	PolicyHitCount      = "hitcount"
	PolicyHitCountFloor = "hitcount-floor"
)

func newTableCache(name string, f block.File, entrySize, capacity int, policy string, mu *sync.Mutex) *tableCache {
	capacity = max(capacity, 2)
	c := &tableCache{
		name: name, file: f, entrySize: entrySize, capacity: capacity, mu: mu,
		entries: make(map[uint64]*cacheEntry),
	}
	switch policy {
	case PolicyHitCount:
		c.policy = &hitCountPolicy{slots: make([]*cacheEntry, capacity)}
	case PolicyHitCountFloor:
		c.policy = &hitCountPolicy{slots: make([]*cacheEntry, capacity), floor: true}
	default:
		c.policy = &lruPolicy{l: list.New()}
	}
	return c
}

// needLoad is returned by *Locked lookups when a table is not cached. The
// caller drops its partial work, loads, and retries.
type needLoad struct {
	c   *tableCache
	off uint64
}

func (n *needLoad) Error() string { return fmt.Sprintf("qcow2: %s at %#x not cached", n.c.name, n.off) }

// peekLocked returns the cached table at off, or a *needLoad error.
func (c *tableCache) peekLocked(off uint64) (*cacheEntry, error) {
	e, ok := c.entries[off]
	if !ok || e.loading != nil {
		return nil, &needLoad{c: c, off: off}
	}
	c.stats.Hits++
	c.policy.hit(e)
	e.lastUse = c.epoch
	return e, nil
}

// load reads the table at off into the cache and returns it pinned, so
// that it survives until the caller's retry; the caller unpins it. Called
// with mu held; releases it during the read.
func (c *tableCache) load(ctx context.Context, off uint64) (*cacheEntry, error) {
	for {
		e, ok := c.entries[off]
		if ok && e.loading != nil {
			ch := e.loading
			c.mu.Unlock()
			err := waitFor(ctx, ch)
			c.mu.Lock()
			if err != nil {
				return nil, err
			}
			continue
		}
		if ok {
			e.pins++
			return e, nil
		}
		break
	}
	c.stats.Misses++
	c.makeRoomLocked()
	e := &cacheEntry{off: off, loading: make(chan struct{}), pins: 1}
	c.addLocked(e)
	c.stats.Loads++
	c.stats.Loading++
	c.stats.MaxLoading = max(c.stats.MaxLoading, c.stats.Loading)
	ch := e.loading
	c.mu.Unlock()
	var buf []byte
	c.mu.Lock()
	if n := len(c.free); n > 0 {
		buf, c.free = c.free[n-1], c.free[:n-1]
	}
	c.mu.Unlock()
	if buf == nil {
		buf = block.AlignedBuf(c.entrySize)
	}
	err := block.ReadFull(c.file, buf, int64(off))
	c.mu.Lock()
	c.stats.Loading--
	e.loading = nil
	close(ch)
	if err != nil {
		c.removeLocked(e)
		c.recycleLocked(buf)
		return nil, fmt.Errorf("qcow2: reading %s at %#x: %w", c.name, off, err)
	}
	e.buf = buf
	e.lastUse = c.epoch
	return e, nil
}

// pinSet is the tables one operation loaded and holds until it finishes.
type pinSet []*cacheEntry

// releaseLocked unpins every held table.
func (p *pinSet) releaseLocked() {
	for _, e := range *p {
		e.pins--
	}
	*p = nil
}

// insertLocked adds a fresh table that needs no reading (a new or copied
// table), marked dirty.
func (c *tableCache) insertLocked(off uint64, buf []byte) *cacheEntry {
	if e, ok := c.entries[off]; ok {
		// A stale copy of a cluster that was freed and reused.
		c.removeLocked(e)
	}
	c.makeRoomLocked()
	e := &cacheEntry{off: off, buf: buf, dirty: true, gen: 1, lastUse: c.epoch}
	c.addLocked(e)
	return e
}

func (c *tableCache) addLocked(e *cacheEntry) {
	c.entries[e.off] = e
	c.policy.insert(e)
}

// forgetLocked drops a table from the cache (its cluster was freed).
func (c *tableCache) forgetLocked(off uint64) {
	if e, ok := c.entries[off]; ok && e.loading == nil && e.pins == 0 {
		c.removeLocked(e)
	}
}

func (c *tableCache) markDirtyLocked(e *cacheEntry) {
	e.dirty = true
	e.gen++
}

func (c *tableCache) removeLocked(e *cacheEntry) {
	if cur, ok := c.entries[e.off]; ok && cur == e {
		delete(c.entries, e.off)
		c.policy.remove(e)
	}
}

func evictable(e *cacheEntry) bool { return e.pins == 0 && !e.dirty && e.loading == nil }

// evictLocked drops an evictable entry and keeps its buffer for reuse:
// nothing else refers to it (no pins, not loading, clean).
func (c *tableCache) evictLocked(e *cacheEntry) {
	c.removeLocked(e)
	c.stats.Evictions++
	if len(e.buf) == c.entrySize {
		c.recycleLocked(e.buf)
		e.buf = nil
	}
}

func (c *tableCache) recycleLocked(buf []byte) {
	if len(c.free) < 64 {
		c.free = append(c.free, buf)
	}
}

// makeRoomLocked evicts so that one more entry fits, if the policy finds
// an evictable entry; otherwise the cache overshoots until entries are
// unpinned or flushed.
func (c *tableCache) makeRoomLocked() {
	if hp, ok := c.policy.(*hitCountPolicy); ok {
		// QEMU's scan runs on every miss and may replace an occupied
		// slot even while others are empty.
		if v, room := hp.victim(evictable); !room && v != nil {
			c.evictLocked(v)
		}
		return
	}
	for len(c.entries) >= c.capacity {
		v, _ := c.policy.victim(evictable)
		if v == nil {
			return
		}
		c.evictLocked(v)
	}
}

// trimLocked evicts clean entries down to capacity.
func (c *tableCache) trimLocked() {
	for len(c.entries) > c.capacity {
		v, _ := c.policy.victim(evictable)
		if v == nil {
			return
		}
		c.evictLocked(v)
	}
}

func (c *tableCache) overfullLocked() bool { return len(c.entries) > c.capacity }

// cleanTickLocked drops clean entries unused for a whole interval and
// starts the next one (cache-clean-interval).
func (c *tableCache) cleanTickLocked() {
	for _, e := range c.entries {
		if evictable(e) && e.lastUse < c.epoch {
			c.evictLocked(e)
		}
	}
	c.epoch++
}

// dirtyLocked returns snapshots of the dirty entries for writeback.
func (c *tableCache) dirtyLocked() []dirtyTable {
	var out []dirtyTable
	for _, e := range c.entries {
		if e.dirty && e.loading == nil {
			out = append(out, dirtyTable{e: e, gen: e.gen, buf: append([]byte(nil), e.buf...)})
		}
	}
	return out
}

type dirtyTable struct {
	e   *cacheEntry
	gen uint64
	buf []byte
}

// writeTables writes snapshots taken by dirtyLocked. Called without mu.
func (c *tableCache) writeTables(ts []dirtyTable) error {
	for _, t := range ts {
		if _, err := c.file.WriteAt(t.buf, int64(t.e.off)); err != nil {
			return fmt.Errorf("qcow2: writing %s at %#x: %w", c.name, t.e.off, err)
		}
	}
	return nil
}

// cleanLocked marks written entries clean unless they changed meanwhile.
func (c *tableCache) cleanLocked(ts []dirtyTable) {
	for _, t := range ts {
		if t.e.gen == t.gen {
			t.e.dirty = false
		}
		c.stats.Writebacks++
	}
	c.trimLocked()
}

func (c *tableCache) statsLocked() CacheStats {
	s := c.stats
	s.Entries, s.Capacity, s.EntrySize = len(c.entries), c.capacity, c.entrySize
	return s
}

// evictionPolicy decides which entry a full cache drops.
type evictionPolicy interface {
	insert(e *cacheEntry)
	hit(e *cacheEntry)
	remove(e *cacheEntry)
	// victim returns an entry to evict, or room=true when the policy has
	// a free place for the next insert.
	victim(ok func(*cacheEntry) bool) (v *cacheEntry, room bool)
}

// lruPolicy evicts the least recently used entry.
type lruPolicy struct{ l *list.List }

func (p *lruPolicy) insert(e *cacheEntry) { e.elem = p.l.PushFront(e) }
func (p *lruPolicy) hit(e *cacheEntry)    { p.l.MoveToFront(e.elem) }
func (p *lruPolicy) remove(e *cacheEntry) { p.l.Remove(e.elem); e.elem = nil }
func (p *lruPolicy) victim(ok func(*cacheEntry) bool) (*cacheEntry, bool) {
	for el := p.l.Back(); el != nil; el = el.Prev() {
		if e := el.Value.(*cacheEntry); ok(e) {
			return e, false
		}
	}
	return nil, false
}

// hitCountPolicy is QEMU's original qcow2 cache policy (before 2.3): a
// fixed array of slots; a loaded table starts with 32 hits, every hit adds
// one, and each replacement scan halves every count and picks the lowest
// count, the lowest slot first. Empty slots count 0, but so do entries
// whose counts decayed, so the scan keeps replacing the first few slots
// and leaves later ones empty: the flat curve of QEMU's study.
//
// With floor set (the patched policy) counts of occupied slots never drop
// below one, so empty slots are always taken first.
type hitCountPolicy struct {
	slots []*cacheEntry
	floor bool
	// next is the slot chosen by the last victim scan for the next insert.
	next int
}

func (p *hitCountPolicy) insert(e *cacheEntry) {
	e.hits = 32
	if p.next >= 0 && p.next < len(p.slots) && p.slots[p.next] == nil {
		e.slot = p.next
		p.slots[p.next] = e
		p.next = -1
		return
	}
	for i, s := range p.slots {
		if s == nil {
			e.slot = i
			p.slots[i] = e
			return
		}
	}
	e.slot = len(p.slots) // overshoot: grow
	p.slots = append(p.slots, e)
}

func (p *hitCountPolicy) hit(e *cacheEntry) { e.hits++ }

func (p *hitCountPolicy) remove(e *cacheEntry) {
	if e.slot < len(p.slots) && p.slots[e.slot] == e {
		p.slots[e.slot] = nil
	}
}

func (p *hitCountPolicy) victim(ok func(*cacheEntry) bool) (*cacheEntry, bool) {
	best, bestHits := -1, int(^uint(0)>>1)
	for i, e := range p.slots {
		h := 0
		if e != nil {
			if !ok(e) {
				continue
			}
			h = e.hits
			if p.floor {
				e.hits = max(e.hits/2, 1)
			} else {
				e.hits /= 2
			}
		}
		if h < bestHits {
			best, bestHits = i, h
		}
	}
	if best < 0 {
		return nil, false
	}
	p.next = best
	if p.slots[best] == nil {
		return nil, true
	}
	return p.slots[best], false
}
