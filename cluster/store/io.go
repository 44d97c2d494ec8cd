package store

import (
	"errors"
	"fmt"

	"golang.org/x/sys/unix"

	"github.com/ovis-storage/ovis/cluster/object"
)

// testHookAdmitted, when set by a test, runs after a mutating call's
// token was admitted and before its I/O.
var testHookAdmitted func(object.ID)

func checkRange(id object.ID, off, n int64) error {
	if id.VDI() == 0 {
		return fmt.Errorf("store: object %s: vdi 0 is no VDI: %w", id, ErrRange)
	}
	if off < 0 || n < 0 || off > MaxObjectSize || n > MaxObjectSize-off {
		return fmt.Errorf("store: object %s: range %d+%d: %w", id, off, n, ErrRange)
	}
	return nil
}

// ReadAt reads len(p) bytes of object id at off into p and returns the
// object's version. Bytes never written read as zeros. It returns
// ErrNotFound when the object does not exist or is a tombstone,
// ErrSuspect when this copy needs repair, ErrRange when the range lies
// outside MaxObjectSize.
func (s *Store) ReadAt(id object.ID, p []byte, off int64) (version uint64, err error) {
	return s.read(id, p, off, forRead)
}

// ReadSuspect reads like ReadAt, but also from a suspect copy: it is
// recovery's last resort when every copy of an object may be torn (after
// a power loss of the whole cluster), to pick one and make all the same.
// The version returned is the one in the copy's header, which may be
// older than its bytes (a write not yet flushed changes the bytes before
// the header), and 0 when the header is unreadable. A tombstone, suspect
// or not, gives ErrNotFound with its version. It returns ErrNotFound for
// a copy with no file, ErrRange as ReadAt.
func (s *Store) ReadSuspect(id object.ID, p []byte, off int64) (version uint64, err error) {
	return s.read(id, p, off, forReadSuspect)
}

func (s *Store) read(id object.ID, p []byte, off int64, mode beginMode) (version uint64, err error) {
	if err := checkRange(id, off, int64(len(p))); err != nil {
		return 0, err
	}
	if err := s.enter(); err != nil {
		return 0, err
	}
	defer s.ops.Done()
	o := s.obj(id)
	defer s.release(o)
	a, err := s.begin(o, mode, 0)
	if err != nil {
		if mode == forReadSuspect && errors.Is(err, ErrNotFound) {
			o.mu.Lock()
			if o.tomb {
				version = o.version
			}
			o.mu.Unlock()
		}
		return version, err
	}
	defer s.end(a)
	o.data.RLock()
	defer o.data.RUnlock()
	for done := 0; done < len(p); {
		n, err := s.fs.Pread(a.fd.fd, p[done:], HeaderSize+off+int64(done))
		if err != nil {
			return 0, fmt.Errorf("store: object %s: read at %d: %w", id, off+int64(done), err)
		}
		if n == 0 { // past the end of the file: zeros
			clear(p[done:])
			break
		}
		done += n
	}
	return a.version, nil
}

// mutation is the common frame of every mutating call: range check,
// token, journal and version, then op does the I/O on the file, then the
// header and, when sync, fdatasync (and the directory, for a new file).
func (s *Store) mutate(id object.ID, st Stamp, off, n int64, sync, allocates bool, op func(fd int) error) (uint64, error) {
	if err := checkRange(id, off, n); err != nil {
		return 0, err
	}
	if err := checkEpoch(fmt.Sprintf("object %s", id), st); err != nil {
		return 0, err
	}
	if err := s.enterWrite(); err != nil {
		return 0, err
	}
	defer s.ops.Done()
	o := s.obj(id)
	defer s.release(o)
	if err := s.admit(o.v, st.Token); err != nil {
		return 0, err
	}
	defer o.v.done(st.Token)
	if testHookAdmitted != nil {
		testHookAdmitted(id)
	}
	if allocates {
		if err := s.checkSpace(n); err != nil {
			return 0, fmt.Errorf("store: object %s: %w", id, err)
		}
	}
	a, err := s.begin(o, forWrite, st.Epoch)
	if err != nil {
		return 0, err
	}
	defer s.end(a)
	o.data.Lock()
	err = op(a.fd.fd)
	o.data.Unlock()
	if err != nil {
		return 0, s.failed(o, fmt.Errorf("store: object %s: at %d+%d: %w", id, off, n, noSpace(err)))
	}
	if !sync {
		// The header waits for the Flush that makes this durable: until
		// then the object is journaled, and suspect after a crash.
		o.mu.Lock()
		o.dirtyGen++
		o.mu.Unlock()
		return a.version, nil
	}
	if err := s.writeHeader(a); err != nil {
		return 0, s.failed(o, err)
	}
	if err := s.syncObject(a); err != nil {
		return 0, s.failed(o, err)
	}
	return a.version, nil
}

