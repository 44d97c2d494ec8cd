package nbd

import (
	"bufio"
	"context"
	"time"

	"github.com/ovis-storage/ovis/block"
)

// This file holds NBD_CMD_BLOCK_STATUS: the runs of equal status of the
// device (base:allocation) or of a dirty bitmap (qemu:dirty-bitmap), and
// their encoding as extent descriptors.

// statusRun is one device extent as BLOCK_STATUS reports it.
type statusRun struct {
	n     uint32
	flags uint32 // base:allocation
	depth uint32 // qemu:allocation-depth
}

// blockStatus serves NBD_CMD_BLOCK_STATUS: one BLOCK_STATUS chunk per
// negotiated context, each with the runs of equal status from
// Device.Extent. The runs never exceed the request, never have zero
// length, and with REQ_ONE there is exactly one per context.
func (t *transmission) blockStatus(req request) {
	start := time.Now()
	runs, err := statusRuns(t.ctx, t.dev, int64(req.offset), int64(req.length), req.flags&cmdFlagReqOne != 0)
	if f := t.srv.cfg.BlockStatus; f != nil {
		f(int64(req.length), time.Since(start), err)
	}
	if err != nil {
		errno := errnoOf(err, req.typ)
		t.log.Warn("request failed", "cmd", "BLOCK_STATUS", "offset", req.offset, "length", req.length, "errno", uint32(errno), "err", err)
		t.replyError(req, errno, "BLOCK_STATUS failed")
		return
	}
	chunks := make([][]byte, len(t.contexts))
	for i, c := range t.contexts {
		if c.bitmap == nil {
			chunks[i] = encodeStatus(c, runs)
			continue
		}
		bruns, err := bitmapRuns(c.bitmap, int64(req.offset), int64(req.length), req.flags&cmdFlagReqOne != 0)
		if err != nil {
			errno := errnoOf(err, req.typ)
			t.log.Warn("request failed", "cmd", "BLOCK_STATUS", "bitmap", c.bitmap.Name, "offset", req.offset, "errno", uint32(errno), "err", err)
			t.replyError(req, errno, "BLOCK_STATUS failed")
			return
		}
		chunks[i] = encodeStatus(c, bruns)
	}
	t.send(func(w *bufio.Writer) error {
		for i, b := range chunks {
			var fl replyFlags
			if i == len(chunks)-1 {
				fl = replyFlagDone
			}
			if err := writeChunkHeader(w, req.handle, fl, replyTypeBlockStatus, uint32(len(b))); err != nil {
				return err
			}
			if _, err := w.Write(b); err != nil {
				return err
			}
		}
		return nil
	})
}

// statusRuns describes [off, off+n) with Device.Extents: at most
// maxStatusExtents runs, one with reqOne. The range is asked for in
// pieces of statusPiece bytes, so that one call's runs stay bounded
// whatever the client asks; the walk stops once it has enough runs. An
// error on the first piece is returned; a later one ends the walk early,
// which the spec allows. An extent of no length (a device bug) reports
// the rest of the range as data at depth 1, the status a server may
// always report.
func statusRuns(ctx context.Context, dev block.Device, off, n int64, reqOne bool) ([]statusRun, error) {
	var runs []statusRun
	var exts []block.Extent
	cur, end := off, off+n
	for cur < end && len(runs) < maxStatusExtents {
		var err error
		exts, err = dev.Extents(ctx, cur, min(end-cur, statusPiece), exts[:0])
		if err != nil {
			if len(runs) == 0 {
				return nil, err
			}
			break
		}
		if len(exts) == 0 {
			exts = append(exts, block.Extent{})
		}
		for _, e := range exts {
			if cur >= end || len(runs) >= maxStatusExtents {
				break
			}
			cur, runs = addStatusRun(runs, e, cur, end)
			if reqOne {
				return runs, nil
			}
		}
	}
	return runs, nil
}

// statusPiece is the most of the device one Extents call of BLOCK_STATUS
// covers: 64 MiB, at most a few thousand runs in an image of 64 KiB
// clusters.
const statusPiece = 64 << 20

// addStatusRun appends extent e, which starts at cur, and returns where
// the next run starts.
func addStatusRun(runs []statusRun, e block.Extent, cur, end int64) (int64, []statusRun) {
	r := statusRun{depth: uint32(max(e.Depth, 0))}
	l := min(e.Length, end-cur)
	if l <= 0 {
		l, r.depth = end-cur, 1
	} else {
		if e.Status&block.StatusHole != 0 {
			r.flags |= stateHole
		}
		if e.Status&block.StatusZero != 0 {
			r.flags |= stateZero
		}
	}
	r.n = uint32(l)
	return cur + l, append(runs, r)
}

// bitmapRuns walks [off, off+n) of a dirty bitmap as statusRuns walks
// the device: flags are stateDirty or 0.
func bitmapRuns(b *ExportBitmap, off, n int64, reqOne bool) ([]statusRun, error) {
	var runs []statusRun
	cur, end := off, off+n
	for cur < end && len(runs) < maxStatusExtents {
		rest := end - cur
		l, dirty, err := b.Extent(cur, rest)
		if err != nil {
			if len(runs) == 0 {
				return nil, err
			}
			break
		}
		r := statusRun{}
		if l <= 0 || l > rest {
			l, dirty = rest, dirty || l <= 0
		}
		if dirty {
			r.flags = stateDirty
		}
		r.n = uint32(l)
		runs = append(runs, r)
		cur += l
		if reqOne {
			break
		}
	}
	return runs, nil
}

// encodeStatus builds the payload of a BLOCK_STATUS chunk for context c:
// the context id, then (length, flags) descriptors with adjacent runs of
// equal flags merged.
func encodeStatus(c metaContext, runs []statusRun) []byte {
	b := make([]byte, 4, 4+8*len(runs))
	be.PutUint32(b, c.id)
	var curLen, curFlags uint32
	flush := func() {
		if curLen > 0 {
			b = be.AppendUint32(b, curLen)
			b = be.AppendUint32(b, curFlags)
		}
	}
	for _, r := range runs {
		f := r.flags
		if c.id == idAllocDepth {
			f = r.depth
		}
		if curLen > 0 && f == curFlags {
			curLen += r.n
			continue
		}
		flush()
		curLen, curFlags = r.n, f
	}
	flush()
	return b
}
