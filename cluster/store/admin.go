package store

import (
	"errors"
	"fmt"
	"hash/crc32"
	"os"
	"path/filepath"
	"slices"
	"strconv"

	"golang.org/x/sys/unix"

	"github.com/ovis-storage/ovis/cluster/object"
	"github.com/ovis-storage/ovis/cluster/store/vfs"
)

// takeExcl waits until no call uses o and makes the caller its only
// user; release with dropExcl.
func (s *Store) takeExcl(o *obj) {
	o.mu.Lock()
	defer o.mu.Unlock()
	for {
		s.loadLocked(o)
		if o.excl || o.prepping {
			o.cond.Wait()
			continue
		}
		break
	}
	o.excl = true
	for o.users > 0 || o.hdrBusy {
		o.cond.Wait()
	}
}

func (s *Store) dropExcl(o *obj) {
	o.mu.Lock()
	o.excl = false
	o.cond.Broadcast()
	o.mu.Unlock()
}

// forget clears o's journal record, if any, and removes it from its
// VDI's journaled set. The caller holds excl. It returns the journal
// batch to wait for, 0 if none.
func (s *Store) forgetLocked(o *obj) uint64 {
	if !o.journaled {
		return 0
	}
	o.journaled = false
	return s.j.enqueue(record{key: uint64(o.id), op: recClean})
}

func (s *Store) forgetWait(o *obj, seq uint64) error {
	o.v.mu.Lock()
	delete(o.v.journaled, o.id)
	o.v.mu.Unlock()
	if seq == 0 {
		return nil
	}
	if err := s.j.wait(seq); err != nil {
		return fmt.Errorf("store: object %s: %w", o.id, err)
	}
	return nil
}

// Remove makes object id a tombstone, durably: a header-only file that
// says "removed" at the object's next version, written aside, synced
// and renamed over the copy like Put's, so that a crash leaves the old
// copy or the tombstone. A tombstone reads as a missing object, and a
// later write recreates the object with a version above the tombstone's,
// so that recovery can tell the delete from a stale copy on a node that
// missed it (see Forget for their end). Removing an object that does not
// exist leaves a tombstone too; removing a suspect copy clears its
// suspicion. It returns ErrStaleToken, ErrRange (also for st.Epoch
// above MaxEpoch).
func (s *Store) Remove(id object.ID, st Stamp) error {
	if err := checkRange(id, 0, 0); err != nil {
		return err
	}
	if err := checkEpoch(fmt.Sprintf("object %s: remove", id), st); err != nil {
		return err
	}
	if err := s.enterWrite(); err != nil {
		return err
	}
	defer s.ops.Done()
	o := s.obj(id)
	defer s.release(o)
	if err := s.admit(o.v, st.Token); err != nil {
		return err
	}
	defer o.v.done(st.Token)
	if err := s.ensureVDIDir(o.v); err != nil {
		return err
	}
	s.takeExcl(o)
	defer s.dropExcl(o)
	o.mu.Lock()
	ver := nextVersion(o.version, st.Epoch)
	o.mu.Unlock()
	return s.install(o, "remove", ver, nil, true)
}

// Put replaces object id with data at version, atomically and durably
// (a file written and synced aside, renamed over the old one, directory
// synced), and clears its suspicion, but only when this node's copy is
// missing, suspect, or older than version (live or a tombstone);
// otherwise it returns ErrNotNewer and changes nothing. The check and
// the replacement hold the object against every other call, so a write
// racing with Put is ordered before or after it. It is recovery's call:
// it carries no token and is not fenced. Trailing zeros of data are not
// stored, and 4 KiB blocks of zeros are left as holes.
func (s *Store) Put(id object.ID, version uint64, data []byte) error {
	return s.put(id, "put", version, data, false, true)
}

// PutTombstone makes this node's copy of id a tombstone at version, as
// a Remove would have, on the same condition as Put (ErrNotNewer
// otherwise): recovery propagating a delete to a node that missed it.
func (s *Store) PutTombstone(id object.ID, version uint64) error {
	return s.put(id, "put tombstone", version, nil, true, true)
}

// Replace is Put without the condition: it replaces whatever copy this
// node holds, even one with a higher version. It is for check --repair,
// which makes copies of equal versions but different bytes identical,
// and for recovery replacing a copy of a lower rank (a cut-off writer's).
func (s *Store) Replace(id object.ID, version uint64, data []byte) error {
	return s.put(id, "replace", version, data, false, false)
}

