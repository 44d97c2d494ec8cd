package block

import (
	"errors"
	"fmt"
	"os"
	"sync"

	"golang.org/x/sys/unix"
)

// Perm is a QEMU block permission. QEMU's file driver (block/file-posix.c)
// shows the permissions a process holds on an image file, and the ones it
// refuses to share, as open-file-description (OFD) read locks on single
// bytes of the file: byte 100+i while it holds permission bit i, byte
// 200+i while it does not let others hold it. ovis takes the same bytes,
// so that ovis and QEMU keep out of each other's images: a qemu-img or
// qemu-nbd on an image ovis writes fails, and the other way round.
//
// The bytes qemu-img and qemu-nbd 7.2 lock (read from /proc/locks):
//
//	qcow2 image, read-write    100 101 103, 201 203
//	qcow2 image, read-only     100, 201 203
//	qcow2 image, -U            100
//	qcow2 external data file   100 101 103, 203 (read-only: 100, 203)
//	raw image                  100 101 (read-only: 100)
//	backing file               as its format, read-only
type Perm uint8

// QEMU's permission bits (include/block/block-common.h).
const (
	PermConsistentRead Perm = 1 << iota
	PermWrite
	PermWriteUnchanged
	PermResize

	permBits = 4
)

// Modifiers of a lock, passed in perm with the permissions; not QEMU
// permissions themselves.
const (
	// LockReopen marks a holder that stands for a node this process has
	// open already (QEMU reopens the node, say read-write for commit): it
	// is not checked against the holders in this process.
	LockReopen Perm = 1 << 6
	// LockYield marks a holder that keeps other processes out of a file
	// this process is about to open for real (an image being created):
	// holders taken later in this process are not checked against it.
	LockYield Perm = 1 << 7

	permMask = 1<<permBits - 1
)

// The lock bytes: lockPermBase+i while holding bit i, lockSharedBase+i
// while refusing to share it.
const (
	lockPermBase   = 100
	lockSharedBase = 200
)

// permNames are QEMU's names of the bits, as its lock errors print them.
var permNames = [permBits]string{"consistent read", "write", "write unchanged", "resize"}

func (p Perm) String() string {
	for i := range permBits {
		if p == 1<<i {
			return permNames[i]
		}
	}
	return fmt.Sprintf("perm(%#x)", uint8(p))
}

// LockError reports an image file another process uses in a way that
// conflicts: it holds Perm, which this open would not share (Shared is
// false), or it refuses to share Perm, which this open needs (Shared is
// true). Its text is QEMU's, hint included.
type LockError struct {
	Path   string
	Perm   Perm
	Shared bool
	// Err is set when a lock operation itself failed (not a conflict).
	Err error
}

func (e *LockError) Error() string {
	kind := ""
	if e.Shared {
		kind = "shared "
	}
	msg := fmt.Sprintf("Failed to get %s\"%s\" lock", kind, e.Perm)
	if e.Err != nil {
		msg += ": " + e.Err.Error()
	}
	return msg + "\nIs another process using the image [" + e.Path + "]?"
}

func (e *LockError) Unwrap() error { return e.Err }

// ImageLocker is a File that can take QEMU's image locks. Files without
// it (test layers) are not locked.
type ImageLocker interface {
	// LockImage takes the lock bytes of perm and of unshared (the
	// permissions this holder refuses to share) for as long as the file
	// is open, or fails with a *LockError naming path when another
	// process conflicts. It may be called once.
	LockImage(path string, perm, unshared Perm) error
}

// LockFile locks f as ImageLocker.LockImage does if f is an ImageLocker.
func LockFile(f File, path string, perm, unshared Perm) error {
	if l, ok := f.(ImageLocker); ok {
		return l.LockImage(path, perm, unshared)
	}
	return nil
}

// OFD locks belong to an open file description, and those of two
// descriptions conflict even within one process. Every holder in the
// process locks through one description per file (a duplicate of the
// first holder's descriptor, which counts the holders of each byte), so
// that the bytes other processes see are those of all holders here. QEMU
// opens a file once per node, and its nodes conflict with each other as
// separate processes do: a write open of a file another node holds
// without sharing writes fails with the same lock error. So each holder's
// permissions are also checked against the other holders in this
// process, except for a reopen of a node (LockReopen) and a stand-in for
// a node about to open (LockYield).
//
// Locking: lockTable.mu is a leaf, held across the fcntl calls (which do
// not block: F_OFD_SETLK and F_OFD_GETLK never wait).
var lockTable struct {
	mu    sync.Mutex
	files map[fileID]*lockedFile
}

type fileID struct{ dev, ino uint64 }

type lockedFile struct {
	fd       int
	holders  map[*imageLock]struct{}
	perm     [permBits]int // holders of each permission
	unshared [permBits]int // holders refusing to share each permission
}

// imageLock is one holder's permissions; the zero value holds nothing.
type imageLock struct {
	id       fileID
	held     bool
	perm     Perm
	unshared Perm
	yield    bool
}

// inProcess returns what the holders of lf in this process, but for
// yielding ones, hold and refuse to share.
func (lf *lockedFile) inProcess() (perm, unshared Perm) {
	for h := range lf.holders {
		if !h.yield {
			perm |= h.perm
			unshared |= h.unshared
		}
	}
	return perm, unshared
}

