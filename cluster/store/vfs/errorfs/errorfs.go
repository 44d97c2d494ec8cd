// Package errorfs is a vfs.FS for tests that fails the operations its
// rules match: an error such as EIO or ENOSPC, a torn pwrite (a prefix
// written, then the error), the loss of a file's unsynced writes when
// its fdatasync fails (as Linux may drop the dirty pages and report the
// error only once), and a crash after which nothing reaches the files.
// pebble's vfs/errorfs is the model.
//
// The faults drawn with a probability come from one seeded generator,
// so a single-threaded run replays exactly from its seed.
package errorfs

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/ovis-storage/ovis/cluster/store/vfs"
)

// ErrInjected is wrapped by every error this package makes up, beside
// the rule's errno: errors.Is(err, ErrInjected) tells a fault from a
// real failure.
var ErrInjected = errors.New("errorfs: injected")

// ErrCrashed is returned by every operation but Close after a crash.
var ErrCrashed = errors.New("errorfs: crashed")

// Kind is the kind of an operation.
type Kind uint8

const (
	Open     Kind = iota
	Close         // never failed: a dead process's files are closed too
	Read          // pread
	Write         // pwrite
	Allocate      // fallocate
	Truncate      // ftruncate, truncate
	Sync          // fdatasync, fsync (of files and directories)
	Seek
	Stat // fstat, stat, statfs
	Lock
	Mkdir // mkdir, mkdir -p
	Remove
	Rename
	ReadDir
	kinds
)

var kindNames = [kinds]string{"open", "close", "read", "write", "allocate", "truncate", "sync", "seek", "stat", "lock", "mkdir", "remove", "rename", "readdir"}

func (k Kind) String() string {
	if k < kinds {
		return kindNames[k]
	}
	return fmt.Sprintf("kind(%d)", k)
}

// Op is one operation, as the rules see it.
type Op struct {
	Kind Kind
	// Path is the path operated on; for an fd, the path it was opened
	// by (for Rename, the source).
	Path string
	Off  int64 // Read, Write, Allocate, Truncate
	Len  int64
}

func (op Op) String() string {
	return fmt.Sprintf("%s %s at %d+%d", op.Kind, op.Path, op.Off, op.Len)
}

// Rule says which operations fail and how. A rule fires on a matching
// operation once After matching ones went by, at most Times times, each
// time with probability Prob; the first rule that fires decides.
type Rule struct {
	Kinds []Kind            // the kinds it matches; none: every kind but Close
	Path  func(string) bool // nil: any path
	After int               // matching operations let through first
	Times int               // fires at most this often; 0: without limit
	Prob  float64           // chance to fire on a match; 0 means 1
	Err   error             // returned, wrapped with ErrInjected; nil means EIO

	// Tear makes a failing Write write a random proper prefix of its
	// bytes before it returns the error, as a torn write leaves them.
	Tear bool
	// Lose makes a failing Sync undo the file's writes since its last
	// successful sync, as the kernel may drop dirty pages whose
	// writeback failed (and then report the error only once).
	Lose bool
	// Crash makes the FS crash after the failure: every later operation
	// but Close returns ErrCrashed, and the files keep what they hold
	// (a killed process's page cache survives it).
	Crash bool

	seen, fired int // guarded by FS.mu
}

func (r *Rule) matches(op Op) bool {
	if len(r.Kinds) == 0 {
		return op.Kind != Close
	}
	for _, k := range r.Kinds {
		if k == op.Kind {
			return r.Path == nil || r.Path(op.Path)
		}
	}
	return false
}

// Event is a fault the FS injected.
type Event struct {
	Op   Op
	Err  error
	Torn int64 // bytes a torn write did write
}

func (e Event) String() string {
	if e.Op.Kind == Write {
		return fmt.Sprintf("%s: %v (%d bytes written)", e.Op, e.Err, e.Torn)
	}
	return fmt.Sprintf("%s: %v", e.Op, e.Err)
}

// Contains is a Path predicate: the path contains sub.
func Contains(sub string) func(string) bool {
	return func(p string) bool { return strings.Contains(p, sub) }
}

