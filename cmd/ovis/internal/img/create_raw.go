package img

import (
	"errors"
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// firstBlockSize is how much of a new raw file QEMU writes so that later
// alignment probing finds an allocated block (MAX_BLOCKSIZE and the page
// size, whichever is larger).
const firstBlockSize = 4096

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
