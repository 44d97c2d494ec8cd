package node

import (
	"errors"

	"github.com/ovis-storage/ovis/cluster/object"
	"github.com/ovis-storage/ovis/cluster/store"
)

// What recovery does to the store beyond its plain calls: an installed
// copy or tombstone that is not newer than the local one is no error
// (the local copy is current), and a copy is dropped at the version it
// was seen at.

// putIfNewer installs a copy unless the local one is already at least
// as new.
func putIfNewer(st recoveryStore, id object.ID, version uint64, data []byte) error {
	if err := st.Put(id, version, data); err != nil && !errors.Is(err, store.ErrNotNewer) {
		return err
	}
	return nil
}

// putTombstone makes the local copy a tombstone at version unless it is
// already at least as new.
func putTombstone(st recoveryStore, id object.ID, version uint64) error {
	if err := st.PutTombstone(id, version); err != nil && !errors.Is(err, store.ErrNotNewer) {
		return err
	}
	return nil
}

// dropCopy deletes a copy this node no longer holds for anyone, without
// a tombstone; a write that reached it since it was listed keeps it.
func dropCopy(st recoveryStore, id object.ID) error {
	in, err := st.Stat(id)
	if errors.Is(err, store.ErrNotFound) {
		return nil
	}
	if err != nil {
		return err
	}
	return st.Drop(id, in.Version)
}
