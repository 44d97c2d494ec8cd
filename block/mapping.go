package block

import (
	"context"
	"errors"
	"math"

	"golang.org/x/sys/unix"
)

// MapExtent describes where a run of a device's data lives, as qemu-img
// map reports it.
type MapExtent struct {
	Length int64
	// Depth is the layer that decided the run's status: 0 for the image
	// itself, 1 for its backing file, and so on.
	Depth int
	// Present is set when some layer allocates the run (data or zeros).
	Present bool
	Zero    bool
	Data    bool
	// Offset is the run's offset in File, or -1 when it has none (zeros
	// without a host cluster, compressed data).
	Offset int64
	// File is the name of the file that holds the run.
	File string
}

// Mapper is implemented by devices that can say where their data lives
// (qemu-img map).
type Mapper interface {
	MapAt(ctx context.Context, off, n int64) (MapExtent, error)
}

// FileHole reports whether [off, off+n) of f starts with a hole and how
// long that hole (or data) run is, from SEEK_DATA/SEEK_HOLE. Files that
// cannot tell report data.
func FileHole(f File, off, n int64) (hole bool, length int64) {
	if n <= 0 {
		return false, n
	}
	hole, end, ok := FileRun(f, off)
	if !ok {
		return false, n
	}
	return hole, min(n, end-off)
}

// FileRun reports whether the byte of f at off lies in a hole or in data,
// and where that run ends (math.MaxInt64 for a hole that runs to the end
// of the file and past it). ok is false when the file cannot tell (no
// descriptor, or no SEEK_DATA): callers treat that as data.
func FileRun(f File, off int64) (hole bool, end int64, ok bool) {
	fd, has := f.(interface{ Fd() uintptr })
	if !has {
		return false, 0, false
	}
	d, err := unix.Seek(int(fd.Fd()), off, unix.SEEK_DATA)
	switch {
	case errors.Is(err, unix.ENXIO):
		return true, math.MaxInt64, true
	case err != nil:
		return false, 0, false
	case d > off:
		return true, d, true
	}
	h, err := unix.Seek(int(fd.Fd()), off, unix.SEEK_HOLE)
	if err != nil || h <= off {
		return false, 0, false
	}
	return false, h, true
}

// MapAt reports where [off, off+n) of a raw file lives: at the same
// offset of the file itself, holes as zeros, as qemu-img map shows raw
// images.
func (r *Raw) MapAt(ctx context.Context, off, n int64) (MapExtent, error) {
	e, err := FirstExtent(ctx, r, off, n)
	if err != nil {
		return MapExtent{}, err
	}
	m := MapExtent{Length: e.Length, Present: true, Offset: off, File: fileName(r.f)}
	if e.Status&StatusZero != 0 {
		m.Zero = true
	} else {
		m.Data = true
	}
	return m, nil
}

func fileName(f File) string {
	if n, ok := f.(interface{ Name() string }); ok {
		return n.Name()
	}
	return ""
}