// ReplaceTombstone is PutTombstone without the condition: recovery
// replacing a copy of a lower rank (a cut-off writer's, whose version
// may be higher) with the removal the other nodes hold.
func (s *Store) ReplaceTombstone(id object.ID, version uint64) error {
	return s.put(id, "replace tombstone", version, nil, true, false)
}

func (s *Store) put(id object.ID, what string, version uint64, data []byte, tomb, cond bool) error {
	if err := checkRange(id, 0, int64(len(data))); err != nil {
		return err
	}
	if len(data) > MaxObjectSize {
		return fmt.Errorf("store: object %s: %s of %d bytes: %w", id, what, len(data), ErrRange)
	}
	if err := s.enterWrite(); err != nil {
		return err
	}
	defer s.ops.Done()
	o := s.obj(id)
	defer s.release(o)
	if err := s.ensureVDIDir(o.v); err != nil {
		return err
	}
	s.takeExcl(o)
	defer s.dropExcl(o)
	if cond {
		o.mu.Lock()
		older := o.suspect || !o.exists || o.version < version
		held, heldTomb := o.version, o.tomb
		o.mu.Unlock()
		if !older {
			kind := "copy"
			if heldTomb {
				kind = "tombstone"
			}
			return fmt.Errorf("store: object %s: %s at version %#x: this node holds a %s at %#x: %w", id, what, version, kind, held, ErrNotNewer)
		}
	}
	return s.install(o, what, version, data, tomb)
}

// install writes o's new copy (or tombstone) aside, syncs it, renames it
// over o's file, syncs the directory and clears o's journal record. The
// caller holds excl.
func (s *Store) install(o *obj, what string, version uint64, data []byte, tomb bool) error {
	id := o.id
	tmp := filepath.Join(s.tmpDir, id.String())
	if err := writeObject(s.fs, tmp, id, version, data, tomb); err != nil {
		s.fs.Remove(tmp)
		return fmt.Errorf("store: object %s: %s: %w", id, what, noSpace(err))
	}
	s.fds.drop(id)
	if err := s.fs.Rename(tmp, o.path); err != nil {
		s.fs.Remove(tmp)
		return fmt.Errorf("store: object %s: %s: %w", id, what, err)
	}
	if err := syncDir(s.fs, s.vdiDir(o.v.id)); err != nil {
		return s.failed(o, fmt.Errorf("store: object %s: %s: %w", id, what, err))
	}
	o.mu.Lock()
	o.exists, o.tomb, o.version, o.suspect = true, tomb, version, false
	o.hdrDone, o.hdrTomb = version, tomb
	o.syncedGen, o.createGen = o.dirtyGen, 0 // gens only rise: a Flush may hold an old one
	o.resetSyncLocked()
	seq := s.forgetLocked(o)
	o.mu.Unlock()
	return s.forgetWait(o, seq)
}

// Forget deletes the tombstone of id when its version is at most
// version: recovery calls it once every node has seen the delete, so
// that tombstones do not last for good. It does nothing (and returns
// nil) when the copy is missing, live, suspect, or a newer tombstone.
// The unlink is not synced: a crash may bring the tombstone back, which
// is harmless, and a later Forget deletes it again.
func (s *Store) Forget(id object.ID, version uint64) error {
	return s.unlink(id, "forget", false, func(o *obj) bool {
		return o.exists && o.tomb && !o.suspect && o.version <= version
	})
}

// Drop deletes this node's copy of id outright, leaving no tombstone:
// recovery calls it for a copy the node no longer holds, once the new
// holders have it. It deletes a live copy or a tombstone whose version is
// at most version, and any suspect copy (its version says nothing); it
// does nothing (nil) for a newer copy, whose write raced the decision,
// or for none. The directory is synced before the journal forgets the
// copy, so that a crash never brings back as good a copy it had marked.
func (s *Store) Drop(id object.ID, version uint64) error {
	return s.unlink(id, "drop", true, func(o *obj) bool {
		return o.suspect || (o.exists && o.version <= version)
	})
}

