package block

import (
	"fmt"
	"io"
	"os"
	"sync"
	"unsafe"

	"golang.org/x/sys/unix"
)

// DirectAlign is the alignment DirectFile uses for offsets, lengths and
// buffers. 4096 satisfies every logical block size Linux devices report.
const DirectAlign = 4096

// DirectFile is a File opened with O_DIRECT, bypassing the host page
// cache (QEMU's cache=none and cache=directsync). Requests need not be
// aligned: unaligned ones go through an aligned bounce buffer, and writes
// that cover part of a block read-modify-write it.
//
// Locking: writes hold the stripe locks of the blocks at their edges, so
// two read-modify-writes of one block, or one and an aligned write, never
// interleave. Stripes are taken in ascending order.
//
// Safe for concurrent use.
type DirectFile struct {
	f       *os.File
	stripes [64]sync.Mutex
	// growMu serializes writes whose last block is partial, which may
	// extend the file and then truncate it back.
	growMu sync.Mutex
	lk     imageLock
}

var _ File = (*DirectFile)(nil)

// OpenFileDirect opens path with O_DIRECT.
func OpenFileDirect(path string, readOnly bool) (*DirectFile, error) {
	flag := os.O_RDWR
	if readOnly {
		flag = os.O_RDONLY
	}
	f, err := os.OpenFile(path, flag|unix.O_DIRECT, 0)
	if err != nil {
		return nil, err
	}
	return &DirectFile{f: f}, nil
}

// AlignedBuf returns a zeroed buffer of n bytes whose address is
// DirectAlign-aligned, so that DirectFile reads into it need no bounce
// buffer when n and the offset are multiples of DirectAlign.
func AlignedBuf(n int) []byte { return alignedBuf(n) }

// alignedBuf returns a zeroed buffer of n bytes whose address is
// DirectAlign-aligned.
func alignedBuf(n int) []byte {
	b := make([]byte, n+DirectAlign)
	shift := int(uintptr(unsafe.Pointer(unsafe.SliceData(b))) & (DirectAlign - 1))
	if shift != 0 {
		shift = DirectAlign - shift
	}
	return b[shift : shift+n : shift+n]
}

func isAligned(p []byte, off int64) bool {
	return off%DirectAlign == 0 && len(p)%DirectAlign == 0 && len(p) > 0 &&
		uintptr(unsafe.Pointer(unsafe.SliceData(p)))%DirectAlign == 0
}

// span returns the aligned range covering [off, off+n).
func span(off int64, n int) (int64, int) {
	start := off &^ (DirectAlign - 1)
	end := (off + int64(n) + DirectAlign - 1) &^ (DirectAlign - 1)
	return start, int(end - start)
}

// ReadAt reads like os.File.ReadAt; bytes past the end of the file are
// reported with io.EOF.
func (d *DirectFile) ReadAt(p []byte, off int64) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	if isAligned(p, off) {
		return d.f.ReadAt(p, off)
	}
	start, n := span(off, len(p))
	buf := alignedBuf(n)
	got, err := d.f.ReadAt(buf, start)
	if err != nil && err != io.EOF {
		return 0, err
	}
	if got <= int(off-start) {
		return 0, io.EOF
	}
	c := copy(p, buf[off-start:got])
	if c < len(p) {
		return c, io.EOF
	}
	return c, nil
}

// WriteAt writes like os.File.WriteAt. The file never grows past
// off+len(p), even though O_DIRECT writes whole blocks.
func (d *DirectFile) WriteAt(p []byte, off int64) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	start, n := span(off, len(p))
	unlock := d.lockEdges(start, n)
	defer unlock()
	if isAligned(p, off) {
		return d.f.WriteAt(p, off)
	}
	buf := alignedBuf(n)
	end := off + int64(len(p))
	headPartial := off != start
	tailPartial := end != start+int64(n)
	if headPartial {
		if _, err := d.f.ReadAt(buf[:DirectAlign], start); err != nil && err != io.EOF {
			return 0, fmt.Errorf("direct write: reading block at %#x: %w", start, err)
		}
	}
	if tailPartial && !(headPartial && n == DirectAlign) {
		last := start + int64(n) - DirectAlign
		if _, err := d.f.ReadAt(buf[n-DirectAlign:], last); err != nil && err != io.EOF {
			return 0, fmt.Errorf("direct write: reading block at %#x: %w", last, err)
		}
	}
	copy(buf[off-start:], p)
	if !tailPartial {
		_, err := d.f.WriteAt(buf, start)
		return len(p), err
	}
	// The whole-block write may reach past the end of the file: serialize
	// with other such writes and cut the file back to where it should end.
	d.growMu.Lock()
	defer d.growMu.Unlock()
	size, err := d.Size()
	if err != nil {
		return 0, err
	}
	if _, err := d.f.WriteAt(buf, start); err != nil {
		return 0, err
	}
	if want := max(size, end); want < start+int64(n) {
		if err := d.f.Truncate(want); err != nil {
			return 0, err
		}
	}
	return len(p), nil
}

// lockEdges takes the stripe locks of the first and last block of an
// aligned range, in ascending stripe order.
func (d *DirectFile) lockEdges(start int64, n int) func() {
	a := int(start/DirectAlign) % len(d.stripes)
	b := int((start+int64(n)-DirectAlign)/DirectAlign) % len(d.stripes)
	if a > b {
		a, b = b, a
	}
	d.stripes[a].Lock()
	if b != a {
		d.stripes[b].Lock()
	}
	return func() {
		if b != a {
			d.stripes[b].Unlock()
		}
		d.stripes[a].Unlock()
	}
}

// Sync calls fdatasync: O_DIRECT bypasses the page cache but not the
// device's volatile write cache.
func (d *DirectFile) Sync() error {
	for {
		err := unix.Fdatasync(int(d.f.Fd()))
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return fmt.Errorf("fdatasync %s: %w", d.f.Name(), err)
		}
		return nil
	}
}

// Truncate sets the size.
func (d *DirectFile) Truncate(size int64) error { return d.f.Truncate(size) }

// Size stats the file.
func (d *DirectFile) Size() (int64, error) {
	st, err := d.f.Stat()
	if err != nil {
		return 0, err
	}
	return st.Size(), nil
}

// LockImage takes QEMU's image locks on the file until it is closed
// (ImageLocker).
func (d *DirectFile) LockImage(path string, perm, unshared Perm) error {
	return d.lk.lock(d.f, path, perm, unshared)
}

// Close drops the file's image locks and closes it.
func (d *DirectFile) Close() error {
	d.lk.release()
	return d.f.Close()
}

// Fd returns the file descriptor.
func (d *DirectFile) Fd() uintptr { return d.f.Fd() }

// Name returns the path the file was opened with.
func (d *DirectFile) Name() string { return d.f.Name() }