// FS wraps another vfs.FS and fails what its rules say.
//
// Locking: mu guards the rules, the fd table, the undo logs and the
// events; it is never held across an operation of the inner FS, except
// for the short reads and writes that keep or apply a file's undo log.
//
// Safe for concurrent use.
type FS struct {
	inner vfs.FS

	mu      sync.Mutex
	rng     *rand.Rand
	rules   []*Rule
	fds     map[int]file
	undo    map[fileID]*undoLog
	crashed bool
	events  []Event
}

// fileID names a file by its inode, so that an undo log follows the
// file through renames and outlives an unlinked path's open fds.
type fileID struct{ dev, ino uint64 }

type file struct {
	path string
	id   fileID
}

// undoLog holds what a file held before its writes since the last
// successful sync: its size then, and the old bytes of each range
// written, newest last.
type undoLog struct {
	size int64
	old  []extent
}

type extent struct {
	off int64
	b   []byte
}

var _ vfs.FS = (*FS)(nil)

// New returns an FS over inner (vfs.Default when nil) with no rules; the
// faults drawn by chance come from seed.
func New(inner vfs.FS, seed uint64) *FS {
	if inner == nil {
		inner = vfs.Default
	}
	return &FS{
		inner: inner, rng: rand.New(rand.NewPCG(seed, seed^0x5851f42d4c957f2d)),
		fds: map[int]file{}, undo: map[fileID]*undoLog{},
	}
}

// Add appends rules; they apply to the operations that begin after.
func (f *FS) Add(rules ...*Rule) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.rules = append(f.rules, rules...)
}

// Clear removes every rule.
func (f *FS) Clear() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.rules = nil
}

// Crash makes every later operation but Close fail with ErrCrashed.
func (f *FS) Crash() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.crashed = true
}

// Crashed reports whether the FS crashed.
func (f *FS) Crashed() bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.crashed
}

// Events returns the faults injected so far, oldest first.
func (f *FS) Events() []Event {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]Event(nil), f.events...)
}

// fault decides op's fate: nil to run it, or the rule that fails it and
// the error to return.
func (f *FS) fault(op Op) (*Rule, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.crashed {
		if op.Kind == Close {
			return nil, nil
		}
		return nil, fmt.Errorf("errorfs: %s: %w", op, ErrCrashed)
	}
	for _, r := range f.rules {
		if !r.matches(op) {
			continue
		}
		if r.seen++; r.seen <= r.After || (r.Times > 0 && r.fired >= r.Times) {
			continue
		}
		if r.Prob > 0 && r.Prob < 1 && f.rng.Float64() >= r.Prob {
			continue
		}
		r.fired++
		errno := r.Err
		if errno == nil {
			errno = unix.EIO
		}
		return r, fmt.Errorf("%w: %w", ErrInjected, errno)
	}
	return nil, nil
}

// record logs an injected fault and, for Crash, crashes.
func (f *FS) record(r *Rule, ev Event) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.events = append(f.events, ev)
	if r.Crash {
		f.crashed = true
	}
}

func (f *FS) file(fd int) file {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.fds[fd]
}

// fdOp checks an fd operation against the rules; a non-nil error is to
// be returned as is.
func (f *FS) fdOp(k Kind, fd int, off, n int64) (file, error) {
	fl := f.file(fd)
	op := Op{Kind: k, Path: fl.path, Off: off, Len: n}
	r, err := f.fault(op)
	if r != nil {
		f.record(r, Event{Op: op, Err: err})
	}
	return fl, err
}

func (f *FS) pathOp(k Kind, path string, off, n int64) error {
	op := Op{Kind: k, Path: path, Off: off, Len: n}
	r, err := f.fault(op)
	if r != nil {
		f.record(r, Event{Op: op, Err: err})
	}
	return err
}

