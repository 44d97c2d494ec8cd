package membership

import (
	"fmt"
	"strconv"
	"strings"

	"github.com/ovis-storage/ovis/cluster/object"
)

// The key layout below the prefix; docs/membership.md describes each
// key and its value byte by byte. Numbers in keys are fixed-width hex so
// that etcd's byte order is numeric order.
const (
	keyFormat    = "format"
	keyNodes     = "nodes/"
	keyEpoch     = "epoch"
	keyEpochs    = "epochs/"
	keyVDINext   = "vdi/next"
	keyVDIByName = "vdi/name/"
	keyVDIByID   = "vdi/id/"
	keyVDITomb   = "vdi/tomb/"
	keyLocks     = "locks/"
	keyOwners    = "owners/"
	keyReach     = "reach/"
)

// keys renders the layout under one prefix.
type keys struct{ prefix string }

func (k keys) format() string             { return k.prefix + keyFormat }
func (k keys) nodes() string              { return k.prefix + keyNodes }
func (k keys) node(id string) string      { return k.prefix + keyNodes + id }
func (k keys) epoch() string              { return k.prefix + keyEpoch }
func (k keys) epochs() string             { return k.prefix + keyEpochs }
func (k keys) epochAt(e uint64) string    { return fmt.Sprintf("%s%s%016x", k.prefix, keyEpochs, e) }
func (k keys) vdiNext() string            { return k.prefix + keyVDINext }
func (k keys) vdiNames() string           { return k.prefix + keyVDIByName }
func (k keys) vdiName(name string) string { return k.prefix + keyVDIByName + name }
func (k keys) vdiID(id object.VDI) string {
	return fmt.Sprintf("%s%s%08x", k.prefix, keyVDIByID, uint32(id))
}
func (k keys) tombs() string { return k.prefix + keyVDITomb }
func (k keys) tomb(id object.VDI) string {
	return fmt.Sprintf("%s%s%08x", k.prefix, keyVDITomb, uint32(id))
}
func (k keys) locks() string { return k.prefix + keyLocks }
func (k keys) lock(id object.VDI) string {
	return fmt.Sprintf("%s%s%08x", k.prefix, keyLocks, uint32(id))
}
func (k keys) owner(id object.VDI) string {
	return fmt.Sprintf("%s%s%08x", k.prefix, keyOwners, uint32(id))
}
func (k keys) reaches() string { return k.prefix + keyReach }
func (k keys) reach(target, reporter string) string {
	return k.prefix + keyReach + target + "/" + reporter
}
func (k keys) nodeID(key string) string { return strings.TrimPrefix(key, k.nodes()) }

// parseEpochKey reads the epoch number of an epochs/ key.
func (k keys) parseEpochKey(key string) (uint64, error) {
	s, ok := strings.CutPrefix(key, k.epochs())
	if !ok || len(s) != 16 {
		return 0, fmt.Errorf("membership: epoch key %q: want %s and 16 hex digits", key, k.epochs())
	}
	e, err := strconv.ParseUint(s, 16, 64)
	if err != nil {
		return 0, fmt.Errorf("membership: epoch key %q: %w", key, err)
	}
	if fmt.Sprintf("%016x", e) != s {
		return 0, fmt.Errorf("membership: epoch key %q: want lower-case hex", key)
	}
	return e, nil
}