// syncObject makes everything written to the object so far durable: its
// data, header and directory entry.
func (s *Store) syncObject(a *access) error {
	o := a.o
	o.mu.Lock()
	gen, created := o.dirtyGen, o.createGen
	o.mu.Unlock()
	if err := s.syncData(o, a.fd.fd); err != nil {
		return fmt.Errorf("store: object %s: %w", o.id, err)
	}
	if err := s.syncVDIDir(o.v, created); err != nil {
		return err
	}
	o.mu.Lock()
	if gen > o.syncedGen {
		o.syncedGen = gen
	}
	o.mu.Unlock()
	return nil
}

// checkSpace refuses an allocation of n bytes that would leave less than
// the reserve free.
// CheckSpace returns an error wrapping ErrNoSpace when n more bytes
// would leave less than Options.Reserve free: for recovery, which must
// not fill a disk past its reserve with copies it pulls.
func (s *Store) CheckSpace(n int64) error { return s.checkSpace(n) }

// Space returns the bytes free on the store's file system, as writes
// see them, and Options.Reserve.
func (s *Store) Space() (free, reserve int64, err error) {
	st, err := s.fs.Statfs(s.objDir)
	if err != nil {
		return 0, 0, fmt.Errorf("store: statfs: %w", err)
	}
	return int64(st.Bavail) * int64(st.Bsize), s.opts.Reserve, nil
}

func (s *Store) checkSpace(n int64) error {
	st, err := s.fs.Statfs(s.objDir)
	if err != nil {
		return fmt.Errorf("statfs: %w", err)
	}
	free := int64(st.Bavail) * int64(st.Bsize)
	if free-n < s.opts.Reserve {
		return fmt.Errorf("%d bytes free, %d reserved, %d wanted: %w: %w", free, s.opts.Reserve, n, ErrNoSpace, unix.ENOSPC)
	}
	return nil
}

// WriteAt writes p to object id at off, creating the object on its
// first write (or recreating a tombstone), and returns its new version:
// max(old+1, Version(st.Epoch, 1)), see Version. With sync the data and
// the version are durable before it returns; without, they are in the
// page cache and the next Flush of the VDI makes them durable. It
// returns ErrStaleToken (st.Token), ErrRange (also for st.Epoch above
// MaxEpoch), ErrSuspect, ErrNoSpace.
func (s *Store) WriteAt(id object.ID, st Stamp, p []byte, off int64, sync bool) (version uint64, err error) {
	return s.mutate(id, st, off, int64(len(p)), sync, true, func(fd int) error {
		for done := 0; done < len(p); {
			n, err := s.fs.Pwrite(fd, p[done:], HeaderSize+off+int64(done))
			if err != nil {
				return fmt.Errorf("write: %w", err)
			}
			done += n
		}
		return nil
	})
}

// WriteZeroes makes n bytes of object id at off read as zeros, creating
// the object (as WriteAt), and returns its new version. Without allocate it may punch
// a hole; with allocate the range stays allocated (FALLOC_FL_ZERO_RANGE,
// or written zeros).
func (s *Store) WriteZeroes(id object.ID, st Stamp, off, n int64, allocate, sync bool) (uint64, error) {
	return s.mutate(id, st, off, n, sync, allocate, func(fd int) error {
		if n == 0 {
			return nil
		}
		if !allocate {
			return s.punch(fd, HeaderSize+off, n)
		}
		err := s.fs.Fallocate(fd, unix.FALLOC_FL_ZERO_RANGE, HeaderSize+off, n)
		if errors.Is(err, unix.EOPNOTSUPP) {
			return s.writeZeros(fd, HeaderSize+off, n)
		}
		if err != nil {
			return fmt.Errorf("zero range: %w", err)
		}
		return nil
	})
}

