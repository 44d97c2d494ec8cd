package qcow2

import (
	"encoding/binary"
	"fmt"

	"github.com/ovis-storage/ovis/block"
)

// This file holds the whole-table I/O of the exclusive operations: reading
// a table straight from the file, writing a whole L2 table, writing a new
// table to freshly allocated clusters, and encoding an L1 table.

func (img *Image) readTableFile(off uint64, n int64) ([]byte, error) {
	buf := make([]byte, n)
	if err := block.ReadFull(img.file, buf, int64(off)); err != nil {
		return nil, fmt.Errorf("qcow2: reading table at %#x: %w", off, err)
	}
	return buf, nil
}

// writeTableLocked writes a whole L2 table and drops its cached slices.
func (img *Image) writeTableLocked(off uint64, buf []byte) error {
	img.forgetTableLocked(off)
	if _, err := img.file.WriteAt(buf, int64(off)); err != nil {
		return fmt.Errorf("qcow2: writing L2 table at %#x: %w", off, err)
	}
	return nil
}

// writeNewLocked writes buf to newly allocated clusters and returns
// their offset. Only inside exclusive.
func (img *Image) writeNewLocked(what string, buf []byte) (uint64, error) {
	off, err := img.allocExclusiveLocked(img.clustersFor(int64(len(buf))))
	if err != nil {
		return 0, err
	}
	if _, err := img.file.WriteAt(buf, int64(off)); err != nil {
		return 0, fmt.Errorf("qcow2: writing %s at %#x: %w", what, off, err)
	}
	return off, nil
}

func encodeL1(l1 []uint64, n int) []byte {
	buf := make([]byte, n*8)
	for i := 0; i < len(l1) && i < n; i++ {
		binary.BigEndian.PutUint64(buf[i*8:], l1[i])
	}
	return buf
}