// unlink deletes id's file, with no tombstone, when want (called under
// o.mu) says so, while it holds the object exclusively; with syncVDI the
// VDI directory is synced before the journal forgets the copy. Forget
// and Drop are it with their conditions.
func (s *Store) unlink(id object.ID, what string, syncVDI bool, want func(o *obj) bool) error {
	if err := checkRange(id, 0, 0); err != nil {
		return err
	}
	if err := s.enterWrite(); err != nil {
		return err
	}
	defer s.ops.Done()
	o := s.obj(id)
	defer s.release(o)
	s.takeExcl(o)
	defer s.dropExcl(o)
	o.mu.Lock()
	ok := want(o)
	o.mu.Unlock()
	if !ok {
		return nil
	}
	s.fds.drop(id)
	if err := s.fs.Remove(o.path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("store: object %s: %s: %w", id, what, err)
	}
	if syncVDI {
		if _, err := s.fs.Stat(s.vdiDir(o.v.id)); err == nil {
			if err := syncDir(s.fs, s.vdiDir(o.v.id)); err != nil {
				return s.failed(o, fmt.Errorf("store: object %s: %s: %w", id, what, err))
			}
		}
	}
	o.mu.Lock()
	o.exists, o.tomb, o.version, o.suspect = false, false, 0, false
	o.hdrDone, o.hdrTomb = 0, false
	o.syncedGen, o.createGen = o.dirtyGen, 0
	o.resetSyncLocked()
	seq := s.forgetLocked(o)
	o.mu.Unlock()
	return s.forgetWait(o, seq)
}

func writeObject(fs vfs.FS, path string, id object.ID, version uint64, data []byte, removed bool) error {
	fd, err := fs.Open(path, unix.O_WRONLY|unix.O_CREAT|unix.O_TRUNC|unix.O_CLOEXEC, 0o644)
	if err != nil {
		return err
	}
	defer fs.Close(fd)
	var h [headerLen]byte
	header{id: id, version: version, removed: removed}.encode(h[:])
	if _, err := fs.Pwrite(fd, h[:], 0); err != nil {
		return err
	}
	n := trimZeros(data)
	const blk = 4096
	for off := 0; off < n; off += blk {
		b := data[off:min(off+blk, n)]
		if allZero(b) {
			continue
		}
		for done := 0; done < len(b); {
			k, err := fs.Pwrite(fd, b[done:], HeaderSize+int64(off+done))
			if err != nil {
				return err
			}
			done += k
		}
	}
	if err := fs.Ftruncate(fd, HeaderSize+int64(n)); err != nil {
		return err
	}
	return fs.Fdatasync(fd)
}

func trimZeros(b []byte) int {
	n := len(b)
	for n > 0 && b[n-1] == 0 {
		n--
	}
	return n
}

func allZero(b []byte) bool {
	for _, c := range b {
		if c != 0 {
			return false
		}
	}
	return true
}

// ClearSuspect declares this node's copy of id good (recovery found it
// equal to its peers'): it is synced and served again. A copy whose
// fdatasync failed is written anew instead, as Put would: its pages may
// say what the disk no longer holds, and syncing them again proves
// nothing.
func (s *Store) ClearSuspect(id object.ID) error {
	if err := s.enterWrite(); err != nil {
		return err
	}
	defer s.ops.Done()
	o := s.obj(id)
	defer s.release(o)
	s.takeExcl(o)
	defer s.dropExcl(o)
	o.mu.Lock()
	exists, rewrite, ver, tomb := o.exists, o.syncFailed, o.version, o.tomb
	o.mu.Unlock()
	if exists && rewrite {
		data, err := s.readCopy(o)
		if err != nil {
			return fmt.Errorf("store: object %s: clear suspect: %w", id, err)
		}
		return s.install(o, "clear suspect", ver, data, tomb)
	}
	if exists {
		fd, err := s.fds.get(id, o.path, false)
		if err != nil {
			return fmt.Errorf("store: object %s: %w", id, err)
		}
		o.mu.Lock()
		a := &access{o: o, fd: fd, version: o.version}
		o.mu.Unlock()
		err = s.writeHeader(a)
		if err == nil {
			err = s.syncData(o, fd.fd)
		}
		s.fds.put(fd)
		if err != nil {
			return fmt.Errorf("store: object %s: %w", id, err)
		}
		o.mu.Lock()
		o.syncedGen = o.dirtyGen
		o.mu.Unlock()
	}
	o.mu.Lock()
	created := o.createGen
	o.mu.Unlock()
	if err := s.syncVDIDir(o.v, created); err != nil {
		return err
	}
	o.mu.Lock()
	o.suspect = false
	seq := s.forgetLocked(o)
	o.mu.Unlock()
	return s.forgetWait(o, seq)
}

// readCopy returns the bytes of o's copy, as the page cache holds them.
// The caller holds excl.
func (s *Store) readCopy(o *obj) ([]byte, error) {
	fd, err := s.fds.get(o.id, o.path, false)
	if err != nil {
		return nil, err
	}
	defer s.fds.put(fd)
	st, err := s.fs.Fstat(fd.fd)
	if err != nil {
		return nil, fmt.Errorf("fstat: %w", err)
	}
	data := make([]byte, min(max(st.Size-HeaderSize, 0), MaxObjectSize))
	for done := 0; done < len(data); {
		n, err := s.fs.Pread(fd.fd, data[done:], HeaderSize+int64(done))
		if err != nil {
			return nil, fmt.Errorf("read at %d: %w", done, err)
		}
		if n == 0 {
			break
		}
		done += n
	}
	return data, nil
}

