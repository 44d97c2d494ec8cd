package img

import (
	"errors"
	"fmt"
	"os"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/ovis-storage/ovis/block"
)

// firstBlockSize is how much of a new raw file QEMU writes so that later
// alignment probing finds an allocated block (MAX_BLOCKSIZE and the page
// size, whichever is larger).
const firstBlockSize = 4096

// Image locks taken on an existing file before an image is created over
// it. QEMU's file driver takes write and resize and checks that nobody
// refuses to share them before it truncates the file, so an image
// another process writes, or reads without -U, is refused ('Failed to get
// "write" lock') and one read with -U, or a raw image another writer
// shares, is not. The qcow2 driver then opens the file refusing to share
// writes, which QEMU only checks after the truncation; ovis checks it
// first, so the file is never changed under a holder.
const (
	createRawPerm      = block.PermWrite | block.PermResize
	createQcow2Perm    = block.PermConsistentRead | block.PermWrite | block.PermResize
	createQcow2Unshare = block.PermWrite | block.PermResize
)

// withCreateLock runs create while holding, on the file at path if one
// exists, the locks QEMU takes there before it writes a new image of
// format; it fails with a *block.LockError, without running create, when
// another process conflicts. A missing or unreadable file is not locked:
// create itself reports what is wrong with it.
func withCreateLock(path, format string, create func() error) error {
	f, err := os.Open(path)
	if err != nil {
		return create()
	}
	if st, err := f.Stat(); err != nil || st.IsDir() {
		f.Close()
		return create()
	}
	lf := block.NewOSFile(f)
	defer lf.Close()
	perm, unshared := createRawPerm, block.Perm(0)
	if format == "qcow2" {
		perm, unshared = createQcow2Perm, createQcow2Unshare
	}
	// The holder yields to the opens of create here (block.LockYield),
	// but is checked against this process's other holders: an image a
	// source chain holds is refused, as QEMU's nodes refuse it.
	if err := lf.LockImage(path, perm|block.LockYield, unshared); err != nil {
		return err
	}
	return create()
}

// newImagePath is the file a new image named name goes in: a "file:"
// prefix names a path, as in QEMU, and a json: option tree cannot be
// created (QEMU has no json protocol to create with).
func newImagePath(name string) (string, error) {
	if strings.HasPrefix(name, "json:") {
		return "", errors.New("Unknown protocol 'json'")
	}
	return strings.TrimPrefix(name, "file:"), nil
}

// createRaw creates a raw image of size bytes as QEMU's file-posix driver
// does: sparse (with the first block allocated), or preallocated with
// fallocate (falloc) or by writing zeros (full).
func createRaw(path string, size int64, prealloc string) error {
	switch prealloc {
	case "", "off", "falloc", "full":
	case "metadata":
		return fmt.Errorf("Unsupported preallocation mode: %s", prealloc)
	default:
		return fmt.Errorf("invalid parameter value: %s", prealloc)
	}
	return withCreateLock(path, "raw", func() error {
		f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o644)
		if err != nil {
			return createError("raw", err)
		}
		if err := fillRaw(f, size, prealloc); err != nil {
			f.Close()
			return err
		}
		if err := f.Close(); err != nil {
			return fmt.Errorf("Could not close '%s': %s", path, strerror(err))
		}
		return nil
	})
}

func fillRaw(f *os.File, size int64, prealloc string) error {
	if err := f.Truncate(0); err != nil {
		return wrapMsg(err, "Could not resize file: %s", strerror(err))
	}
	fd := int(f.Fd())
	switch prealloc {
	case "falloc":
		if size == 0 {
			return nil
		}
		if err := unix.Fallocate(fd, 0, 0, size); err != nil {
			if errors.Is(err, unix.EFBIG) {
				return createError("raw", err)
			}
			return wrapMsg(err, "Could not preallocate new data: %s", strerror(err))
		}
		return allocateFirstBlock(f, size)
	case "full":
		if err := f.Truncate(size); err != nil {
			return createError("raw", err)
		}
		buf := make([]byte, 1<<20)
		for off := int64(0); off < size; off += int64(len(buf)) {
			n := min(int64(len(buf)), size-off)
			if _, err := f.WriteAt(buf[:n], off); err != nil {
				return wrapMsg(err, "Could not write zeros for preallocation: %s", strerror(err))
			}
		}
		if err := f.Sync(); err != nil {
			return wrapMsg(err, "Could not flush file: %s", strerror(err))
		}
		return nil
	default:
		if err := f.Truncate(size); err != nil {
			if errors.Is(err, unix.EFBIG) {
				return createError("raw", err)
			}
			return wrapMsg(err, "Could not resize file: %s", strerror(err))
		}
		return allocateFirstBlock(f, size)
	}
}

// allocateFirstBlock writes zeros over the first block, ignoring failures,
// as QEMU's allocate_first_block does.
func allocateFirstBlock(f *os.File, size int64) error {
	if size > 0 {
		f.WriteAt(make([]byte, min(size, firstBlockSize)), 0)
	}
	return nil
}
