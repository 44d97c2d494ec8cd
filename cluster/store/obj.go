package store

import (
	"errors"
	"fmt"
	"slices"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/ovis-storage/ovis/cluster/object"
)

// obj is what a Store knows of one object. It is loaded from the file's
// header on first use and then kept.
//
// Locking: mu is taken after Store.mu and vdiState.mu; journal.mu and
// fdcache.mu may be taken under it. It is never held across I/O: a
// caller that must do I/O for the object's state (load, journal record,
// creation, header) sets the flag that says so, drops mu, and the others
// wait on cond.
type obj struct {
	id   object.ID
	v    *vdiState
	path string

	refs int // callers holding the pointer; guarded by Store.mu

	mu        sync.Mutex
	cond      sync.Cond
	loaded    bool
	loading   bool   // one caller reads the header
	exists    bool   // the file exists (or is being created by prep)
	tomb      bool   // the file is a tombstone: it reads as missing
	version   uint64 // last version handed out (a tombstone's, too)
	suspect   bool   // the copy may be torn; recSuspect is in the journal
	journaled bool   // a recDirty or recSuspect record is durable
	prepping  bool   // one writer journals or creates
	excl      bool   // Put, Remove or ClearSuspect owns the object
	users     int    // calls using the file
	writers   int    // of them, mutating calls: the copy is in flux
	createGen uint64 // vdiState.dirGen when the file was created
	dirtyGen  uint64 // bumped by every acknowledged unsynced mutation
	syncedGen uint64 // dirtyGen covered by an fdatasync
	// An fdatasync that succeeds proves nothing when another of the file
	// failed: Linux reports a writeback error once, to whichever sync of
	// the shared fd sees it first, and may have dropped the pages. So a
	// failure sticks (syncFailed, until the file is replaced), and a
	// success counts only once every sync begun before it returned has
	// said how it went (syncing: the tickets of those in progress).
	syncTicket uint64
	syncing    []uint64
	syncFailed bool
	hdrBusy    bool   // one caller writes the header
	hdrDone    uint64 // version in the header (page cache)
	hdrTomb    bool   // the header (page cache) says removed
	// hdrBuf is the header writeHeader encodes, used only by the caller
	// that set hdrBusy: a buffer passed through the vfs.FS interface
	// escapes, and one per write would be an allocation per write.
	hdrBuf [headerLen]byte

	// data orders the copy's data I/O: a mutation's I/O on the file
	// holds it, a read's pread shares it, so that a read sees each write
	// whole or not at all (a pread racing a pwrite of the same page can
	// return part of each). It is held only across that I/O (page-cache
	// copies, or a fallocate), never with mu or another store lock, and
	// never across an fdatasync.
	data sync.RWMutex
}

// load reads the object's header the first time. Called with o.mu held;
// returns with it held.
func (s *Store) loadLocked(o *obj) {
	for !o.loaded {
		if o.loading {
			o.cond.Wait()
			continue
		}
		o.loading = true
		o.mu.Unlock()
		exists, h, err := s.readHeader(o)
		o.mu.Lock()
		o.loading, o.loaded = false, true
		o.exists, o.version, o.hdrDone = exists, h.version, h.version
		o.tomb, o.hdrTomb = h.removed, h.removed
		if err != nil && !o.suspect {
			s.log.Error("store: object header unreadable, copy suspect", "object", o.id, "err", err)
			o.suspect = true
			o.journaled = true
			s.j.enqueue(record{key: uint64(o.id), op: recSuspect}) // durable with the next batch
		}
		o.cond.Broadcast()
	}
}