// Checksum returns the CRC32C of object id's content with its trailing
// zeros trimmed, so that equal content gives equal checksums whatever
// the holes, and the object's version. It returns ErrNotFound for a
// missing object or a tombstone, ErrSuspect for a suspect copy.
func (s *Store) Checksum(id object.ID) (crc uint32, version uint64, err error) {
	if err := s.enter(); err != nil {
		return 0, 0, err
	}
	defer s.ops.Done()
	o := s.obj(id)
	defer s.release(o)
	a, err := s.begin(o, forRead, 0)
	if err != nil {
		return 0, 0, err
	}
	defer s.end(a)
	buf := make([]byte, 1<<20)
	var zeros int64 // zeros seen but not yet fed: they may be trailing
	for off := int64(HeaderSize); ; {
		o.data.RLock()
		n, err := s.fs.Pread(a.fd.fd, buf, off)
		o.data.RUnlock()
		if err != nil {
			return 0, 0, fmt.Errorf("store: object %s: checksum: read at %d: %w", id, off-HeaderSize, err)
		}
		if n == 0 {
			break
		}
		b := buf[:n]
		off += int64(n)
		k := trimZeros(b)
		if k == 0 {
			zeros += int64(n)
			continue
		}
		for zeros > 0 {
			z := min(zeros, int64(len(zeroBuf)))
			crc = crc32.Update(crc, castagnoli, zeroBuf[:z])
			zeros -= z
		}
		crc = crc32.Update(crc, castagnoli, b[:k])
		zeros = int64(n - k)
	}
	return crc, a.version, nil
}

// Info describes one object copy.
type Info struct {
	ID      object.ID
	Version uint64
	// Allocated is the bytes the file takes on disk, header included.
	Allocated int64
	// Suspect says the copy needs repair; a suspect object may have no
	// file (its creation was lost in a crash).
	Suspect bool
	// Tombstone says the object was removed at Version: it reads as
	// missing, and recovery must not bring an older copy back.
	Tombstone bool
}

// Stat describes object id. It returns ErrNotFound when the object
// neither exists (as data or a tombstone) nor is a suspect copy.
func (s *Store) Stat(id object.ID) (Info, error) {
	if err := s.enter(); err != nil {
		return Info{}, err
	}
	defer s.ops.Done()
	o := s.obj(id)
	defer s.release(o)
	o.mu.Lock()
	s.loadLocked(o)
	info := Info{ID: id, Version: o.version, Suspect: o.suspect, Tombstone: o.exists && o.tomb}
	exists := o.exists
	o.mu.Unlock()
	if !exists && !info.Suspect {
		return Info{}, fmt.Errorf("store: object %s: %w", id, ErrNotFound)
	}
	if st, err := s.fs.Stat(o.path); err == nil {
		info.Allocated = st.Blocks * 512
	}
	return info, nil
}

// List describes every object of vdi (0: of every VDI), tombstones and
// suspect copies included, sorted by ID.
func (s *Store) List(vdi object.VDI) ([]Info, error) {
	if err := s.enter(); err != nil {
		return nil, err
	}
	ids, err := s.listIDs(vdi)
	s.ops.Done()
	if err != nil {
		return nil, err
	}
	out := make([]Info, 0, len(ids))
	for _, id := range ids {
		info, err := s.Stat(id)
		if errors.Is(err, ErrNotFound) {
			continue // removed meanwhile
		}
		if err != nil {
			return nil, err
		}
		out = append(out, info)
	}
	return out, nil
}

func (s *Store) listIDs(vdi object.VDI) ([]object.ID, error) {
	var vdis []object.VDI
	if vdi != 0 {
		vdis = []object.VDI{vdi}
	} else {
		names, err := s.fs.ReadDir(s.objDir)
		if err != nil {
			return nil, fmt.Errorf("store: list: %w", err)
		}
		for _, name := range names {
			if v, err := strconv.ParseUint(name, 16, 32); err == nil && len(name) == 8 {
				vdis = append(vdis, object.VDI(v))
			}
		}
	}
	seen := map[object.ID]bool{}
	var ids []object.ID
	for _, v := range vdis {
		names, err := s.fs.ReadDir(s.vdiDir(v))
		if errors.Is(err, os.ErrNotExist) {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("store: list vdi %08x: %w", uint32(v), err)
		}
		for _, name := range names {
			if x, err := strconv.ParseUint(name, 16, 32); err == nil && len(name) == 8 {
				id := object.Make(v, uint32(x))
				seen[id] = true
				ids = append(ids, id)
			}
		}
	}
	// Suspect copies whose file a crash lost.
	s.j.mu.Lock()
	for id, op := range s.j.live.objs {
		if op == recSuspect && !seen[id] && (vdi == 0 || id.VDI() == vdi) {
			ids = append(ids, id)
		}
	}
	s.j.mu.Unlock()
	slices.Sort(ids)
	return ids, nil
}