// lock takes perm and unshared on the file open as f. On a file system
// without OFD locks it takes nothing and succeeds, as QEMU's
// locking=auto does.
func (l *imageLock) lock(f *os.File, path string, perm, unshared Perm) error {
	if l.held {
		return errors.New("block: image already locked")
	}
	reopen, yield := perm&LockReopen != 0, perm&LockYield != 0
	perm &= permMask
	unshared &= permMask
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return &LockError{Path: path, Perm: PermConsistentRead, Err: err}
	}
	id := fileID{dev: st.Dev, ino: st.Ino}

	lockTable.mu.Lock()
	defer lockTable.mu.Unlock()
	lf := lockTable.files[id]
	if lf == nil {
		fd, err := unix.FcntlInt(f.Fd(), unix.F_DUPFD_CLOEXEC, 0)
		if err != nil {
			return &LockError{Path: path, Perm: PermConsistentRead, Err: err}
		}
		lf = &lockedFile{fd: fd, holders: make(map[*imageLock]struct{})}
	}
	var herePerm, hereUnshared Perm
	if !reopen {
		herePerm, hereUnshared = lf.inProcess()
	}
	// As QEMU: take the bytes first, then test for others' conflicting
	// ones, so that of two processes racing at least one sees the other.
	var took []int64
	undo := func() {
		for _, off := range took {
			setLock(lf.fd, off, unix.F_UNLCK)
		}
		if len(lf.holders) == 0 {
			unix.Close(lf.fd)
		}
	}
	for i := range permBits {
		for _, b := range []struct {
			want  bool
			count int
			off   int64
		}{
			{perm&(1<<i) != 0, lf.perm[i], lockPermBase + int64(i)},
			{unshared&(1<<i) != 0, lf.unshared[i], lockSharedBase + int64(i)},
		} {
			if !b.want || b.count > 0 {
				continue
			}
			if err := setLock(lf.fd, b.off, unix.F_RDLCK); err != nil {
				undo()
				if noOFDLocks(err) {
					return nil
				}
				return &LockError{Path: path, Perm: 1 << i, Shared: b.off >= lockSharedBase, Err: err}
			}
			took = append(took, b.off)
		}
	}
	// Another holder refusing to share what we take, then another
	// holding what we refuse to share: QEMU's order and messages.
	for i := range permBits {
		p := Perm(1) << i
		if perm&p == 0 {
			continue
		}
		busy, err := lockedElsewhere(lf.fd, lockSharedBase+int64(i))
		if busy || err != nil || hereUnshared&p != 0 {
			undo()
			return &LockError{Path: path, Perm: p, Err: err}
		}
	}
	for i := range permBits {
		p := Perm(1) << i
		if unshared&p == 0 {
			continue
		}
		busy, err := lockedElsewhere(lf.fd, lockPermBase+int64(i))
		if busy || err != nil || herePerm&p != 0 {
			undo()
			return &LockError{Path: path, Perm: p, Shared: true, Err: err}
		}
	}
	for i := range permBits {
		if perm&(1<<i) != 0 {
			lf.perm[i]++
		}
		if unshared&(1<<i) != 0 {
			lf.unshared[i]++
		}
	}
	*l = imageLock{id: id, held: true, perm: perm, unshared: unshared, yield: yield}
	lf.holders[l] = struct{}{}
	if lockTable.files == nil {
		lockTable.files = make(map[fileID]*lockedFile)
	}
	lockTable.files[id] = lf
	return nil
}

// release drops the holder's permissions; the last holder of a file
// closes its locking descriptor, which drops any bytes left.
func (l *imageLock) release() {
	if !l.held {
		return
	}
	l.held = false
	lockTable.mu.Lock()
	defer lockTable.mu.Unlock()
	lf := lockTable.files[l.id]
	if lf == nil {
		return
	}
	for i := range permBits {
		if l.perm&(1<<i) != 0 {
			if lf.perm[i]--; lf.perm[i] == 0 {
				setLock(lf.fd, lockPermBase+int64(i), unix.F_UNLCK)
			}
		}
		if l.unshared&(1<<i) != 0 {
			if lf.unshared[i]--; lf.unshared[i] == 0 {
				setLock(lf.fd, lockSharedBase+int64(i), unix.F_UNLCK)
			}
		}
	}
	if delete(lf.holders, l); len(lf.holders) == 0 {
		unix.Close(lf.fd)
		delete(lockTable.files, l.id)
	}
}

func setLock(fd int, off int64, typ int16) error {
	lk := unix.Flock_t{Type: typ, Whence: 0, Start: off, Len: 1}
	for {
		err := unix.FcntlFlock(uintptr(fd), unix.F_OFD_SETLK, &lk)
		if err != unix.EINTR {
			return err
		}
	}
}

// lockedElsewhere reports whether another open file description holds a
// lock on byte off: a write lock there would conflict (QEMU's
// qemu_lock_fd_test with exclusive set).
func lockedElsewhere(fd int, off int64) (bool, error) {
	lk := unix.Flock_t{Type: unix.F_WRLCK, Whence: 0, Start: off, Len: 1}
	if err := unix.FcntlFlock(uintptr(fd), unix.F_OFD_GETLK, &lk); err != nil {
		return false, err
	}
	return lk.Type != unix.F_UNLCK, nil
}

// noOFDLocks reports errors of a file system that has no OFD locks.
func noOFDLocks(err error) bool {
	return errors.Is(err, unix.EINVAL) || errors.Is(err, unix.EOPNOTSUPP) || errors.Is(err, unix.ENOLCK)
}
