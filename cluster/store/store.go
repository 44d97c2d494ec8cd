package store

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/ovis-storage/ovis/cluster/object"
	"github.com/ovis-storage/ovis/cluster/store/vfs"
)

// MaxObjectSize is the largest object a Store holds; offsets and
// lengths are checked against it (ErrRange).
const MaxObjectSize = 1 << object.MaxSizeShift

// formatText is the content of DIR/FORMAT.
const formatText = "ovis store 1\n"

// Options configure a Store.
type Options struct {
	// MaxOpenFiles bounds the object files kept open. The default is 256.
	MaxOpenFiles int
	// Reserve is the number of bytes kept free on the file system: a
	// write that may allocate and would leave less free gets ErrNoSpace.
	// The default is 0.
	Reserve int64
	// Logger receives the store's few log lines. nil means slog.Default().
	Logger *slog.Logger
	// FS is the file system every file operation of the store goes
	// through: tests put a fault-injecting one (vfs/errorfs) here. nil
	// means vfs.Default, the operating system's.
	FS vfs.FS
}

// Validate reports an option out of range.
func (o Options) Validate() error {
	if o.MaxOpenFiles < 0 {
		return fmt.Errorf("store: MaxOpenFiles %d: want >= 0", o.MaxOpenFiles)
	}
	if o.Reserve < 0 {
		return fmt.Errorf("store: Reserve %d: want >= 0", o.Reserve)
	}
	return nil
}

// Store holds one node's objects in a directory. See the package doc
// for the layout, the durability protocol and the lock order.
//
// Locking: mu guards objs, vdis and closed; it is taken before a vdi's
// or an object's mutex and never held across I/O.
//
// Safe for concurrent use. Release with Close.
type Store struct {
	dir, objDir, tmpDir string
	opts                Options
	log                 *slog.Logger
	fs                  vfs.FS
	j                   *journal
	fds                 *fdcache
	lockFD              int

	ops sync.WaitGroup // calls in progress; Close waits for them

	mu     sync.Mutex
	closed bool
	objs   map[object.ID]*obj
	vdis   map[object.VDI]*vdiState
}

// Open opens or creates the store in dir. When the previous Store on dir
// did not Close cleanly, every object that had writes not known durable
// becomes suspect (ErrSuspect) until Put or ClearSuspect.
func Open(dir string, o Options) (*Store, error) {
	if err := o.Validate(); err != nil {
		return nil, err
	}
	if o.MaxOpenFiles == 0 {
		o.MaxOpenFiles = 256
	}
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	if o.FS == nil {
		o.FS = vfs.Default
	}
	s := &Store{
		dir: dir, objDir: filepath.Join(dir, "objects"), tmpDir: filepath.Join(dir, "tmp"),
		opts: o, log: o.Logger, fs: o.FS, fds: newFDCache(o.FS, o.MaxOpenFiles), lockFD: -1,
		objs: map[object.ID]*obj{}, vdis: map[object.VDI]*vdiState{},
	}
	if err := s.open(); err != nil {
		if s.j != nil {
			s.j.close()
		}
		if s.lockFD >= 0 {
			s.fs.Close(s.lockFD)
		}
		return nil, err
	}
	return s, nil
}

func (s *Store) open() error {
	for _, d := range []string{s.dir, s.objDir, s.tmpDir} {
		if err := s.fs.MkdirAll(d, 0o755); err != nil {
			return fmt.Errorf("store: %w", err)
		}
	}
	fd, err := s.fs.Open(filepath.Join(s.dir, "LOCK"), unix.O_RDWR|unix.O_CREAT|unix.O_CLOEXEC, 0o644)
	if err != nil {
		return fmt.Errorf("store: lock file: %w", err)
	}
	s.lockFD = fd
	if err := s.fs.Flock(fd, unix.LOCK_EX|unix.LOCK_NB); err != nil {
		return fmt.Errorf("store: %s is in use by another store: %w", s.dir, err)
	}
	// Leftovers of a Put that crashed: leaked space only.
	if names, err := s.fs.ReadDir(s.tmpDir); err == nil {
		for _, name := range names {
			s.fs.RemoveAll(filepath.Join(s.tmpDir, name))
		}
	}
	formatPath := filepath.Join(s.dir, "FORMAT")
	cleanPath := filepath.Join(s.dir, "CLEAN")
	format, err := readFile(s.fs, formatPath)
	fresh := errors.Is(err, os.ErrNotExist)
	switch {
	case fresh:
	case err != nil:
		return fmt.Errorf("store: %w", err)
	case string(format) != formatText:
		return fmt.Errorf("store: %s: format %q, want %q: %w", formatPath, format, formatText, ErrCorrupt)
	}
	_, err = s.fs.Stat(cleanPath)
	clean := err == nil
	if s.j, err = openJournal(s.fs, s.dir); err != nil {
		return err
	}
	suspects := 0
	for id, op := range s.j.live.objs {
		switch {
		case op == recDirty && clean:
			delete(s.j.live.objs, id) // Close synced it
		case op == recDirty:
			s.j.live.objs[id] = recSuspect
			suspects++
		default:
			suspects++
		}
	}
	if !fresh && !clean {
		s.log.Warn("store: unclean shutdown", "dir", s.dir, "suspect", suspects)
	}
	if err := s.j.compact(); err != nil {
		return fmt.Errorf("store: journal: %w", err)
	}
	if fresh {
		if err := writeFileSync(s.fs, formatPath, []byte(formatText)); err != nil {
			return fmt.Errorf("store: %w", err)
		}
	}
	if clean {
		if err := s.fs.Remove(cleanPath); err != nil {
			return fmt.Errorf("store: clean marker: %w", err)
		}
	}
	// The marker's removal must be durable before the first write.
	return syncDir(s.fs, s.dir)
}

