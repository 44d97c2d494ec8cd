package block

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync"

	"golang.org/x/sys/unix"
)

// Raw is a Device whose bytes are the bytes of a host file, as QEMU's raw
// format: guest offset equals file offset and the virtual size is the
// file's size when it was opened.
//
// On an *OSFile, WriteZeroes and Discard deallocate or zero ranges with
// fallocate(2), and Extent reports holes found with SEEK_DATA/SEEK_HOLE.
// On any other File they write zeros and Extent reports the whole device
// as data. Discard always leaves the range reading as zeros.
//
// Extent statuses follow QEMU. `qemu-img map --output=json` of a sparse raw
// file reports every range at depth 0 ("present": true), with holes as
// "zero": true, "data": false; qemu-nbd's qemu:allocation-depth reports 1
// ("local") for the whole file, holes included, and base:allocation reports
// holes as hole,zero. So Raw returns Depth 1 for every range (the raw layer
// itself provides the bytes), StatusData for data and StatusHole|StatusZero
// for holes.
//
// Locking: mu is held shared by every request and exclusively by Close, so
// that Close waits for requests in flight. Requests do not serialize
// against each other: the host file is accessed with pread/pwrite.
//
// Safe for concurrent use. Release with Close.
type Raw struct {
	f        File
	readOnly bool
	size     int64
	// fd is the host descriptor when f has one (an *OSFile or a
	// *DirectFile), else -1.
	fd int

	mu struct {
		sync.RWMutex
		// closed is set by the first Close; requests then fail with
		// ErrClosed.
		closed bool
	}
}

var _ Device = (*Raw)(nil)

// OpenRaw opens the file at path as a raw device. With readOnly the file is
// opened O_RDONLY and writes fail with ErrReadOnly.
func OpenRaw(path string, readOnly bool) (*Raw, error) {
	f, err := OpenFile(path, readOnly)
	if err != nil {
		return nil, fmt.Errorf("block: open raw %s: %w", path, err)
	}
	r, err := NewRaw(f, readOnly)
	if err != nil {
		f.Close()
		return nil, err
	}
	return r, nil
}

// NewRaw makes a raw device over f, whose current size becomes the device
// size. The Raw owns f from then on: Close closes it. It fails only when
// f's size cannot be read.
func NewRaw(f File, readOnly bool) (*Raw, error) {
	size, err := f.Size()
	if err != nil {
		return nil, fmt.Errorf("block: raw size: %w", err)
	}
	r := &Raw{f: f, readOnly: readOnly, size: size, fd: -1}
	if o, ok := f.(interface{ Fd() uintptr }); ok {
		// *OSFile and *DirectFile: fallocate and SEEK_DATA work on both.
		r.fd = int(o.Fd())
	}
	return r, nil
}

// begin takes the shared lock for one request and checks that the device is
// open, writable when write is set, and that [off, off+n) is in range. On
// success the caller must call r.mu.RUnlock.
func (r *Raw) begin(off, n int64, write bool) error {
	r.mu.RLock()
	switch {
	case r.mu.closed:
		r.mu.RUnlock()
		return ErrClosed
	case write && r.readOnly:
		r.mu.RUnlock()
		return ErrReadOnly
	}
	if err := CheckRange(off, n, r.size); err != nil {
		r.mu.RUnlock()
		return err
	}
	return nil
}

// ReadAt reads len(p) bytes at off. Bytes past the end of a file that
// shrank since Open read as zeros.
func (r *Raw) ReadAt(_ context.Context, p []byte, off int64) (int, error) {
	if err := r.begin(off, int64(len(p)), false); err != nil {
		return 0, err
	}
	defer r.mu.RUnlock()
	if err := ReadFull(r.f, p, off); err != nil {
		return 0, fmt.Errorf("block: raw read %d bytes at %d: %w", len(p), off, err)
	}
	return len(p), nil
}

// WriteAt writes p at off; with FUA the file is synced before it returns.
func (r *Raw) WriteAt(_ context.Context, p []byte, off int64, f Flags) (int, error) {
	if err := r.begin(off, int64(len(p)), true); err != nil {
		return 0, err
	}
	defer r.mu.RUnlock()
	n, err := r.f.WriteAt(p, off)
	if err != nil {
		return n, fmt.Errorf("block: raw write %d bytes at %d: %w", len(p), off, err)
	}
	if f&FUA != 0 {
		if err := r.f.Sync(); err != nil {
			return n, fmt.Errorf("block: raw write at %d: fua: %w", off, err)
		}
	}
	return n, nil
}

