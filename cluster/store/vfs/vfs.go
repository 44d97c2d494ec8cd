// Package vfs is the file system seam under cluster/store: the exact
// operations the store does, fd-based where the store is, so that a
// layer that records or fails them (vfs/errorfs) can sit beneath it.
//
// Default is the real file system: each method is one direct call to
// golang.org/x/sys/unix or os, with nothing added on the I/O path.
// Methods return the errors of those calls unchanged (unix.Errno, or
// *os.PathError for the path calls), so errors.Is(err, unix.ENOSPC) and
// errors.Is(err, os.ErrNotExist) hold through any FS that keeps them.
package vfs

import (
	"os"
	"slices"

	"golang.org/x/sys/unix"
)

// FS is what the store does to files. Stat results come back by value,
// so that a caller's buffer does not escape through the interface call.
//
// Implementations must be safe for concurrent use.
type FS interface {
	// Open is open(2): it returns a file descriptor.
	Open(path string, flags int, perm uint32) (fd int, err error)
	Close(fd int) error
	Pread(fd int, p []byte, off int64) (n int, err error)
	Pwrite(fd int, p []byte, off int64) (n int, err error)
	Fallocate(fd int, mode uint32, off, n int64) error
	Ftruncate(fd int, size int64) error
	Fdatasync(fd int) error
	Fsync(fd int) error
	Seek(fd int, off int64, whence int) (int64, error)
	Fstat(fd int) (unix.Stat_t, error)
	Flock(fd int, how int) error

	Truncate(path string, size int64) error
	Stat(path string) (unix.Stat_t, error)
	Statfs(path string) (unix.Statfs_t, error)
	Mkdir(path string, perm uint32) error
	MkdirAll(path string, perm uint32) error
	Remove(path string) error
	RemoveAll(path string) error
	Rename(from, to string) error
	// ReadDir returns the names in the directory, sorted.
	ReadDir(path string) ([]string, error)
}

// Default is the operating system's file system.
var Default FS = osFS{}

type osFS struct{}

func (osFS) Open(path string, flags int, perm uint32) (int, error) {
	return unix.Open(path, flags, perm)
}
func (osFS) Close(fd int) error                              { return unix.Close(fd) }
func (osFS) Pread(fd int, p []byte, off int64) (int, error)  { return unix.Pread(fd, p, off) }
func (osFS) Pwrite(fd int, p []byte, off int64) (int, error) { return unix.Pwrite(fd, p, off) }
func (osFS) Fallocate(fd int, mode uint32, off, n int64) error {
	return unix.Fallocate(fd, mode, off, n)
}
func (osFS) Ftruncate(fd int, size int64) error { return unix.Ftruncate(fd, size) }
func (osFS) Fdatasync(fd int) error             { return unix.Fdatasync(fd) }
func (osFS) Fsync(fd int) error                 { return unix.Fsync(fd) }
func (osFS) Seek(fd int, off int64, whence int) (int64, error) {
	return unix.Seek(fd, off, whence)
}
func (osFS) Fstat(fd int) (unix.Stat_t, error) {
	var st unix.Stat_t
	err := unix.Fstat(fd, &st)
	return st, err
}
func (osFS) Flock(fd int, how int) error { return unix.Flock(fd, how) }

func (osFS) Truncate(path string, size int64) error { return unix.Truncate(path, size) }
func (osFS) Stat(path string) (unix.Stat_t, error) {
	var st unix.Stat_t
	err := unix.Stat(path, &st)
	return st, err
}
func (osFS) Statfs(path string) (unix.Statfs_t, error) {
	var st unix.Statfs_t
	err := unix.Statfs(path, &st)
	return st, err
}
func (osFS) Mkdir(path string, perm uint32) error    { return os.Mkdir(path, os.FileMode(perm)) }
func (osFS) MkdirAll(path string, perm uint32) error { return os.MkdirAll(path, os.FileMode(perm)) }
func (osFS) Remove(path string) error                { return os.Remove(path) }
func (osFS) RemoveAll(path string) error             { return os.RemoveAll(path) }
func (osFS) Rename(from, to string) error            { return os.Rename(from, to) }
func (osFS) ReadDir(path string) ([]string, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	names, err := f.Readdirnames(-1)
	slices.Sort(names)
	return names, err
}
