package convert

import (
	"context"
	"errors"
	"fmt"
	"sort"

	"github.com/ovis-storage/ovis/block"
)

// concat is several sources read as one: see Concat.
type concat struct {
	parts []block.Device
	// starts[i] is where part i begins; starts[len(parts)] is the size.
	starts []int64
}

var _ block.Device = (*concat)(nil)

// ErrReadOnly is what the writing methods of a Concat device return.
var ErrReadOnly = errors.New("convert: concatenated sources are read-only")

// Concat joins parts, in order, into one read-only device, as qemu-img
// convert reads several source images: each part takes its size rounded
// up to whole 512-byte sectors, and the bytes past a part's end read as
// zeros (and are reported as a hole). Extents never merge runs across a
// part's end. Writes fail with ErrReadOnly; Flush does nothing.
//
// The device owns the parts: its Close closes them all and returns the
// first error. Safe for concurrent use when the parts are.
func Concat(parts ...block.Device) block.Device {
	c := &concat{parts: parts, starts: make([]int64, len(parts)+1)}
	for i, p := range parts {
		c.starts[i+1] = c.starts[i] + (p.Size()+511)&^511
	}
	return c
}

// part returns the index of the part holding off, which is inside c.
func (c *concat) part(off int64) int {
	return sort.Search(len(c.parts), func(i int) bool { return c.starts[i+1] > off })
}

func (c *concat) ReadAt(ctx context.Context, p []byte, off int64) (int, error) {
	if err := block.CheckRange(off, int64(len(p)), c.Size()); err != nil {
		return 0, err
	}
	done := 0
	for done < len(p) {
		at := off + int64(done)
		i := c.part(at)
		rel := at - c.starts[i]
		q := p[done:min(len(p), done+int(c.starts[i+1]-at))]
		have := max(0, min(int64(len(q)), c.parts[i].Size()-rel))
		if have > 0 {
			if _, err := c.parts[i].ReadAt(ctx, q[:have], rel); err != nil {
				return done, err
			}
		}
		clear(q[have:])
		done += len(q)
	}
	return len(p), nil
}

// Extents describes the parts' runs in turn, never merged across a
// part's end; the padding after a part reads as an unallocated hole.
func (c *concat) Extents(ctx context.Context, off, n int64, dst []block.Extent) ([]block.Extent, error) {
	if err := block.CheckRange(off, n, c.Size()); err != nil {
		return dst, err
	}
	for end := off + n; off < end; {
		i := c.part(off)
		rel, partSize := off-c.starts[i], c.parts[i].Size()
		k := min(end, c.starts[i+1]) - off
		if rel >= partSize {
			dst = block.AppendExtent(dst, block.Extent{Length: k, Status: block.StatusHole | block.StatusZero})
			off += k
			continue
		}
		k = min(k, partSize-rel)
		runs, err := c.parts[i].Extents(ctx, rel, k, nil)
		if err != nil {
			return dst, fmt.Errorf("source %d: %w", i+1, err)
		}
		// Runs of different parts stay apart, as the parts are.
		dst = append(dst, runs...)
		off += k
	}
	return dst, nil
}

func (c *concat) Size() int64 { return c.starts[len(c.parts)] }

func (c *concat) WriteAt(context.Context, []byte, int64, block.Flags) (int, error) {
	return 0, ErrReadOnly
}
func (c *concat) WriteZeroes(context.Context, int64, int64, block.Flags) error { return ErrReadOnly }
func (c *concat) Discard(context.Context, int64, int64, block.Flags) error     { return ErrReadOnly }
func (c *concat) Flush(context.Context) error                                  { return nil }

// Close closes every part and returns the first error.
func (c *concat) Close() error {
	var first error
	for _, p := range c.parts {
		if err := p.Close(); err != nil && first == nil {
			first = err
		}
	}
	return first
}
