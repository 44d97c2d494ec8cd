package img

import (
	"context"
	"fmt"

	"github.com/ovis-storage/ovis/block"
	"github.com/ovis-storage/ovis/qcow2"
)

// measureSource is the image qemu-img measure sizes a copy of.
type measureSource struct {
	m    block.Mapper
	size int64 // in whole sectors, as QEMU sees it
	// bitmapsSupported: the source can carry persistent bitmaps (a
	// version 3 qcow2 image); bitmaps lists them.
	bitmapsSupported bool
	bitmaps          []bitmapShape
}

// bitmapShape is what the room a bitmap takes depends on.
type bitmapShape struct {
	nameLen     int
	granularity uint64
}

func newMeasureSource(filename string, dev block.Device) (*measureSource, error) {
	m, size, err := sectorMapper(dev)
	if err != nil {
		return nil, err
	}
	s := &measureSource{m: m, size: size}
	if img, ok := block.As[*qcow2.Image](dev); ok {
		h := img.Header()
		s.bitmapsSupported = h.Version >= 3
		list, err := qcow2Bitmaps(filename, &h)
		if err != nil {
			return nil, fmt.Errorf("Could not open '%s': %s", filename, err)
		}
		for _, b := range list {
			d := b.(*qdict)
			s.bitmaps = append(s.bitmaps, bitmapShape{
				nameLen:     len(d.vals["name"].(string)),
				granularity: uint64(d.vals["granularity"].(int64)),
			})
		}
	}
	return s, nil
}

// dataBytes is the data a copy must allocate, in clusters of cs bytes, as
// qcow2_measure counts it: every cluster that holds data which does not
// read as zeros, in any layer of the chain. It stops once ctx is done.
func (s *measureSource) dataBytes(ctx context.Context, cs uint64) (uint64, error) {
	var required uint64
	for off := int64(0); off < s.size; {
		if err := ctx.Err(); err != nil {
			return 0, err
		}
		e, err := s.m.MapAt(ctx, off, s.size-off)
		if err != nil {
			return 0, fmt.Errorf("Unable to get block status: %s", strerror(err))
		}
		n := e.Length
		if !e.Zero && e.Data && e.Present {
			// Extend to the end of the cluster for the next step.
			n = int64(roundUp(uint64(off+n), cs)) - off
			required += uint64(off)%cs + uint64(n)
		}
		off += n
	}
	return required, nil
}

// bitmapBytes is QEMU's qcow2_get_persistent_dirty_bitmap_size: each
// bitmap whole, its table, and the directory, in clusters of cs bytes.
func (s *measureSource) bitmapBytes(cs uint64) uint64 {
	var total, dir uint64
	for _, b := range s.bitmaps {
		bits := divRoundUp(uint64(s.size), b.granularity)
		clusters := divRoundUp(divRoundUp(bits, 8), cs)
		total += clusters*cs + roundUp(clusters*8, cs)
		dir += roundUp(24+uint64(b.nameLen), 8)
	}
	return total + roundUp(dir, cs)
}
