package img

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"math"
	"os"
	"path/filepath"

	"github.com/ovis-storage/ovis/qcow2"
)

// UpConfig configures Up.
type UpConfig struct {
	// Dir holds the disk images. The default is "ovis-data".
	Dir string
	// Size is the virtual size of a new disk, with qemu-img's suffixes.
	// The default is "20G".
	Size string
}

// Up makes sure Dir/disk0.qcow2 exists, creating a sparse qcow2 image of
// Size when it does not, and says where it is and what comes next. It does
// not serve the disk: that is the NBD server's job.
func Up(cfg UpConfig, w io.Writer) error {
	if cfg.Dir == "" {
		cfg.Dir = "ovis-data"
	}
	if cfg.Size == "" {
		cfg.Size = "20G"
	}
	path, err := filepath.Abs(filepath.Join(cfg.Dir, "disk0.qcow2"))
	if err != nil {
		return fmt.Errorf("up: %w", err)
	}
	_, err = os.Stat(path)
	switch {
	case err == nil:
		fmt.Fprintf(w, "disk: %s (exists)\n", path)
	case errors.Is(err, fs.ErrNotExist):
		size, err := cvtnum("image size", cfg.Size, math.MaxInt64)
		if err != nil {
			return err
		}
		if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
			return fmt.Errorf("up: %w", err)
		}
		if err := qcow2.Create(path, qcow2.CreateOptions{Size: (size + 511) &^ 511}); err != nil {
			return fmt.Errorf("up: create %s: %w", path, err)
		}
		fmt.Fprintf(w, "disk: %s (created, %s virtual, sparse qcow2)\n", path, FormatSize(uint64(size)))
	default:
		return fmt.Errorf("up: %w", err)
	}
	fmt.Fprintf(w, "inspect it with: ovis img info %s\n", path)
	fmt.Fprintln(w, "NBD serving is not there yet: it arrives with the NBD server (`ovis nbd`, issue 3).")
	return nil
}