// Usage is a store's space account.
type Usage struct {
	Objects    int   // copies with data, suspect ones included
	Tombstones int   // removed objects not yet forgotten
	Allocated  int64 // bytes the files of Objects take
	Free       int64 // bytes free on the file system for the store
	Reserve    int64 // Options.Reserve
}

// Usage counts the objects and the space they take.
func (s *Store) Usage() (Usage, error) {
	infos, err := s.List(0)
	if err != nil {
		return Usage{}, err
	}
	u := Usage{Reserve: s.opts.Reserve}
	for _, in := range infos {
		if in.Tombstone {
			u.Tombstones++
			continue
		}
		u.Objects++
		u.Allocated += in.Allocated
	}
	st, err := s.fs.Statfs(s.objDir)
	if err != nil {
		return Usage{}, fmt.Errorf("store: statfs: %w", err)
	}
	u.Free = int64(st.Bavail) * int64(st.Bsize)
	return u, nil
}

// RemoveVDI deletes every object of vdi, durably: the VDI's directory is
// renamed into dir/tmp in one step (and both directories synced), then
// deleted. Suspect copies and tombstones of the VDI go too (a deleted
// VDI's tombstone is kept in etcd, not here). Calls racing with it on the
// VDI's objects may fail; the caller stops writing a VDI before it
// deletes it. It returns ErrStaleToken.
func (s *Store) RemoveVDI(vdi object.VDI, token uint64) error {
	if vdi == 0 {
		return fmt.Errorf("store: remove vdi: vdi 0 is no VDI: %w", ErrRange)
	}
	if err := s.enterWrite(); err != nil {
		return err
	}
	defer s.ops.Done()
	v := s.vdi(vdi)
	if err := s.admit(v, token); err != nil {
		return err
	}
	defer v.done(token)
	ids, err := s.listIDs(vdi)
	if err != nil {
		return err
	}
	objs := make([]*obj, 0, len(ids))
	for _, id := range ids {
		o := s.obj(id)
		s.takeExcl(o)
		objs = append(objs, o)
	}
	defer func() {
		for _, o := range objs {
			s.dropExcl(o)
			s.release(o)
		}
	}()
	for _, o := range objs {
		s.fds.drop(o.id)
	}
	gone := filepath.Join(s.tmpDir, fmt.Sprintf("vdi-%08x", uint32(vdi)))
	err = s.fs.Rename(s.vdiDir(vdi), gone)
	switch {
	case errors.Is(err, os.ErrNotExist):
	case err != nil:
		return fmt.Errorf("store: remove vdi %08x: %w", uint32(vdi), err)
	default:
		if err := syncDir(s.fs, s.objDir); err != nil {
			return fmt.Errorf("store: remove vdi %08x: %w", uint32(vdi), err)
		}
		if err := syncDir(s.fs, s.tmpDir); err != nil {
			return fmt.Errorf("store: remove vdi %08x: %w", uint32(vdi), err)
		}
	}
	v.mu.Lock()
	v.dirMade = false
	v.mu.Unlock()
	var seq uint64
	for _, o := range objs {
		o.mu.Lock()
		o.exists, o.tomb, o.version, o.hdrDone, o.hdrTomb, o.suspect = false, false, 0, 0, false, false
		o.syncedGen, o.createGen = o.dirtyGen, 0
		o.resetSyncLocked()
		if q := s.forgetLocked(o); q > 0 {
			seq = q
		}
		o.mu.Unlock()
		o.v.mu.Lock()
		delete(o.v.journaled, o.id)
		o.v.mu.Unlock()
	}
	if seq > 0 {
		if err := s.j.wait(seq); err != nil {
			return fmt.Errorf("store: remove vdi %08x: %w", uint32(vdi), err)
		}
	}
	if err := s.fs.RemoveAll(gone); err != nil {
		s.log.Warn("store: removed vdi left files", "vdi", uint32(vdi), "err", err) // Open removes them
	}
	return nil
}
