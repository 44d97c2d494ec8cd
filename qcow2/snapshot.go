package qcow2

// Snapshot is one entry of the internal snapshot table.
type Snapshot struct {
	L1TableOffset uint64
	L1Size        uint32
	ID            string
	Name          string
}
