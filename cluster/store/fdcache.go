package store

import (
	"container/list"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/ovis-storage/ovis/cluster/object"
	"github.com/ovis-storage/ovis/cluster/store/vfs"
)

// fdcache keeps at most max object files open, least recently used
// closed first. An fd in use (refs > 0) is never closed: the cache may
// then hold more than max until the users release them.
//
// Locking: mu is a leaf lock, never held across open or close.
type fdcache struct {
	fs  vfs.FS
	max int

	mu  sync.Mutex
	m   map[object.ID]*fdEntry
	lru list.List // of *fdEntry, most recent first
}

type fdEntry struct {
	id   object.ID
	fd   int
	refs int
	elem *list.Element
	dead bool // dropped from the cache; closed when refs reaches 0
}

func newFDCache(fs vfs.FS, max int) *fdcache {
	return &fdcache{fs: fs, max: max, m: map[object.ID]*fdEntry{}}
}

// get returns a referenced fd for id's file at path, opening it (with
// O_CREAT when create) if it is not cached. Release it with put.
func (c *fdcache) get(id object.ID, path string, create bool) (*fdEntry, error) {
	c.mu.Lock()
	if e, ok := c.m[id]; ok {
		e.refs++
		c.lru.MoveToFront(e.elem)
		c.mu.Unlock()
		return e, nil
	}
	c.mu.Unlock()
	flags := unix.O_RDWR | unix.O_CLOEXEC
	if create {
		flags |= unix.O_CREAT
	}
	fd, err := c.fs.Open(path, flags, 0o644)
	if err != nil {
		return nil, err
	}
	c.mu.Lock()
	if e, ok := c.m[id]; ok { // lost a race with another opener
		e.refs++
		c.lru.MoveToFront(e.elem)
		c.mu.Unlock()
		c.fs.Close(fd)
		return e, nil
	}
	e := &fdEntry{id: id, fd: fd, refs: 1}
	e.elem = c.lru.PushFront(e)
	c.m[id] = e
	evict := c.evictLocked()
	c.mu.Unlock()
	c.closeFDs(evict)
	return e, nil
}

func (c *fdcache) evictLocked() []int {
	var out []int
	for el := c.lru.Back(); el != nil && len(c.m) > c.max; {
		e := el.Value.(*fdEntry)
		prev := el.Prev()
		if e.refs == 0 {
			c.lru.Remove(el)
			delete(c.m, e.id)
			out = append(out, e.fd)
		}
		el = prev
	}
	return out
}

// put releases a reference taken by get.
func (c *fdcache) put(e *fdEntry) {
	c.mu.Lock()
	e.refs--
	var evict []int
	if e.refs == 0 && e.dead {
		evict = append(evict, e.fd)
	} else if e.refs == 0 && len(c.m) > c.max {
		evict = c.evictLocked()
	}
	c.mu.Unlock()
	c.closeFDs(evict)
}

// drop forgets id's fd (its file is being replaced or removed); it is
// closed once its last user releases it.
func (c *fdcache) drop(id object.ID) {
	c.mu.Lock()
	e, ok := c.m[id]
	var evict []int
	if ok {
		delete(c.m, id)
		c.lru.Remove(e.elem)
		e.dead = true
		if e.refs == 0 {
			evict = append(evict, e.fd)
		}
	}
	c.mu.Unlock()
	c.closeFDs(evict)
}

// closeAll closes every cached fd; callers make sure none is in use.
func (c *fdcache) closeAll() {
	c.mu.Lock()
	var fds []int
	for _, e := range c.m {
		fds = append(fds, e.fd)
	}
	c.m = map[object.ID]*fdEntry{}
	c.lru.Init()
	c.mu.Unlock()
	c.closeFDs(fds)
}

func (c *fdcache) closeFDs(fds []int) {
	for _, fd := range fds {
		c.fs.Close(fd)
	}
}