func (s *Store) readHeader(o *obj) (exists bool, h header, err error) {
	fd, err := s.fs.Open(o.path, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if errors.Is(err, unix.ENOENT) {
		return false, header{}, nil
	}
	if err != nil {
		return false, header{}, fmt.Errorf("open: %w", err)
	}
	defer s.fs.Close(fd)
	var b [headerLen]byte
	n, err := s.fs.Pread(fd, b[:], 0)
	if err != nil {
		return true, header{}, fmt.Errorf("read header: %w", err)
	}
	if h, err = decodeHeader(b[:n], o.id); err != nil {
		return true, header{}, err
	}
	return true, h, nil
}

// testBreakJournal, set only by the crash harness's self-test, skips the
// dirty record before a first write: the harness must then fail.
var testBreakJournal bool

// access is a call's hold on an object; release with end.
type access struct {
	o       *obj
	mutate  bool
	fd      *fdEntry
	version uint64
	created bool
}

// How a call uses an object, for begin.
type beginMode int

const (
	forRead        beginMode = iota // a live copy that is not suspect
	forReadSuspect                  // any copy with a file, suspect or not
	forWrite                        // journaled, created or recreated; a new version
)

// begin admits a call to o: it loads o, waits out Put and Remove, and
// refuses suspect copies (unless forReadSuspect). A write makes sure the
// object is journaled and exists as live data (creating its file, or
// truncating a tombstone's); it takes the version after o's for epoch.
// The file is opened unless the object does not exist or is a tombstone
// (then ErrNotFound).
func (s *Store) begin(o *obj, mode beginMode, epoch uint64) (*access, error) {
	mutate := mode == forWrite
	o.mu.Lock()
	for {
		s.loadLocked(o)
		if o.excl {
			o.cond.Wait()
			continue
		}
		if o.suspect && mode != forReadSuspect {
			o.mu.Unlock()
			return nil, fmt.Errorf("store: object %s: %w", o.id, ErrSuspect)
		}
		if !mutate && (!o.exists || o.tomb) {
			o.mu.Unlock()
			return nil, fmt.Errorf("store: object %s: %w", o.id, ErrNotFound)
		}
		if !mutate || (o.journaled && o.exists && !o.tomb) {
			break
		}
		if o.prepping {
			o.cond.Wait()
			continue
		}
		if err := s.prepLocked(o); err != nil {
			o.mu.Unlock()
			return nil, err
		}
	}
	a := &access{o: o, mutate: mutate}
	o.users++
	if mutate {
		o.writers++
		o.version = nextVersion(o.version, epoch)
	}
	a.version = o.version
	o.mu.Unlock()
	fd, err := s.fds.get(o.id, o.path, false)
	if err != nil {
		err = fmt.Errorf("store: object %s: open: %w", o.id, err)
		if mutate {
			// The version is handed out, and the file may be new: the
			// copy is neither as before nor as after the write.
			err = s.failed(o, err)
		}
		s.end(a)
		return nil, err
	}
	a.fd = fd
	return a, nil
}

// prepLocked journals o (durably, before any write to it) and creates
// its file, or truncates a tombstone's to the header. Called with o.mu
// held and o.prepping false; drops mu for the I/O and returns with it
// held. A recreated tombstone keeps its version in o.version, so that
// the write's version continues from it.
func (s *Store) prepLocked(o *obj) error {
	o.prepping = true
	needJ, needC, needT := !o.journaled, !o.exists, o.exists && o.tomb
	var seq uint64
	if needJ && !testBreakJournal {
		seq = s.j.enqueue(record{key: uint64(o.id), op: recDirty})
	}
	o.mu.Unlock()
	createGen, journaled, err := s.prepIO(o, needJ, needC, needT, seq)
	o.mu.Lock()
	o.prepping = false
	o.cond.Broadcast()
	if journaled {
		o.journaled = true // the record is durable even if the rest failed
	}
	if err != nil {
		return err
	}
	if needC {
		o.exists = true
		o.hdrDone, o.hdrTomb = 0, false
		o.createGen = createGen
	}
	if needT {
		o.tomb = false // the header says removed until the write's header update
	}
	return nil
}

// prepIO does prepLocked's I/O. It returns, for a created file, the
// VDI's directory generation that covers it, and whether it made the
// dirty record durable (even when a later step failed).
func (s *Store) prepIO(o *obj, needJ, needC, needT bool, seq uint64) (gen uint64, journaled bool, err error) {
	if needJ {
		// A record cut off (ENOSPC) leaves o unjournaled: the next write
		// enqueues it again.
		if err := s.j.wait(seq); err != nil {
			return 0, false, fmt.Errorf("store: object %s: %w", o.id, err)
		}
		o.v.mu.Lock()
		o.v.journaled[o.id] = o
		o.v.mu.Unlock()
	}
	gen, err = s.prepFile(o, needC, needT)
	return gen, needJ, err
}

// prepFile creates o's file, or truncates a tombstone's to the header.
func (s *Store) prepFile(o *obj, needC, needT bool) (uint64, error) {
	if needT {
		// A tombstone holds no data (Remove writes it header-only); the
		// truncate is for a file whose creator crashed before it was.
		if err := s.fs.Truncate(o.path, HeaderSize); err != nil {
			return 0, fmt.Errorf("store: object %s: recreate: %w", o.id, err)
		}
	}
	if !needC {
		return 0, nil
	}
	if err := s.ensureVDIDir(o.v); err != nil {
		return 0, err
	}
	fd, err := s.fs.Open(o.path, unix.O_RDWR|unix.O_CREAT|unix.O_CLOEXEC, 0o644)
	if err != nil {
		return 0, fmt.Errorf("store: object %s: create: %w", o.id, noSpace(err))
	}
	defer s.fs.Close(fd)
	o.v.mu.Lock()
	o.v.dirGen++
	gen := o.v.dirGen
	o.v.mu.Unlock()
	var b [headerLen]byte
	header{id: o.id}.encode(b[:])
	if _, err := s.fs.Pwrite(fd, b[:], 0); err != nil {
		return 0, fmt.Errorf("store: object %s: create: %w", o.id, noSpace(err))
	}
	return gen, nil
}

func (s *Store) end(a *access) {
	if a.fd != nil {
		s.fds.put(a.fd)
	}
	o := a.o
	o.mu.Lock()
	if a.mutate {
		o.writers--
	}
	if o.users--; o.users == 0 {
		o.cond.Broadcast()
	}
	o.mu.Unlock()
}

// writeHeader makes sure the header holds at least version ver (in the
// page cache). Concurrent writers share the header writes: one writes
// the newest version while the others wait.
func (s *Store) writeHeader(a *access) error {
	o := a.o
	o.mu.Lock()
	defer o.mu.Unlock()
	for o.hdrDone < a.version || o.hdrTomb != o.tomb {
		if o.hdrBusy {
			o.cond.Wait()
			continue
		}
		o.hdrBusy = true
		w, tomb := o.version, o.tomb
		o.mu.Unlock()
		b := o.hdrBuf[:]
		header{id: o.id, version: w, removed: tomb}.encode(b)
		_, err := s.fs.Pwrite(a.fd.fd, b, 0)
		o.mu.Lock()
		o.hdrBusy = false
		o.cond.Broadcast()
		if err != nil {
			return fmt.Errorf("store: object %s: write header: %w", o.id, noSpace(err))
		}
		if w >= o.hdrDone {
			o.hdrDone, o.hdrTomb = w, tomb
		}
	}
	return nil
}

// syncData fdatasyncs o's file through fd. It fails when that or any
// fdatasync of the file begun before it returned failed, since the file
// was last replaced: the writes it was to make durable may be lost.
func (s *Store) syncData(o *obj, fd int) error {
	o.mu.Lock()
	o.syncTicket++
	t := o.syncTicket
	o.syncing = append(o.syncing, t)
	o.mu.Unlock()
	err := s.fs.Fdatasync(fd)
	o.mu.Lock()
	defer o.mu.Unlock()
	i := slices.Index(o.syncing, t)
	o.syncing[i] = o.syncing[len(o.syncing)-1]
	o.syncing = o.syncing[:len(o.syncing)-1]
	o.cond.Broadcast()
	if err != nil {
		o.syncFailed = true
		return fmt.Errorf("fdatasync: %w", err)
	}
	for end := o.syncTicket; !o.syncFailed && slices.ContainsFunc(o.syncing, func(u uint64) bool { return u < end }); {
		o.cond.Wait()
	}
	if o.syncFailed {
		return fmt.Errorf("fdatasync: an earlier one of this file failed: %w", ErrSuspect)
	}
	return nil
}

// resetSyncLocked forgets a failed fdatasync: o's file was replaced or
// deleted. Called with o.mu held.
func (o *obj) resetSyncLocked() { o.syncFailed = false }

// failed marks o suspect after an I/O error left its copy unknown.
func (s *Store) failed(o *obj, err error) error {
	o.mu.Lock()
	already := o.suspect
	o.suspect = true
	var seq uint64
	if !already {
		seq = s.j.enqueue(record{key: uint64(o.id), op: recSuspect})
	}
	o.mu.Unlock()
	if !already {
		s.log.Error("store: write failed, copy suspect", "object", o.id, "err", err)
		if jerr := s.j.wait(seq); jerr != nil {
			return errors.Join(err, jerr)
		}
	}
	return err
}

// noSpace makes ENOSPC an ErrNoSpace.
func noSpace(err error) error {
	if errors.Is(err, unix.ENOSPC) {
		return fmt.Errorf("%w: %w", ErrNoSpace, err)
	}
	return err
}
