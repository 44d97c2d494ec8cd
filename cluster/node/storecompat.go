package node

import (
	"errors"
	"fmt"

	"github.com/ovis-storage/ovis/cluster/membership"
	"github.com/ovis-storage/ovis/cluster/object"
	"github.com/ovis-storage/ovis/cluster/store"
)

// What recovery needs of the store, in one place.

func isNotFound(err error) bool { return errors.Is(err, membership.ErrNoVDI) }

func infoTombstone(in store.Info) bool { return false }

// putIfNewer installs a copy unless the local one is already at least
// as new.
func putIfNewer(st *store.Store, id object.ID, version uint64, data []byte) error {
	if in, err := st.Stat(id); err == nil && !in.Suspect && in.Version >= version {
		return nil
	}
	return st.Put(id, version, data)
}

func putTombstone(st *store.Store, id object.ID, version uint64) error {
	return fmt.Errorf("object %s: tombstones are not kept by this store yet", id)
}

// dropCopy deletes a copy this node no longer holds for anyone.
func dropCopy(st *store.Store, id object.ID) error {
	return st.Remove(id, st.Token(id.VDI()))
}

// replaceCopy installs a copy whatever the local one's version (check
// --repair of copies that differ at equal versions).
func replaceCopy(st *store.Store, id object.ID, version uint64, data []byte) error {
	return st.Put(id, version, data)
}
