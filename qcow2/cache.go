package qcow2

import (
	"container/list"
	"fmt"
	"sync"

	"github.com/ovis-storage/ovis/block"
)

// tableCache holds cluster-sized metadata tables (L2 tables or refcount
// blocks) keyed by their host offset.
//
// Locking: every method is called with the owning Image's mu held. A load
// (load) releases mu while it reads, so callers must re-validate what they
// looked up before the load. An entry with pins > 0 is never evicted; dirty
// entries are only dropped after Flush wrote them back.
type tableCache struct {
	name     string
	file     block.File
	size     int // table size in bytes (one cluster)
	capacity int // entries
	mu       *sync.Mutex

	entries map[uint64]*cacheEntry
	lru     *list.List // of *cacheEntry, front = most recently used

	hits, misses, evictions, writebacks uint64
}

type cacheEntry struct {
	off  uint64
	buf  []byte
	elem *list.Element
	// loading is non-nil while the table is being read; it is closed
	// when buf (or err) is set.
	loading chan struct{}
	pins    int
	dirty   bool
	// gen counts modifications so that a writeback can tell whether the
	// entry changed while it was being written.
	gen uint64
}

func newTableCache(name string, f block.File, size, capacity int, mu *sync.Mutex) *tableCache {
	if capacity < 2 {
		capacity = 2
	}
	return &tableCache{
		name: name, file: f, size: size, capacity: capacity, mu: mu,
		entries: make(map[uint64]*cacheEntry),
		lru:     list.New(),
	}
}

// needLoad is returned by *Locked lookups when a table is not cached. The
// caller drops its partial work, calls load, and retries.
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
	c.hits++
	c.lru.MoveToFront(e.elem)
	return e, nil
}

// load reads the table at off into the cache and returns it pinned, so
// that it survives until the caller's retry; the caller unpins it. Called
// with mu held; releases it during the read. Concurrent loads of one table
// share one read.
func (c *tableCache) load(off uint64) (*cacheEntry, error) {
	for {
		e, ok := c.entries[off]
		if ok && e.loading != nil {
			ch := e.loading
			c.mu.Unlock()
			<-ch
			c.mu.Lock()
			continue
		}
		if ok {
			e.pins++
			return e, nil
		}
		break
	}
	c.misses++
	c.evictLocked(1)
	e := &cacheEntry{off: off, loading: make(chan struct{})}
	e.elem = c.lru.PushFront(e)
	c.entries[off] = e
	ch := e.loading
	c.mu.Unlock()
	buf := make([]byte, c.size)
	err := block.ReadFull(c.file, buf, int64(off))
	c.mu.Lock()
	e.loading = nil
	close(ch)
	if err != nil {
		c.removeLocked(e)
		return nil, fmt.Errorf("qcow2: reading %s at %#x: %w", c.name, off, err)
	}
	e.buf = buf
	e.pins++
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

// insertLocked adds a fresh table (zeroed or copied by the caller) that
// does not need reading, marked dirty.
func (c *tableCache) insertLocked(off uint64, buf []byte) *cacheEntry {
	if e, ok := c.entries[off]; ok {
		// A stale clean copy of a cluster that was freed and reused.
		c.removeLocked(e)
	}
	c.evictLocked(1)
	e := &cacheEntry{off: off, buf: buf, dirty: true, gen: 1}
	e.elem = c.lru.PushFront(e)
	c.entries[off] = e
	return e
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
	}
	if e.elem != nil {
		c.lru.Remove(e.elem)
		e.elem = nil
	}
}

// evictLocked makes room for n new entries by dropping clean, unpinned
// entries from the cold end. When only dirty entries remain the cache
// grows past capacity until the next flush (overfullLocked reports it).
func (c *tableCache) evictLocked(n int) {
	for el := c.lru.Back(); el != nil && len(c.entries)+n > c.capacity; {
		prev := el.Prev()
		e := el.Value.(*cacheEntry)
		if e.pins == 0 && !e.dirty && e.loading == nil {
			c.removeLocked(e)
			c.evictions++
		}
		el = prev
	}
}

func (c *tableCache) overfullLocked() bool { return len(c.entries) > c.capacity }

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
		c.writebacks++
	}
	c.evictLocked(0)
}
