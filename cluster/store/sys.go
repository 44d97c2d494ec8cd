package store

import (
	"fmt"

	"golang.org/x/sys/unix"

	"github.com/ovis-storage/ovis/cluster/store/vfs"
)

// readFile returns the content of the small file at path (FORMAT, the
// journal).
func readFile(fs vfs.FS, path string) ([]byte, error) {
	fd, err := fs.Open(path, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	defer fs.Close(fd)
	st, err := fs.Fstat(fd)
	if err != nil {
		return nil, fmt.Errorf("fstat %s: %w", path, err)
	}
	b := make([]byte, 0, st.Size+512)
	for {
		if len(b) == cap(b) {
			b = append(b, 0)[:len(b)]
		}
		n, err := fs.Pread(fd, b[len(b):cap(b)], int64(len(b)))
		if err != nil {
			return nil, fmt.Errorf("read %s at %d: %w", path, len(b), err)
		}
		if n == 0 {
			return b, nil
		}
		b = b[:len(b)+n]
	}
}

// writeFileSync writes b as the whole file at path and fsyncs it.
func writeFileSync(fs vfs.FS, path string, b []byte) error {
	fd, err := fs.Open(path, unix.O_WRONLY|unix.O_CREAT|unix.O_TRUNC|unix.O_CLOEXEC, 0o644)
	if err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	for done := 0; done < len(b) && err == nil; {
		var n int
		n, err = fs.Pwrite(fd, b[done:], int64(done))
		done += n
	}
	if err == nil {
		err = fs.Fsync(fd)
	}
	if cerr := fs.Close(fd); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	return nil
}

// syncDir fsyncs the directory dir, making its entries durable.
func syncDir(fs vfs.FS, dir string) error {
	fd, err := fs.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("open dir %s: %w", dir, err)
	}
	err = fs.Fsync(fd)
	fs.Close(fd)
	if err != nil {
		return fmt.Errorf("fsync dir %s: %w", dir, err)
	}
	return nil
}
