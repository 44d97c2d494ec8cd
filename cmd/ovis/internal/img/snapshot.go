package img

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"syscall"
	"time"

	"github.com/ovis-storage/ovis/block"
	"github.com/ovis-storage/ovis/qcow2"
)

// Snapshot actions, qemu-img snapshot's -l, -c, -a and -d.
const (
	SnapshotList   = "list"
	SnapshotCreate = "create"
	SnapshotApply  = "apply"
	SnapshotDelete = "delete"
)

// SnapshotConfig is what `ovis img snapshot` was given, as qemu-img
// snapshot's arguments: snapshot [-l | -a NAME | -c NAME | -d NAME] [-q]
// [-U] FILENAME.
type SnapshotConfig struct {
	// Filename is the image.
	Filename string
	// Action is one of the Snapshot* constants, or "" to do nothing (as
	// qemu-img does without an action, the image is still opened
	// read-write).
	Action string
	// Name is the snapshot to create, apply or delete.
	Name string
	// Quiet (-q) has no output to hide: the verb prints only errors and
	// the list.
	Quiet bool
	// Now stamps a new snapshot; nil means time.Now.
	Now func() time.Time
}

// snapshotNameMax is the size of QEMUSnapshotInfo.name less its NUL:
// qemu-img cuts longer names.
const snapshotNameMax = 255

// Snapshot lists, creates, applies or deletes an internal snapshot as
// qemu-img snapshot does. The list is qemu-img's table; a new snapshot
// gets the next free numeric ID and the current time; delete looks the
// snapshot up by name, apply by ID and then name, as QEMU does.
func (e *Env) Snapshot(ctx context.Context, cfg SnapshotConfig) error {
	stdout, stderr := e.stdout(), e.stderr()
	ro := cfg.Action == SnapshotList
	dev, err := e.openWritable(ctx, cfg.Filename, "", qcow2.Options{ReadOnly: ro}, stderr)
	if err != nil {
		return err
	}
	img, _ := block.As[*qcow2.Image](dev)
	if img == nil && cfg.Action == SnapshotApply {
		// QEMU reopens the file to look for snapshots below the raw
		// layer, and warns again.
		rawProbeWarning(stderr, cfg.Filename)
	}
	err = snapshotOn(ctx, img, cfg, stdout, stderr)
	if cerr := dev.Close(); err == nil && cerr != nil {
		err = cerr
	}
	return err
}

func snapshotOn(ctx context.Context, img *qcow2.Image, cfg SnapshotConfig, stdout, stderr io.Writer) error {
	switch cfg.Action {
	case SnapshotList:
		if img == nil || len(img.Snapshots()) == 0 {
			return nil
		}
		var b strings.Builder
		b.WriteString("Snapshot list:\n" + snapshotHeader + "\n")
		for _, s := range img.Snapshots() {
			b.WriteString(snapshotInfoOf(s).row() + "\n")
		}
		_, err := io.WriteString(stdout, b.String())
		return err
	case SnapshotCreate:
		unsupported := img == nil
		if !unsupported {
			h := img.Header()
			unsupported = h.HasDataFile()
		}
		if unsupported {
			return fmt.Errorf("Could not create snapshot '%s': -95 (Operation not supported)", cfg.Name)
		}
		now := time.Now
		if cfg.Now != nil {
			now = cfg.Now
		}
		t := now()
		name := cfg.Name
		if len(name) > snapshotNameMax {
			name = name[:snapshotNameMax]
		}
		if err := img.CreateSnapshot(ctx, "", name, uint32(t.Unix()), uint32(t.Nanosecond()/1000*1000)); err != nil {
			corruptionMessage(err, stderr)
			// qemu-img prints the errno bdrv_snapshot_create returned.
			var errno syscall.Errno
			if errors.As(err, &errno) {
				return fmt.Errorf("Could not create snapshot '%s': %d (%s)", cfg.Name, -int(errno), strerror(errno))
			}
			return fmt.Errorf("Could not create snapshot '%s': %s", cfg.Name, strerror(err))
		}
	case SnapshotApply:
		if img == nil {
			return fmt.Errorf("Could not apply snapshot '%s': Block driver does not support snapshots", cfg.Name)
		}
		if err := img.ApplySnapshot(ctx, cfg.Name); err != nil {
			corruptionMessage(err, stderr)
			if errors.Is(err, qcow2.ErrSnapshotNotFound) {
				return fmt.Errorf("Could not apply snapshot '%s': Failed to load snapshot: No such file or directory", cfg.Name)
			}
			var errno syscall.Errno
			if errors.As(err, &errno) {
				return fmt.Errorf("Could not apply snapshot '%s': Failed to load snapshot: %s", cfg.Name, strerror(errno))
			}
			return fmt.Errorf("Could not apply snapshot '%s': %s", cfg.Name, strerror(err))
		}
	case SnapshotDelete:
		// bdrv_snapshot_find looks by name only.
		id := ""
		if img != nil {
			for _, s := range img.Snapshots() {
				if s.Name == cfg.Name {
					id = s.ID
					break
				}
			}
		}
		if id == "" {
			return fmt.Errorf("Could not delete snapshot '%s': snapshot not found", cfg.Name)
		}
		if err := img.DeleteSnapshot(ctx, id); err != nil {
			corruptionMessage(err, stderr)
			var errno syscall.Errno
			if errors.As(err, &errno) {
				what := "Failed to free the cluster and L1 table"
				if errors.Is(err, qcow2.ErrSnapshotStatus) {
					what = "Failed to update snapshot status in disk"
				}
				return fmt.Errorf("Could not delete snapshot '%s': %s: %s", cfg.Name, what, strerror(errno))
			}
			return fmt.Errorf("Could not delete snapshot '%s': %s", cfg.Name, strerror(err))
		}
	}
	return nil
}

// corruptionMessage prints the line QEMU prints when an operation meets a
// corruption event, before the operation's error.
func corruptionMessage(err error, stderr io.Writer) {
	var ev *qcow2.CorruptionEvent
	if errors.As(err, &ev) {
		fmt.Fprintln(stderr, ev.Message())
	}
}
