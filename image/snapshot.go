package image

import (
	"errors"
	"fmt"
	"strings"

	"github.com/ovis-storage/ovis/block"
	"github.com/ovis-storage/ovis/qcow2"
)

// Snapshot names an internal snapshot of an image, as qemu-img's and
// qemu-nbd's -l do: by ID, by name, by both, or by one string that is
// looked up as an ID first and then as a name.
type Snapshot struct {
	// ID and Name must both match when set; an empty one matches any.
	ID, Name string
	// IDOrName is set alone, for the one-string form.
	IDOrName string
}

// String is the snapshot as ParseSnapshot reads it.
func (s Snapshot) String() string {
	if s.IDOrName != "" {
		return s.IDOrName
	}
	var parts []string
	if s.ID != "" {
		parts = append(parts, "snapshot.id="+strings.ReplaceAll(s.ID, ",", ",,"))
	}
	if s.Name != "" {
		parts = append(parts, "snapshot.name="+strings.ReplaceAll(s.Name, ",", ",,"))
	}
	return strings.Join(parts, ",")
}

// ParseSnapshot parses a -l argument: an option list of snapshot.id=ID
// and snapshot.name=NAME (either may be left out) when it starts with
// "snapshot.", else one ID or name. Another option in the list is an
// *OptError with Driver "snapshot" and ErrOptUnsupported.
func ParseSnapshot(s string) (Snapshot, error) {
	if !strings.HasPrefix(s, "snapshot.") {
		return Snapshot{IDOrName: s}, nil
	}
	var p Snapshot
	for _, o := range SplitOpts(s) {
		switch o.Name {
		case "snapshot.id":
			p.ID = o.Value
		case "snapshot.name":
			p.Name = o.Value
		default:
			return p, &OptError{Spec: s, Name: o.Name, Value: o.Value, Driver: "snapshot", Err: ErrOptUnsupported}
		}
	}
	return p, nil
}

// ErrNoInternalSnapshots is the cause of a SnapshotError for a device
// whose format keeps no internal snapshots (raw).
var ErrNoInternalSnapshots = errors.New("the format has no internal snapshots")

// SnapshotError is the error of LoadSnapshot and OpenSnapshot.
type SnapshotError struct {
	// Snapshot is the snapshot that was to be loaded.
	Snapshot Snapshot
	// Err is ErrNoInternalSnapshots, qcow2.ErrSnapshotNotFound or the
	// engine's error.
	Err error
}

func (e *SnapshotError) Error() string {
	return fmt.Sprintf("image: loading snapshot %s: %v", e.Snapshot, e.Err)
}

func (e *SnapshotError) Unwrap() error { return e.Err }

// LoadSnapshot makes dev, a qcow2 image opened read-only (or a device
// that wraps one, see block.As), read as the internal snapshot s from
// now on, as QEMU's bdrv_snapshot_load_tmp does: the virtual size stays
// the image's. A one-string s is looked up as an ID first. The error is
// a *SnapshotError. Not safe for concurrent use with reads of dev.
func LoadSnapshot(dev block.Device, s Snapshot) error {
	img, ok := block.As[*qcow2.Image](dev)
	if !ok {
		return &SnapshotError{Snapshot: s, Err: ErrNoInternalSnapshots}
	}
	var err error
	if s.IDOrName != "" {
		if err = img.LoadSnapshot(s.IDOrName, ""); errors.Is(err, qcow2.ErrSnapshotNotFound) {
			err = img.LoadSnapshot("", s.IDOrName)
		}
	} else {
		err = img.LoadSnapshot(s.ID, s.Name)
	}
	if err != nil {
		return &SnapshotError{Snapshot: s, Err: err}
	}
	return nil
}

// OpenSnapshot opens the image name names read-only, as Open does, and
// loads its internal snapshot s (LoadSnapshot). The error is Open's or a
// *SnapshotError. Close the device when done.
func OpenSnapshot(name, format string, o Options, s Snapshot) (block.Device, error) {
	o.ReadOnly = true
	dev, err := Open(name, format, o)
	if err != nil {
		return nil, err
	}
	if err := LoadSnapshot(dev, s); err != nil {
		dev.Close()
		return nil, err
	}
	return dev, nil
}
