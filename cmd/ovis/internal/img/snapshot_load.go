package img

import (
	"errors"
	"fmt"

	"github.com/ovis-storage/ovis/block"
	"github.com/ovis-storage/ovis/qcow2"
)

// LoadSnapshot makes dev, opened read-only, read as the internal
// snapshot p names, with QEMU's messages (bdrv_snapshot_load_tmp): a
// single ID or name is looked up as an ID first.
func LoadSnapshot(dev block.Device, p SnapshotParam) error {
	qimg, ok := block.As[*qcow2.Image](dev)
	if !ok {
		return errors.New("Failed to load snapshot: Block format 'raw' used by device '' does not support temporarily loading internal snapshots")
	}
	var err error
	if p.IDOrName != "" {
		if err = qimg.LoadSnapshot(p.IDOrName, ""); errors.Is(err, qcow2.ErrSnapshotNotFound) {
			err = qimg.LoadSnapshot("", p.IDOrName)
		}
	} else {
		err = qimg.LoadSnapshot(p.ID, p.Name)
	}
	if errors.Is(err, qcow2.ErrSnapshotNotFound) {
		return errors.New("Failed to load snapshot: Can't find snapshot")
	}
	if err != nil {
		return fmt.Errorf("Failed to load snapshot: %w", err)
	}
	return nil
}
