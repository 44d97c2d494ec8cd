package placement

import "github.com/ovis-storage/ovis/cluster/object"

// Moved reports whether object id, kept in copies replicas, sits on a
// different set of nodes under next than under prev (the order of the
// nodes, which one is primary, does not count). A recovery planner asks
// it for every object it holds when the epoch changes. It allocates
// nothing, and fails as Place does when copies does not fit either map.
func Moved(prev, next *Map, id object.ID, copies int) (bool, error) {
	if err := prev.check(id, copies); err != nil {
		return false, err
	}
	if err := next.check(id, copies); err != nil {
		return false, err
	}
	var a, b [MaxCopies]cand
	na := prev.rank(id, copies, &a)
	nb := next.rank(id, copies, &b)
	if na != nb {
		return true, nil
	}
	for _, x := range a[:na] {
		found := false
		for _, y := range b[:nb] {
			if prev.nodes[x.node].ID == next.nodes[y.node].ID {
				found = true
				break
			}
		}
		if !found {
			return true, nil
		}
	}
	return false, nil
}
