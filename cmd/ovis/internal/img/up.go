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

// UpConfig says which disk PrepareDisk makes sure of.
type UpConfig struct {
	// Dir holds the disk images. The default is "ovis-data".
	Dir string
	// Size is the virtual size of a new disk, with qemu-img's suffixes.
	// The default is "20G".
	Size string
}

// PrepareDisk makes sure Dir/disk0.qcow2 exists, creating a sparse qcow2
// image of Size when it does not, prints one line saying which, and
// returns the disk's absolute path. An existing disk is kept as it is,
// whatever its size. Errors name the step; a bad Size is qemu-img's
// message.
func PrepareDisk(cfg UpConfig, w io.Writer) (string, error) {
	if cfg.Dir == "" {
		cfg.Dir = "ovis-data"
	}
	if cfg.Size == "" {
		cfg.Size = "20G"
	}
	path, err := filepath.Abs(filepath.Join(cfg.Dir, "disk0.qcow2"))
	if err != nil {
		return "", fmt.Errorf("up: %w", err)
	}
	_, err = os.Stat(path)
	switch {
	case err == nil:
		fmt.Fprintf(w, "disk: %s (exists)\n", path)
	case errors.Is(err, fs.ErrNotExist):
		size, err := cvtnum("image size", cfg.Size, math.MaxInt64)
		if err != nil {
			return "", err
		}
		if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
			return "", fmt.Errorf("up: %w", err)
		}
		if err := qcow2.Create(path, qcow2.CreateOptions{Size: (size + 511) &^ 511}); err != nil {
			return "", fmt.Errorf("up: create %s: %w", path, err)
		}
		fmt.Fprintf(w, "disk: %s (created, %s virtual, sparse qcow2)\n", path, FormatSize(uint64(size)))
	default:
		return "", fmt.Errorf("up: %w", err)
	}
	return path, nil
}