// Crash closes the store as a killed process leaves it: nothing is
// flushed or synced, no clean marker is written, and the next Open
// recovers as after a crash (the journal's dirty objects are suspect).
// What the file system holds stays (a process crash keeps the page
// cache). For in-process tests that kill a node. A second call, or one
// after Close, returns ErrClosed.
func (s *Store) Crash() error {
	if err := s.shut(); err != nil {
		return err
	}
	s.fds.closeAll()
	s.j.close()
	s.fs.Close(s.lockFD)
	return nil
}

// shut refuses calls from now on and waits for those in progress; a
// store shut already gets ErrClosed.
func (s *Store) shut() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return ErrClosed
	}
	s.closed = true
	s.mu.Unlock()
	s.ops.Wait()
	return nil
}

// Close makes every write durable, writes the clean-shutdown marker and
// releases the directory. Calls in progress finish first; later calls
// get ErrClosed, and so does a second Close.
func (s *Store) Close() error {
	if err := s.shut(); err != nil {
		return err
	}
	err := s.j.failure() // no clean marker over a journal that failed
	if err == nil {
		err = s.flush(0)
	}
	if err == nil {
		err = s.j.compact()
	}
	if err == nil {
		err = writeFileSync(s.fs, filepath.Join(s.dir, "CLEAN"), nil)
	}
	if err == nil {
		err = syncDir(s.fs, s.dir)
	}
	s.fds.closeAll()
	if cerr := s.j.close(); err == nil && cerr != nil {
		err = fmt.Errorf("store: journal: %w", cerr)
	}
	s.fs.Close(s.lockFD)
	return err
}

// enterWrite admits a call that may change anything (Flush included),
// unless the journal failed: after that no record is known durable, so
// nothing that relies on one may be acknowledged. Leave with s.ops.Done.
func (s *Store) enterWrite() error {
	if err := s.enter(); err != nil {
		return err
	}
	if err := s.j.failure(); err != nil {
		s.ops.Done()
		return err
	}
	return nil
}

// Err returns the failure that stopped the store from accepting
// changes (its journal could not be made durable), or nil. Reads of
// good copies go on after it; every mutating call and Flush return it.
func (s *Store) Err() error { return s.j.failure() }

// enter admits a call; leave with s.ops.Done.
func (s *Store) enter() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return ErrClosed
	}
	s.ops.Add(1)
	return nil
}

func (s *Store) vdiDir(v object.VDI) string {
	return filepath.Join(s.objDir, fmt.Sprintf("%08x", uint32(v)))
}

func (s *Store) objPath(id object.ID) string {
	return filepath.Join(s.vdiDir(id.VDI()), fmt.Sprintf("%08x", id.Index()))
}

func (s *Store) vdi(v object.VDI) *vdiState {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.vdiLocked(v)
}

func (s *Store) vdiLocked(v object.VDI) *vdiState {
	vs, ok := s.vdis[v]
	if !ok {
		s.j.mu.Lock()
		tok := s.j.live.tokens[v]
		s.j.mu.Unlock()
		vs = &vdiState{id: v, token: tok, inflight: map[uint64]int{}, journaled: map[object.ID]*obj{}}
		vs.cond.L = &vs.mu
		s.vdis[v] = vs
	}
	return vs
}

// obj returns id's state, referenced; release it with release. Clean
// idle objects beyond maxIdleObjects are forgotten (their header says
// all there is), so memory follows the working set, not the disk.
func (s *Store) obj(id object.ID) *obj {
	s.mu.Lock()
	defer s.mu.Unlock()
	o, ok := s.objs[id]
	if ok {
		o.refs++
	} else {
		v := s.vdiLocked(id.VDI())
		s.j.mu.Lock()
		op, journaled := s.j.live.objs[id]
		s.j.mu.Unlock()
		o = &obj{id: id, v: v, path: s.objPath(id), suspect: op == recSuspect, refs: 1}
		o.cond.L = &o.mu
		s.objs[id] = o
		if journaled {
			// Still owed a Flush or a repair: Flush must find it.
			o.journaled = true
			v.mu.Lock()
			v.journaled[id] = o
			v.mu.Unlock()
		}
	}
	return o
}

// maxIdleObjects is how many objects a Store keeps in memory before it
// forgets idle clean ones.
var maxIdleObjects = 4096