// WriteZeroes makes [off, off+n) read as zeros. Without NoUnmap the range
// is deallocated (FALLOC_FL_PUNCH_HOLE); with it the range is zeroed in
// place and stays allocated (FALLOC_FL_ZERO_RANGE). When the filesystem
// supports neither, zeros are written, or with NoFallback the request
// fails with ErrNoFallback.
func (r *Raw) WriteZeroes(_ context.Context, off, n int64, f Flags) error {
	if err := r.begin(off, n, true); err != nil {
		return err
	}
	defer r.mu.RUnlock()
	if n == 0 {
		return nil
	}
	if err := r.zeroLocked(off, n, f&NoUnmap == 0, f&NoFallback != 0); err != nil {
		return fmt.Errorf("block: raw write zeroes [%d, +%d): %w", off, n, err)
	}
	if f&FUA != 0 {
		if err := r.f.Sync(); err != nil {
			return fmt.Errorf("block: raw write zeroes at %d: fua: %w", off, err)
		}
	}
	return nil
}

// Discard deallocates [off, off+n) where the filesystem can; afterwards the
// range always reads as zeros. With FUA the file is synced.
func (r *Raw) Discard(_ context.Context, off, n int64, f Flags) error {
	if err := r.begin(off, n, true); err != nil {
		return err
	}
	defer r.mu.RUnlock()
	if n == 0 {
		return nil
	}
	if err := r.zeroLocked(off, n, true, false); err != nil {
		return fmt.Errorf("block: raw discard [%d, +%d): %w", off, n, err)
	}
	if f&FUA != 0 {
		if err := r.f.Sync(); err != nil {
			return fmt.Errorf("block: raw discard at %d: fua: %w", off, err)
		}
	}
	return nil
}

// zeroLocked zeroes a range, preferring fallocate; with noFallback it
// returns ErrNoFallback rather than write zeros. Called with mu held
// shared.
func (r *Raw) zeroLocked(off, n int64, mayUnmap, noFallback bool) error {
	if r.fd >= 0 {
		// ZERO_RANGE without KEEP_SIZE, as QEMU: zeroing the partial
		// sector past the end of the file (RoundUpToSector) grows it.
		modes := []uint32{unix.FALLOC_FL_ZERO_RANGE}
		if mayUnmap {
			modes = append([]uint32{unix.FALLOC_FL_PUNCH_HOLE | unix.FALLOC_FL_KEEP_SIZE}, modes...)
		}
		for _, mode := range modes {
			err := fallocate(r.fd, mode, off, n)
			if err == nil {
				return nil
			}
			if !errors.Is(err, unix.EOPNOTSUPP) && !errors.Is(err, unix.ENOSYS) && !errors.Is(err, unix.EINVAL) {
				return fmt.Errorf("fallocate mode %#x: %w", mode, err)
			}
		}
	}
	if noFallback {
		return ErrNoFallback
	}
	return writeZeros(r.f, off, n)
}

func fallocate(fd int, mode uint32, off, n int64) error {
	for {
		err := unix.Fallocate(fd, mode, off, n)
		if err != unix.EINTR {
			return err
		}
	}
}

// zeroChunk is the most writeZeros writes per call.
const zeroChunk = 1 << 20

// zeroBuf is an array, not a make: a package-level make runs at init in
// every ovis process, and this megabyte alone brought a garbage
// collection into each short `ovis img` run.
var zeroBuf [zeroChunk]byte

func writeZeros(w io.WriterAt, off, n int64) error {
	for n > 0 {
		c := min(n, zeroChunk)
		if _, err := w.WriteAt(zeroBuf[:c], off); err != nil {
			return err
		}
		off += c
		n -= c
	}
	return nil
}

// Flush syncs the file (fdatasync for an *OSFile).
func (r *Raw) Flush(context.Context) error {
	r.mu.RLock()
	defer r.mu.RUnlock()
	if r.mu.closed {
		return ErrClosed
	}
	if r.readOnly {
		return nil
	}
	if err := r.f.Sync(); err != nil {
		return fmt.Errorf("block: raw flush: %w", err)
	}
	return nil
}