func (f *FS) Open(path string, flags int, perm uint32) (int, error) {
	if err := f.pathOp(Open, path, 0, 0); err != nil {
		return -1, err
	}
	fd, err := f.inner.Open(path, flags, perm)
	if err != nil {
		return fd, err
	}
	var id fileID
	if st, err := f.inner.Fstat(fd); err == nil {
		id = fileID{uint64(st.Dev), st.Ino}
	}
	f.mu.Lock()
	f.fds[fd] = file{path: path, id: id}
	f.mu.Unlock()
	if flags&unix.O_TRUNC != 0 && flags&(unix.O_WRONLY|unix.O_RDWR) != 0 {
		// What was there is gone for good: nothing to undo to.
		f.mu.Lock()
		f.undo[id] = &undoLog{}
		f.mu.Unlock()
	}
	return fd, nil
}

func (f *FS) Close(fd int) error {
	f.mu.Lock()
	delete(f.fds, fd)
	f.mu.Unlock()
	return f.inner.Close(fd)
}

func (f *FS) Pread(fd int, p []byte, off int64) (int, error) {
	if _, err := f.fdOp(Read, fd, off, int64(len(p))); err != nil {
		return 0, err
	}
	return f.inner.Pread(fd, p, off)
}

func (f *FS) Pwrite(fd int, p []byte, off int64) (int, error) {
	fl := f.file(fd)
	op := Op{Kind: Write, Path: fl.path, Off: off, Len: int64(len(p))}
	r, ferr := f.fault(op)
	if ferr != nil && r == nil { // crashed
		return 0, ferr
	}
	n := len(p)
	if r != nil {
		n = 0
		if r.Tear && len(p) > 1 {
			f.mu.Lock()
			n = 1 + f.rng.IntN(len(p)-1)
			f.mu.Unlock()
		}
	}
	var werr error
	if n > 0 {
		f.save(fd, fl.id, off, int64(n))
		n, werr = f.inner.Pwrite(fd, p[:n], off)
	}
	if r != nil {
		f.record(r, Event{Op: op, Err: ferr, Torn: int64(n)})
		return n, ferr
	}
	return n, werr
}

func (f *FS) Fallocate(fd int, mode uint32, off, n int64) error {
	fl, err := f.fdOp(Allocate, fd, off, n)
	if err != nil {
		return err
	}
	f.save(fd, fl.id, off, n)
	return f.inner.Fallocate(fd, mode, off, n)
}

func (f *FS) Ftruncate(fd int, size int64) error {
	fl, err := f.fdOp(Truncate, fd, size, 0)
	if err != nil {
		return err
	}
	f.saveTail(fd, fl.id, size)
	return f.inner.Ftruncate(fd, size)
}

func (f *FS) Fdatasync(fd int) error { return f.sync(fd, f.inner.Fdatasync) }
func (f *FS) Fsync(fd int) error     { return f.sync(fd, f.inner.Fsync) }

func (f *FS) sync(fd int, do func(int) error) error {
	fl := f.file(fd)
	op := Op{Kind: Sync, Path: fl.path}
	r, err := f.fault(op)
	if r == nil && err != nil { // crashed
		return err
	}
	if r != nil {
		if r.Lose {
			f.revert(fd, fl.id)
		}
		f.record(r, Event{Op: op, Err: err})
		return err
	}
	if err := do(fd); err != nil {
		return err
	}
	f.mu.Lock()
	delete(f.undo, fl.id)
	f.mu.Unlock()
	return nil
}

func (f *FS) Seek(fd int, off int64, whence int) (int64, error) {
	if _, err := f.fdOp(Seek, fd, off, 0); err != nil {
		return 0, err
	}
	return f.inner.Seek(fd, off, whence)
}

func (f *FS) Fstat(fd int) (unix.Stat_t, error) {
	if _, err := f.fdOp(Stat, fd, 0, 0); err != nil {
		return unix.Stat_t{}, err
	}
	return f.inner.Fstat(fd)
}

func (f *FS) Flock(fd int, how int) error {
	if _, err := f.fdOp(Lock, fd, 0, 0); err != nil {
		return err
	}
	return f.inner.Flock(fd, how)
}

