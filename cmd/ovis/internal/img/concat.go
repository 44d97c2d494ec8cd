package img

import (
	"errors"
	"fmt"
	"sort"

	"github.com/ovis-storage/ovis/block"
)

// concat is what qemu-img convert reads when it is given several source
// images: one read-only device whose parts follow each other. Each part
// takes its size rounded up to whole 512-byte sectors (QEMU counts
// sources in sectors), and the bytes past a part's end read as zeros.
//
// Safe for concurrent use when its parts are.
type concat struct {
	parts []block.Device
	// starts[i] is where part i begins; starts[len(parts)] is the size.
	starts []int64
}

var _ block.Device = (*concat)(nil)

var errConcatReadOnly = errors.New("concatenated sources are read-only")

// newConcat joins parts in order. It takes ownership of them: Close
// closes them all.
func newConcat(parts []block.Device) *concat {
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

func (c *concat) ReadAt(p []byte, off int64) (int, error) {
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
			if _, err := c.parts[i].ReadAt(q[:have], rel); err != nil {
				return done, err
			}
		}
		clear(q[have:])
		done += len(q)
	}
	return len(p), nil
}

// Extent describes a run that stays inside one part; the padding after a
// part reads as an unallocated hole.
func (c *concat) Extent(off, n int64) (block.Extent, error) {
	if err := block.CheckRange(off, n, c.Size()); err != nil || n == 0 {
		return block.Extent{}, err
	}
	i := c.part(off)
	rel, partSize := off-c.starts[i], c.parts[i].Size()
	n = min(n, c.starts[i+1]-off)
	if rel >= partSize {
		return block.Extent{Length: n, Status: block.StatusHole | block.StatusZero}, nil
	}
	e, err := c.parts[i].Extent(rel, min(n, partSize-rel))
	if err != nil {
		return e, fmt.Errorf("source %d: %w", i+1, err)
	}
	return e, nil
}

func (c *concat) Size() int64 { return c.starts[len(c.parts)] }

func (c *concat) WriteAt([]byte, int64, bool) (int, error)   { return 0, errConcatReadOnly }
func (c *concat) WriteZeroes(int64, int64, bool, bool) error { return errConcatReadOnly }
func (c *concat) Discard(int64, int64) error                 { return errConcatReadOnly }
func (c *concat) Flush() error                               { return nil }

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
