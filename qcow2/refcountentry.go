package qcow2

// SetRefcountEntry sets entry i of the refcount block buf, whose entries
// are bits wide (1, 2, 4, 8, 16, 32 or 64; entries narrower than a byte
// count from its least significant bit), to v, truncated to that width.
// buf must hold entry i. It exists so that tools building refcount blocks
// by hand encode them as the engine does.
func SetRefcountEntry(buf []byte, i int64, bits int, v uint64) {
	setRefcount(buf, i, bits, v)
}

// RefcountEntry returns entry i of the refcount block buf, whose entries
// are bits wide; see SetRefcountEntry.
func RefcountEntry(buf []byte, i int64, bits int) uint64 {
	return getRefcount(buf, i, bits)
}
