package img

import (
	"errors"
	"fmt"

	"github.com/ovis-storage/ovis/block"
	"github.com/ovis-storage/ovis/image"
	"github.com/ovis-storage/ovis/qcow2"
)

// LoadSnapshot makes dev, opened read-only, read as the internal
// snapshot p names (image.LoadSnapshot), with QEMU's messages
// (bdrv_snapshot_load_tmp).
func LoadSnapshot(dev block.Device, p SnapshotParam) error {
	err := image.LoadSnapshot(dev, p)
	var se *image.SnapshotError
	switch {
	case err == nil:
		return nil
	case errors.Is(err, image.ErrNoInternalSnapshots):
		return wrapMsg(err, "Failed to load snapshot: Block format 'raw' used by device '' does not support temporarily loading internal snapshots")
	case errors.Is(err, qcow2.ErrSnapshotNotFound):
		return wrapMsg(err, "Failed to load snapshot: Can't find snapshot")
	case errors.As(err, &se):
		return fmt.Errorf("Failed to load snapshot: %w", se.Err)
	}
	return fmt.Errorf("Failed to load snapshot: %w", err)
}
