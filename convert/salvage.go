package convert

import (
	"context"

	"github.com/ovis-storage/ovis/block"
)

// read fills p from the source at off. With salvage a failed read is made
// again one sector at a time, as qemu-img convert --salvage does, and the
// sectors that still fail are zeroed.
func (c *copier) read(ctx context.Context, p []byte, off int64) error {
	_, err := c.src.ReadAt(ctx, p, off)
	switch {
	case err == nil:
		return nil
	case !c.salvage:
		return &Error{OpRead, off, err}
	}
	for i := 0; i < len(p); i += 512 {
		q := p[i:min(i+512, len(p))]
		if _, err := c.src.ReadAt(ctx, q, off+int64(i)); err != nil {
			c.report(&Error{OpRead, off + int64(i), err})
			clear(q)
		}
	}
	return nil
}

// salvageExtent finds the status at off after asking for want bytes
// failed with err: it asks for a quarter as much until one sector is
// left, which is then taken as data (to be read, and zeroed if that fails
// too).
func (c *copier) salvageExtent(ctx context.Context, off, want int64, err error) block.Extent {
	for n := want; n > 512; {
		n = (n/512 + 3) / 4 * 512
		var e block.Extent
		if e, err = block.FirstExtent(ctx, c.src, off, n); err == nil {
			return e
		}
	}
	c.report(&Error{OpBlockStatus, off, err})
	return block.Extent{Length: min(512, c.src.Size()-off), Status: block.StatusData, Depth: 1}
}

// report hands a salvaged failure to Options.Salvaged, one at a time.
func (c *copier) report(err *Error) {
	if c.salvaged == nil {
		return
	}
	c.salvageMu.Lock()
	defer c.salvageMu.Unlock()
	c.salvaged(err)
}
