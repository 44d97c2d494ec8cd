package img

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"

	"github.com/ovis-storage/ovis/qcow2"
)

// This file changes a qcow2 image that is closed, through the header
// alone, for the one step the engine has no call for yet: emptying it
// (commit), as QEMU's make_completely_empty lays out a fresh set of tables
// after the header. (Rebase now changes the backing file on the open,
// locked image.)

// errNoHeaderRoom is QEMU's ENOSPC: the backing file name and the header
// extensions do not fit in the first cluster.
var errNoHeaderRoom = errors.New("No space left in the file header")

// readHeader reads and parses the header of the qcow2 image at path.
func readHeader(f *os.File) (*qcow2.Header, error) {
	st, err := f.Stat()
	if err != nil {
		return nil, err
	}
	buf := make([]byte, min(st.Size(), 1<<qcow2.MaxClusterBits))
	if _, err := f.ReadAt(buf, 0); err != nil {
		return nil, err
	}
	return qcow2.ParseHeader(buf, st.Size())
}

// canMakeEmpty reports whether makeEmpty can empty the image with this
// header: QEMU's conditions for make_completely_empty (a version 3
// image without snapshots, bitmaps or external data file whose new
// tables fit in one refcount block).
func canMakeEmpty(h *qcow2.Header) bool {
	cs := h.ClusterSize()
	l1Clusters := (int64(h.L1Size)*8 + cs - 1) / cs
	hasBitmaps := false
	for _, e := range h.Extensions {
		if e.Type == 0x23852875 {
			hasBitmaps = true
		}
	}
	return h.Version >= 3 && h.NbSnapshots == 0 && !hasBitmaps && !h.HasDataFile() &&
		3+l1Clusters <= cs*8/int64(h.RefcountBits())
}

// makeEmpty drops every cluster of the closed qcow2 image at path, as
// QEMU's make_completely_empty does: the header stays in cluster 0, a
// refcount table follows in cluster 1, its one refcount block in cluster
// 2 and an empty L1 table of the same size from cluster 3, and the file
// ends there. The image then reads entirely from its backing file. The
// header is marked dirty while the tables are rewritten, so that a crash
// in between leaves an image QEMU repairs.
func makeEmpty(path string) error {
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	h, err := readHeader(f)
	if err != nil {
		return err
	}
	if !canMakeEmpty(h) {
		return fmt.Errorf("emptying %s: %w", path, errors.ErrUnsupported)
	}
	cs := h.ClusterSize()
	l1Clusters := (int64(h.L1Size)*8 + cs - 1) / cs
	write := func(h *qcow2.Header) error {
		buf, err := h.Encode()
		if err != nil {
			return err
		}
		if _, err := f.WriteAt(buf, 0); err != nil {
			return err
		}
		return f.Sync()
	}
	clean := h.IncompatibleFeatures
	h.IncompatibleFeatures |= qcow2.IncompatDirty
	if err := write(h); err != nil {
		return err
	}
	// Cluster 1: the refcount table; 2: its block; 3...: the L1 table.
	tables := make([]byte, (2+l1Clusters)*cs)
	binary.BigEndian.PutUint64(tables, uint64(2*cs))
	rb := tables[cs : 2*cs]
	bits := h.RefcountBits()
	for i := int64(0); i < 3+l1Clusters; i++ {
		qcow2.SetRefcountEntry(rb, i, bits, 1)
	}
	if _, err := f.WriteAt(tables, cs); err != nil {
		return err
	}
	if err := f.Truncate((3 + l1Clusters) * cs); err != nil {
		return err
	}
	if err := f.Sync(); err != nil {
		return err
	}
	h.L1TableOffset = uint64(3 * cs)
	h.RefcountTableOffset = uint64(cs)
	h.RefcountTableClusters = 1
	h.IncompatibleFeatures = clean &^ qcow2.IncompatDirty
	return write(h)
}
