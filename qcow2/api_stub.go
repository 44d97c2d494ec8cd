package qcow2

import (
	"errors"

	"github.com/ovis-storage/ovis/block"
)

// TEMPORARY: compile-time surface while the engine is written.

var errTODO = errors.New("qcow2: not implemented yet")

// Image is an open qcow2 image.
type Image struct{}

var _ block.Device = (*Image)(nil)

// Open opens the qcow2 image at path.
func Open(path string, o Options) (*Image, error) { return nil, errTODO }

// Create makes a new qcow2 image at path.
func Create(path string, o CreateOptions) error { return errTODO }

// OpenDevice opens path as format ("qcow2", "raw", or "" to probe).
func OpenDevice(path, format string, o Options) (block.Device, error) { return nil, errTODO }

// Probe returns "qcow2" or "raw" for the file at path.
func Probe(path string) (string, error) { return "", errTODO }

func (img *Image) ReadAt(p []byte, off int64) (int, error)            { return 0, errTODO }
func (img *Image) WriteAt(p []byte, off int64, fua bool) (int, error) { return 0, errTODO }
func (img *Image) WriteZeroes(off, n int64, mayUnmap, fua bool) error { return errTODO }
func (img *Image) Discard(off, n int64) error                         { return errTODO }
func (img *Image) Flush() error                                       { return errTODO }
func (img *Image) Extent(off, n int64) (block.Extent, error)          { return block.Extent{}, errTODO }
func (img *Image) Size() int64                                        { return 0 }
func (img *Image) Close() error                                       { return errTODO }

// WriteCompressed writes one whole guest cluster compressed. off must be
// cluster aligned and len(p) the cluster size (or the tail at the end).
func (img *Image) WriteCompressed(p []byte, off int64) error { return errTODO }

// Header returns a copy of the image header.
func (img *Image) Header() Header { return Header{} }

// Snapshots returns the internal snapshot table.
func (img *Image) Snapshots() []Snapshot { return nil }

// Backing returns the open backing device, nil if none.
func (img *Image) Backing() block.Device { return nil }

// BackingPath returns the backing file name resolved against the image's folder.
func (img *Image) BackingPath() string { return "" }

// ClusterSize returns the cluster size in bytes.
func (img *Image) ClusterSize() int64 { return 0 }