// Extents reports the runs of data and holes in [off, off+n), from
// SEEK_DATA/SEEK_HOLE. Where the file cannot tell (not an *OSFile, or a
// filesystem without SEEK_DATA), the range is data. Depth is always 1;
// see the type's documentation.
func (r *Raw) Extents(_ context.Context, off, n int64, dst []Extent) ([]Extent, error) {
	if err := r.begin(off, n, false); err != nil {
		return dst, err
	}
	defer r.mu.RUnlock()
	return AppendRuns(off, n, dst, r.extentLocked)
}

// extentLocked is the run that starts at off, at most n bytes. Called
// with mu held shared.
func (r *Raw) extentLocked(off, n int64) (Extent, error) {
	data := Extent{Length: n, Status: StatusData, Depth: 1}
	if r.fd < 0 {
		return data, nil
	}
	hole := Extent{Length: n, Status: StatusHole | StatusZero, Depth: 1}
	d, err := unix.Seek(r.fd, off, unix.SEEK_DATA)
	switch {
	case errors.Is(err, unix.ENXIO):
		// No data at or after off: the rest of the file is a hole
		// (or the file shrank, and reads past its end are zeros).
		return hole, nil
	case err != nil:
		return data, nil
	case d > off:
		hole.Length = min(n, d-off)
		return hole, nil
	}
	h, err := unix.Seek(r.fd, off, unix.SEEK_HOLE)
	if err != nil || h <= off {
		return data, nil
	}
	data.Length = min(n, h-off)
	return data, nil
}

// ErrCopyUnsupported is returned by CopyFrom when the host cannot copy
// between the two files without the data passing through memory.
var ErrCopyUnsupported = errors.New("block: copy offloading not supported")

// CopyFrom copies n bytes at srcOff of src to dstOff of r inside the
// kernel (copy_file_range(2), which a filesystem may turn into a reflink
// or a server-side copy), as QEMU's copy offloading does for
// qemu-img convert -C. It returns ErrCopyUnsupported when either file has
// no host descriptor or the kernel refuses the pair; the caller then
// copies through a buffer. Holes in the source may come out allocated.
func (r *Raw) CopyFrom(src *Raw, srcOff, dstOff, n int64) error {
	if err := r.begin(dstOff, n, true); err != nil {
		return err
	}
	defer r.mu.RUnlock()
	if err := src.begin(srcOff, n, false); err != nil {
		return err
	}
	defer src.mu.RUnlock()
	if r.fd < 0 || src.fd < 0 {
		return ErrCopyUnsupported
	}
	for n > 0 {
		k, err := unix.CopyFileRange(src.fd, &srcOff, r.fd, &dstOff, int(min(n, 1<<30)), 0)
		switch {
		case errors.Is(err, unix.EINTR):
			continue
		case errors.Is(err, unix.EXDEV), errors.Is(err, unix.EINVAL), errors.Is(err, unix.ENOSYS),
			errors.Is(err, unix.EOPNOTSUPP), errors.Is(err, unix.EBADF):
			return fmt.Errorf("%w: %w", ErrCopyUnsupported, err)
		case err != nil:
			return fmt.Errorf("block: raw copy of %d bytes to %d: %w", n, dstOff, err)
		case k == 0:
			// The source ended early (it shrank since Open).
			return fmt.Errorf("block: raw copy to %d: source ended at %d: %w", dstOff, srcOff, io.ErrUnexpectedEOF)
		}
		n -= int64(k)
	}
	return nil
}

// Size returns the size the file had when the device was opened, rounded
// up to a whole sector after RoundUpToSector.
func (r *Raw) Size() int64 { return r.size }

// RoundUpToSector makes the device's size its file's size rounded up to a
// whole 512-byte sector, the size QEMU's raw driver gives a file (and
// qemu-nbd exports): the partial last sector reads as zeros past the end of
// the file, Extent reports the bytes past the end as a hole, and writes
// there extend the file, as pwrite does under QEMU. It must be called
// before the device is shared.
func (r *Raw) RoundUpToSector() { r.size = (r.size + 511) &^ 511 }

// Close syncs a writable file and closes it, after requests in flight have
// finished. It returns the first error but always closes the file. A
// second Close returns ErrClosed.
func (r *Raw) Close() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.mu.closed {
		return ErrClosed
	}
	r.mu.closed = true
	var first error
	if !r.readOnly {
		if err := r.f.Sync(); err != nil {
			first = fmt.Errorf("block: raw close: %w", err)
		}
	}
	if err := r.f.Close(); err != nil && first == nil {
		first = fmt.Errorf("block: raw close: %w", err)
	}
	return first
}
