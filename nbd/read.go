package nbd

import (
	"bufio"
	"context"
	"io"
	"time"

	"github.com/ovis-storage/ovis/block"
)

// This file holds NBD_CMD_READ: the inline read on the reader's goroutine
// when the device serves it without waiting, the read in full before the
// reply header, and the hole map of a structured READ reply.

// maxInlineRead is the longest READ tried on the reader's goroutine;
// longer ones gain from running beside others and carry holes worth a
// chunk of their own.
const maxInlineRead = 64 << 10

// readInline answers a READ on the reader's goroutine if the device can
// serve it without waiting for a disk, and reports whether it did.
func (t *transmission) readInline(req request) bool {
	n := int(req.length)
	buf := getBuf(n)
	defer putBuf(buf)
	if !t.fast.ReadNoWait(buf, int64(req.offset)) {
		return false
	}
	// Zeros go out as a hole chunk, as the worker path sends holes it
	// finds by block status: 12 bytes instead of the data, for both ends
	// to copy. Checking the bytes costs less than sending them.
	zero := t.structured && n >= minHole && req.flags&cmdFlagDF == 0 && block.IsZero(buf)
	t.sendInline(func(w *bufio.Writer) error {
		if !t.structured {
			if err := writeSimple(w, req.handle, 0); err != nil {
				return err
			}
			_, err := w.Write(buf)
			return err
		}
		if zero {
			return writeHoleChunk(w, req.handle, replyFlagDone, int64(req.offset), uint32(n))
		}
		return writeDataChunk(w, req.handle, replyFlagDone, int64(req.offset), buf)
	})
	if t.idle > 0 {
		t.lastDone.Store(time.Now().UnixNano())
	}
	return true
}

// read serves NBD_CMD_READ. The data is read in full before the reply
// header goes out, so a device error is always reported as an error
// reply: never after a success header.
func (t *transmission) read(req request) {
	off, n := int64(req.offset), int(req.length)
	if !t.structured {
		buf := getBuf(n)
		defer putBuf(buf)
		if err := readFull(t.ctx, t.dev, buf, off); err != nil {
			t.readFailed(req, err)
			return
		}
		t.send(func(w *bufio.Writer) error {
			if err := writeSimple(w, req.handle, 0); err != nil {
				return err
			}
			_, err := w.Write(buf)
			return err
		})
		return
	}
	if n == 0 {
		t.send(func(w *bufio.Writer) error {
			return writeChunkHeader(w, req.handle, replyFlagDone, replyTypeNone, 0)
		})
		return
	}
	var pieces []piece
	if req.flags&cmdFlagDF != 0 || n < minHole || t.exp.NoHoleMap {
		// Too short to hold a hole worth a chunk of its own: skip the
		// extent lookups.
		pieces = []piece{{off: off, n: int64(n)}}
	} else {
		pieces = mapHoles(t.ctx, t.dev, off, int64(n))
	}
	buf := getBuf(n)
	defer putBuf(buf)
	for _, p := range pieces {
		if p.hole {
			continue
		}
		if err := readFull(t.ctx, t.dev, buf[p.off-off:p.off-off+p.n], p.off); err != nil {
			t.readFailed(req, err)
			return
		}
	}
	t.send(func(w *bufio.Writer) error {
		for i, p := range pieces {
			var fl replyFlags
			if i == len(pieces)-1 {
				fl = replyFlagDone
			}
			if p.hole {
				if err := writeHoleChunk(w, req.handle, fl, p.off, uint32(p.n)); err != nil {
					return err
				}
				continue
			}
			if err := writeDataChunk(w, req.handle, fl, p.off, buf[p.off-off:p.off-off+p.n]); err != nil {
				return err
			}
		}
		return nil
	})
}

// readFull reads len(p) bytes at off. A short read without an error (a
// device bug) is an EIO: pooled buffers hold other requests' bytes, which
// must never reach a client.
func readFull(ctx context.Context, dev block.Device, p []byte, off int64) error {
	n, err := dev.ReadAt(ctx, p, off)
	if err == nil && n != len(p) {
		err = io.ErrUnexpectedEOF
	}
	return err
}

func (t *transmission) readFailed(req request, err error) {
	errno := errnoOf(err, req.typ)
	t.log.Warn("request failed", "cmd", "READ", "offset", req.offset, "length", req.length, "errno", uint32(errno), "err", err)
	t.replyError(req, errno, "READ failed")
}

// piece is a run of a READ reply: data to send or a hole.
type piece struct {
	off, n int64
	hole   bool
}

// mapHoles splits [off, off+n) into data and hole pieces from the
// device's extents, found in one Extents call (StatusZero makes a hole).
// Holes shorter than minHole count as data; past maxReadExtents runs, or
// on a lookup error or runs that do not cover the range, the rest is
// data. The pieces cover the range exactly once, in order, and adjacent
// pieces differ in kind.
func mapHoles(ctx context.Context, dev block.Device, off, n int64) []piece {
	var runs []piece
	add := func(p piece) {
		if k := len(runs) - 1; k >= 0 && runs[k].hole == p.hole {
			runs[k].n += p.n
			return
		}
		runs = append(runs, p)
	}
	var buf [maxReadExtents]block.Extent
	exts, err := dev.Extents(ctx, off, n, buf[:0])
	if err != nil {
		exts = nil
	}
	cur, end := off, off+n
	for i, e := range exts {
		rest := end - cur
		if i == maxReadExtents || e.Length <= 0 || rest <= 0 {
			break
		}
		l := min(e.Length, rest)
		add(piece{off: cur, n: l, hole: e.Status&block.StatusZero != 0})
		cur += l
	}
	if cur < end {
		add(piece{off: cur, n: end - cur})
	}
	// Short holes become data, merged with their neighbours.
	out := runs[:0]
	for _, p := range runs {
		if p.hole && p.n < minHole {
			p.hole = false
		}
		if k := len(out) - 1; k >= 0 && out[k].hole == p.hole {
			out[k].n += p.n
			continue
		}
		out = append(out, p)
	}
	return out
}