func (s *Store) release(o *obj) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if o.refs--; o.refs > 0 || len(s.objs) <= maxIdleObjects {
		return
	}
	o.mu.Lock()
	idle := o.loaded && !o.loading && !o.journaled && !o.suspect && !o.prepping && !o.excl &&
		o.users == 0 && !o.hdrBusy && o.hdrDone == o.version && o.hdrTomb == o.tomb && o.dirtyGen == o.syncedGen
	o.mu.Unlock()
	if idle {
		delete(s.objs, o.id)
	}
}

// vdiState is what a Store knows of one VDI.
//
// Locking: mu is taken after Store.mu and before obj.mu.
type vdiState struct {
	id object.VDI

	mu        sync.Mutex
	cond      sync.Cond
	token     uint64             // highest token, durable in the journal
	inflight  map[uint64]int     // mutating calls in progress, by token
	journaled map[object.ID]*obj // objects with a recDirty record
	dirMade   bool               // the VDI's directory exists
	dirGen    uint64             // object files created
	dirSynced uint64             // dirGen durable in the directory
}

// admit checks token against the VDI's highest, raises it durably when
// token is higher (waiting for calls with lower tokens to drain), and
// counts a call in progress. Release with done.
func (s *Store) admit(v *vdiState, token uint64) error {
	if err := s.raise(v, token); err != nil {
		return err
	}
	v.mu.Lock()
	defer v.mu.Unlock()
	if token < v.token {
		return fmt.Errorf("store: vdi %08x: token %d < %d: %w", uint32(v.id), token, v.token, ErrStaleToken)
	}
	v.inflight[token]++
	return nil
}

func (v *vdiState) done(token uint64) {
	v.mu.Lock()
	if v.inflight[token]--; v.inflight[token] == 0 {
		delete(v.inflight, token)
		v.cond.Broadcast()
	}
	v.mu.Unlock()
}

// raise makes token the VDI's highest, durably, unless it is lower; it
// returns once no call with a lower token is in progress.
func (s *Store) raise(v *vdiState, token uint64) error {
	v.mu.Lock()
	if token < v.token {
		t := v.token
		v.mu.Unlock()
		return fmt.Errorf("store: vdi %08x: token %d < %d: %w", uint32(v.id), token, t, ErrStaleToken)
	}
	if token == v.token {
		v.mu.Unlock()
		return nil
	}
	v.mu.Unlock()
	if err := s.j.wait(s.j.enqueue(record{key: uint64(v.id), val: token, op: recToken})); err != nil {
		return err
	}
	v.mu.Lock()
	defer v.mu.Unlock()
	if token > v.token {
		v.token = token
	}
	for {
		lower := false
		for t := range v.inflight {
			if t < token {
				lower = true
				break
			}
		}
		if !lower {
			return nil
		}
		v.cond.Wait()
	}
}

// Fence raises vdi's highest token to token, durably, and returns once
// every call carrying a lower token has finished or been refused. It
// returns ErrStaleToken when token is lower than the highest.
func (s *Store) Fence(vdi object.VDI, token uint64) error {
	if vdi == 0 {
		return fmt.Errorf("store: fence: vdi 0 is no VDI: %w", ErrRange)
	}
	if err := s.enterWrite(); err != nil {
		return err
	}
	defer s.ops.Done()
	return s.raise(s.vdi(vdi), token)
}

// Token returns the highest token seen for vdi, 0 if none.
func (s *Store) Token(vdi object.VDI) uint64 {
	v := s.vdi(vdi)
	v.mu.Lock()
	defer v.mu.Unlock()
	return v.token
}

// ensureVDIDir creates the VDI's directory, durably, the first time.
func (s *Store) ensureVDIDir(v *vdiState) error {
	v.mu.Lock()
	made := v.dirMade
	v.mu.Unlock()
	if made {
		return nil
	}
	// Every caller that finds it not yet made syncs the parent itself, so
	// none goes on before the directory's entry is durable.
	if err := s.fs.Mkdir(s.vdiDir(v.id), 0o755); err != nil && !errors.Is(err, os.ErrExist) {
		return fmt.Errorf("store: vdi %08x: %w", uint32(v.id), err)
	}
	if err := syncDir(s.fs, s.objDir); err != nil {
		return fmt.Errorf("store: vdi %08x: %w", uint32(v.id), err)
	}
	v.mu.Lock()
	v.dirMade = true
	v.mu.Unlock()
	return nil
}

// syncVDIDir makes every object file created so far in the VDI durable
// in its directory.
func (s *Store) syncVDIDir(v *vdiState, upTo uint64) error {
	v.mu.Lock()
	gen := v.dirGen
	done := v.dirSynced >= upTo
	v.mu.Unlock()
	if done {
		return nil
	}
	if err := syncDir(s.fs, s.vdiDir(v.id)); err != nil {
		return fmt.Errorf("store: vdi %08x: %w", uint32(v.id), err)
	}
	v.mu.Lock()
	if gen > v.dirSynced {
		v.dirSynced = gen
	}
	v.mu.Unlock()
	return nil
}
