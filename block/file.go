package block

import (
	"fmt"
	"io"
	"os"

	"golang.org/x/sys/unix"
)

// File is the host file an image engine stores its bytes in. It is an
// interface so that tests can put a recording or failing layer beneath an
// engine (the crash harness).
//
// Implementations are safe for concurrent use.
type File interface {
	io.ReaderAt
	io.WriterAt
	// Sync makes all completed writes durable (fdatasync).
	Sync() error
	// Truncate sets the file's size.
	Truncate(size int64) error
	// Size returns the file's current size.
	Size() (int64, error)
	// Close releases the file.
	Close() error
}

// OSFile is a File backed by an *os.File.
type OSFile struct {
	f  *os.File
	lk imageLock
}

var _ File = (*OSFile)(nil)

// OpenFile opens path for an engine. With readOnly the file is opened
// O_RDONLY.
func OpenFile(path string, readOnly bool) (*OSFile, error) {
	flag := os.O_RDWR
	if readOnly {
		flag = os.O_RDONLY
	}
	f, err := os.OpenFile(path, flag, 0)
	if err != nil {
		return nil, err
	}
	return &OSFile{f: f}, nil
}

// CreateFile creates (or truncates) path for writing.
func CreateFile(path string) (*OSFile, error) {
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_TRUNC, 0o644)
	if err != nil {
		return nil, err
	}
	return &OSFile{f: f}, nil
}

// NewOSFile wraps an open file.
func NewOSFile(f *os.File) *OSFile { return &OSFile{f: f} }

// ReadAt reads like os.File.ReadAt.
func (o *OSFile) ReadAt(p []byte, off int64) (int, error) { return o.f.ReadAt(p, off) }

// WriteAt writes like os.File.WriteAt.
func (o *OSFile) WriteAt(p []byte, off int64) (int, error) { return o.f.WriteAt(p, off) }

// Sync calls fdatasync.
func (o *OSFile) Sync() error {
	for {
		err := unix.Fdatasync(int(o.f.Fd()))
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return fmt.Errorf("fdatasync %s: %w", o.f.Name(), err)
		}
		return nil
	}
}

// Truncate sets the size.
func (o *OSFile) Truncate(size int64) error { return o.f.Truncate(size) }

// Size stats the file.
func (o *OSFile) Size() (int64, error) {
	st, err := o.f.Stat()
	if err != nil {
		return 0, err
	}
	return st.Size(), nil
}

// LockImage takes QEMU's image locks on the file until it is closed
// (ImageLocker).
func (o *OSFile) LockImage(path string, perm, unshared Perm) error {
	return o.lk.lock(o.f, path, perm, unshared)
}

// Close drops the file's image locks and closes it.
func (o *OSFile) Close() error {
	o.lk.release()
	return o.f.Close()
}

// Name returns the path the file was opened with.
func (o *OSFile) Name() string { return o.f.Name() }

// Fd returns the file descriptor, for hole punching and SEEK_DATA.
func (o *OSFile) Fd() uintptr { return o.f.Fd() }

// ReadFull reads len(p) bytes at off, treating bytes past the end of the
// file as zeros (a sparse or short file reads as zeros to its nominal end).
func ReadFull(r io.ReaderAt, p []byte, off int64) error {
	n, err := r.ReadAt(p, off)
	if err == io.EOF {
		clear(p[n:])
		return nil
	}
	return err
}