func (f *FS) Truncate(path string, size int64) error {
	if err := f.pathOp(Truncate, path, size, 0); err != nil {
		return err
	}
	// Kept in the undo log through an fd of the file, as Ftruncate is.
	if fd, err := f.inner.Open(path, unix.O_RDWR|unix.O_CLOEXEC, 0); err == nil {
		if st, err := f.inner.Fstat(fd); err == nil {
			f.saveTail(fd, fileID{uint64(st.Dev), st.Ino}, size)
		}
		f.inner.Close(fd)
	}
	return f.inner.Truncate(path, size)
}

func (f *FS) Stat(path string) (unix.Stat_t, error) {
	if err := f.pathOp(Stat, path, 0, 0); err != nil {
		return unix.Stat_t{}, err
	}
	return f.inner.Stat(path)
}

func (f *FS) Statfs(path string) (unix.Statfs_t, error) {
	if err := f.pathOp(Stat, path, 0, 0); err != nil {
		return unix.Statfs_t{}, err
	}
	return f.inner.Statfs(path)
}

func (f *FS) Mkdir(path string, perm uint32) error {
	if err := f.pathOp(Mkdir, path, 0, 0); err != nil {
		return err
	}
	return f.inner.Mkdir(path, perm)
}

func (f *FS) MkdirAll(path string, perm uint32) error {
	if err := f.pathOp(Mkdir, path, 0, 0); err != nil {
		return err
	}
	return f.inner.MkdirAll(path, perm)
}

func (f *FS) Remove(path string) error {
	if err := f.pathOp(Remove, path, 0, 0); err != nil {
		return err
	}
	return f.inner.Remove(path)
}

func (f *FS) RemoveAll(path string) error {
	if err := f.pathOp(Remove, path, 0, 0); err != nil {
		return err
	}
	return f.inner.RemoveAll(path)
}

func (f *FS) Rename(from, to string) error {
	if err := f.pathOp(Rename, from, 0, 0); err != nil {
		return err
	}
	return f.inner.Rename(from, to)
}

func (f *FS) ReadDir(path string) ([]string, error) {
	if err := f.pathOp(ReadDir, path, 0, 0); err != nil {
		return nil, err
	}
	return f.inner.ReadDir(path)
}

// log returns the file's undo log, started at its current size. Called
// with mu held.
func (f *FS) logLocked(fd int, id fileID) *undoLog {
	u := f.undo[id]
	if u == nil {
		u = &undoLog{}
		if st, err := f.inner.Fstat(fd); err == nil {
			u.size = st.Size
		}
		f.undo[id] = u
	}
	return u
}

// save keeps the bytes [off, off+n) of the file hold now, clipped to its
// size, before a write or an allocation changes them.
func (f *FS) save(fd int, id fileID, off, n int64) {
	f.mu.Lock()
	defer f.mu.Unlock()
	u := f.logLocked(fd, id)
	st, err := f.inner.Fstat(fd)
	if err != nil || off >= st.Size {
		return
	}
	b := make([]byte, min(n, st.Size-off))
	k, _ := f.inner.Pread(fd, b, off)
	u.old = append(u.old, extent{off: off, b: b[:k]})
}

// saveTail keeps what a truncate to size would cut off.
func (f *FS) saveTail(fd int, id fileID, size int64) {
	st, err := f.inner.Fstat(fd)
	if err != nil {
		return
	}
	if st.Size > size {
		f.save(fd, id, size, st.Size-size)
		return
	}
	f.mu.Lock()
	f.logLocked(fd, id)
	f.mu.Unlock()
}

// revert puts back what the file held at its last successful sync.
func (f *FS) revert(fd int, id fileID) {
	f.mu.Lock()
	defer f.mu.Unlock()
	u := f.undo[id]
	if u == nil {
		return
	}
	delete(f.undo, id)
	for i := len(u.old) - 1; i >= 0; i-- {
		e := u.old[i]
		f.inner.Pwrite(fd, e.b, e.off)
	}
	f.inner.Ftruncate(fd, u.size)
}