// Discard frees n bytes of object id at off; they then read as zeros.
// It returns the object's new version.
func (s *Store) Discard(id object.ID, st Stamp, off, n int64, sync bool) (uint64, error) {
	return s.WriteZeroes(id, st, off, n, false, sync)
}

// punch deallocates [off, off+n) of the file, clipped to its size, so
// that the file's size never grows.
func (s *Store) punch(fd int, off, n int64) error {
	st, err := s.fs.Fstat(fd)
	if err != nil {
		return fmt.Errorf("fstat: %w", err)
	}
	if off >= st.Size {
		return nil
	}
	n = min(n, st.Size-off)
	err = s.fs.Fallocate(fd, unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, off, n)
	if errors.Is(err, unix.EOPNOTSUPP) {
		return s.writeZeros(fd, off, n)
	}
	if err != nil {
		return fmt.Errorf("punch hole: %w", err)
	}
	return nil
}

var zeroBuf [1 << 16]byte

func (s *Store) writeZeros(fd int, off, n int64) error {
	for n > 0 {
		k, err := s.fs.Pwrite(fd, zeroBuf[:min(n, int64(len(zeroBuf)))], off)
		if err != nil {
			return fmt.Errorf("write zeros: %w", err)
		}
		off += int64(k)
		n -= int64(k)
	}
	return nil
}

// Extent is a run of an object: data, or a hole that reads as zeros.
// Data may also read as zeros (written zeros); a hole never holds data.
type Extent struct {
	Offset, Length int64
	Hole           bool
}

// Extents appends to dst the extents that tile [off, off+n) of object
// id, from SEEK_DATA and SEEK_HOLE, adjacent runs of one kind merged,
// and returns the extended slice. It returns ErrNotFound for an object
// that does not exist or is a tombstone, ErrSuspect for a suspect copy.
func (s *Store) Extents(id object.ID, off, n int64, dst []Extent) ([]Extent, error) {
	if err := checkRange(id, off, n); err != nil {
		return dst, err
	}
	if err := s.enter(); err != nil {
		return dst, err
	}
	defer s.ops.Done()
	o := s.obj(id)
	defer s.release(o)
	a, err := s.begin(o, forRead, 0)
	if err != nil {
		return dst, err
	}
	defer s.end(a)
	add := func(e Extent) {
		if e.Length == 0 {
			return
		}
		if k := len(dst) - 1; k >= 0 && dst[k].Hole == e.Hole && dst[k].Offset+dst[k].Length == e.Offset {
			dst[k].Length += e.Length
			return
		}
		dst = append(dst, e)
	}
	fd := a.fd.fd
	end := off + n
	for pos := off; pos < end; {
		d, err := s.fs.Seek(fd, HeaderSize+pos, unix.SEEK_DATA)
		if errors.Is(err, unix.ENXIO) { // no data after pos
			add(Extent{Offset: pos, Length: end - pos, Hole: true})
			break
		}
		if err != nil {
			return dst, fmt.Errorf("store: object %s: seek data at %d: %w", id, pos, err)
		}
		d -= HeaderSize
		if d > pos {
			h := min(d, end)
			add(Extent{Offset: pos, Length: h - pos, Hole: true})
			pos = h
			continue
		}
		h, err := s.fs.Seek(fd, HeaderSize+pos, unix.SEEK_HOLE)
		if err != nil {
			return dst, fmt.Errorf("store: object %s: seek hole at %d: %w", id, pos, err)
		}
		h = min(h-HeaderSize, end)
		add(Extent{Offset: pos, Length: h - pos})
		pos = h
	}
	return dst, nil
}
