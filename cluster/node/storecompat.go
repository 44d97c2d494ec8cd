package node

import (
	"errors"

	"github.com/ovis-storage/ovis/cluster/membership"
	"github.com/ovis-storage/ovis/cluster/object"
	"github.com/ovis-storage/ovis/cluster/store"
)

// What recovery needs of the store, in one place.

func isNotFound(err error) bool { return errors.Is(err, membership.ErrNoVDI) }

func infoTombstone(in store.Info) bool { return in.Tombstone }

// putIfNewer installs a copy unless the local one is already at least
// as new.
func putIfNewer(st *store.Store, id object.ID, version uint64, data []byte) error {
	if err := st.Put(id, version, data); err != nil && !errors.Is(err, store.ErrNotNewer) {
		return err
	}
	return nil
}

// putTombstone makes the local copy a tombstone at version unless it is
// already at least as new.
func putTombstone(st *store.Store, id object.ID, version uint64) error {
	if err := st.PutTombstone(id, version); err != nil && !errors.Is(err, store.ErrNotNewer) {
		return err
	}
	return nil
}

// dropCopy deletes a copy this node no longer holds for anyone, without
// a tombstone; a write that reached it since it was listed keeps it.
func dropCopy(st *store.Store, id object.ID) error {
	in, err := st.Stat(id)
	if errors.Is(err, store.ErrNotFound) {
		return nil
	}
	if err != nil {
		return err
	}
	return st.Drop(id, in.Version)
}

// replaceCopy installs a copy whatever the local one's version (check
// --repair of copies that differ at equal versions).
func replaceCopy(st *store.Store, id object.ID, version uint64, data []byte) error {
	return st.Replace(id, version, data)
}
