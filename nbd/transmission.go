package nbd

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/ovis-storage/ovis/block"
)

// maxDiscard is the longest WRITE payload the server reads and throws
// away to stay in sync after refusing the request (too long, out of
// range, read-only export). A longer refused payload ends the connection
// after the error reply instead: reading gigabytes only to drop them is
// the denial of service the spec lets a server refuse.
const maxDiscard = 64 << 20

// firstPayloadBuf is the buffer a WRITE payload longer than it starts in;
// the buffer doubles as the bytes arrive, so that memory follows what the
// client actually sent rather than what its header claims. Payloads up to
// this size, most guest writes, are read with no copy.
const firstPayloadBuf = 64 << 10

// discardPiece is how much of a refused payload is dropped per read.
const discardPiece = 1 << 20

// readReserve is the largest READ a connection may have in service outside
// Config.MaxReadBufferBytes, one at a time: a connection that reads its
// replies is served even while others hold all of the shared bound.
const readReserve = 1 << 20

// errIdle ends a connection that stayed idle for Config.IdleTimeout.
var errIdle = errors.New("nbd: idle timeout")

// Limits on the work one reply does.
const (
	// maxStatusExtents caps the device extents one BLOCK_STATUS reply
	// describes; the client asks again for the rest.
	maxStatusExtents = 1024
	// maxReadExtents caps the Extent lookups one structured READ makes to
	// find holes; the rest of the range is sent as data.
	maxReadExtents = 64
	// minHole is the shortest zero run sent as OFFSET_HOLE; shorter ones
	// go out as data, which costs less than the extra chunk.
	minHole = 4096
)

// transmission serves the requests of one connection after the
// handshake.
//
// One goroutine (serve) reads requests; each valid request runs on its
// own goroutine, at most Config.MaxInFlight at once and at most twice
// Config.MaxPayload bytes of buffers (budget); READ buffers also count
// against the server's Config.MaxReadBufferBytes (Server.readMem).
// Replies are written under wmu in completion order.
//
// With Config.IdleTimeout, every wait on the client is bounded: the
// reader re-arms the read deadline before each header and each piece of
// a payload, and every reply write sets the write deadline. A header
// that does not come in time ends the connection only when no request is
// in service.
//
// Locking: wmu guards w and werr and is held only to write replies. The
// budgets' mutexes are leaves; the reader takes budget before
// srv.readMem.
type transmission struct {
	srv  *Server
	exp  *Export
	dev  block.Device
	raw  net.Conn // the socket: closing it is the hard disconnect
	conn net.Conn // raw or the TLS connection over it
	r    *bufio.Reader
	log  *slog.Logger
	// idle is Config.IdleTimeout; 0 means none.
	idle time.Duration

	sess       session
	structured bool
	contexts   []metaContext

	budget   budget
	handlers sync.WaitGroup
	// jobs hands a request to a worker waiting for one; done ends the
	// waiting workers once the reader has stopped and the last request
	// is finished. Workers are kept rather than a goroutine started per
	// request, whose stack would grow afresh each time (a tenth of the
	// CPU time of small reads).
	jobs chan job
	done chan struct{}
	// fast is the device's no-wait read, if it has one: reads it can
	// serve from memory are answered on the reader's goroutine.
	fast block.NoWaitReader
	// held is set while replies written on the reader's goroutine wait
	// in w for the requests buffered behind them (sendInline).
	held atomic.Bool

	// pending counts replies waiting for wmu; the last one flushes.
	pending atomic.Int32
	wmu     sync.Mutex
	w       *bufio.Writer
	// werr is the first write error; later replies are dropped.
	werr error

	// dirty is set when a write completed since the last good flush;
	// the connection flushes the device on the way out if it is.
	dirty atomic.Bool
	// reserved is set while a READ is in service on the connection's
	// reserve (readReserve) rather than the server's shared bound; set by
	// the reader, cleared by the handler.
	reserved atomic.Bool
	// lastDone is when a request last finished (Unix nanoseconds), for
	// the idle timeout.
	lastDone atomic.Int64
}

func newTransmission(s *Server, raw net.Conn, n *negotiated, log *slog.Logger) *transmission {
	t := &transmission{
		srv:  s,
		exp:  n.export,
		dev:  n.export.Device,
		raw:  raw,
		conn: n.conn,
		r:    n.r,
		w:    n.w,
		log:  log,
		idle: s.cfg.IdleTimeout,
		sess: session{
			size:       uint64(n.export.Device.Size()),
			flags:      n.flags,
			maxPayload: uint32(s.cfg.MaxPayload),
			contexts:   len(n.contexts),
		},
		structured: n.structured,
		contexts:   n.contexts,
	}
	t.budget.init(s.cfg.MaxInFlight, 2*int64(s.cfg.MaxPayload))
	t.jobs = make(chan job)
	t.done = make(chan struct{})
	t.fast, _ = n.export.Device.(block.NoWaitReader)
	return t
}

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

// sendInline writes a reply made on the reader's goroutine. While more
// requests are already buffered it leaves the reply in w, so that a burst
// answered at once goes out in one write, as through a corked socket;
// flushHeld sends it before the reader waits for the client.
func (t *transmission) sendInline(fn func(w *bufio.Writer) error) {
	t.wmu.Lock()
	defer t.wmu.Unlock()
	if t.werr != nil {
		return
	}
	t.armWrite()
	err := fn(t.w)
	if err == nil {
		if t.r.Buffered() >= requestHeaderLen {
			t.held.Store(true)
			return
		}
		err = t.w.Flush()
		t.held.Store(false)
	}
	if err != nil {
		t.werr = err
		t.raw.Close()
	}
}

// flushHeld sends replies sendInline left in w. The reader calls it before
// any read that may wait for the client.
func (t *transmission) flushHeld() {
	if !t.held.Load() {
		return
	}
	t.wmu.Lock()
	defer t.wmu.Unlock()
	if !t.held.Load() || t.werr != nil {
		return
	}
	t.held.Store(false)
	t.armWrite()
	if err := t.w.Flush(); err != nil {
		t.werr = err
		t.raw.Close()
	}
}

// job is one admitted request for a worker.
type job struct {
	req     request
	payload []byte
	weight  int64
	shared  bool
}

// dispatch runs j on an idle worker, or on a new one when none waits.
// There are never more workers than requests in service at the peak,
// which the budget bounds.
func (t *transmission) dispatch(j job) {
	t.handlers.Add(1)
	select {
	case t.jobs <- j:
	default:
		go t.worker(j)
	}
}

// worker serves j, then further jobs, until the connection is done.
func (t *transmission) worker(j job) {
	for {
		t.handle(j.req, j.payload, j.weight, j.shared)
		select {
		case j = <-t.jobs:
		case <-t.done:
			return
		}
	}
}

// serve reads requests until the client disconnects (NBD_CMD_DISC or a
// closed socket), the stream breaks, or Shutdown stops the reading. Then
// it waits for the requests in service, flushes a dirty device and closes
// the connection.
func (t *transmission) serve() {
	reason, graceful := t.readLoop()
	t.handlers.Wait()
	close(t.done)
	if t.dirty.Load() {
		if err := t.dev.Flush(); err != nil {
			t.log.Warn("flush on disconnect failed", "err", err)
		}
	}
	t.wmu.Lock()
	if t.werr == nil {
		t.armWrite()
		t.werr = t.w.Flush()
	}
	t.wmu.Unlock()
	if graceful && t.werr == nil {
		t.conn.Close() // sends TLS close_notify, then closes raw
	}
	t.raw.Close()
	t.log.Debug("connection closed", "reason", reason)
}

// armRead bounds the next read from the client by the idle timeout.
func (t *transmission) armRead() {
	if t.idle > 0 {
		t.raw.SetReadDeadline(time.Now().Add(t.idle))
	}
}

// armWrite bounds the next reply write by the idle timeout.
func (t *transmission) armWrite() {
	if t.idle > 0 {
		t.raw.SetWriteDeadline(time.Now().Add(t.idle))
	}
}

// readHeader reads the next request header. With an idle timeout, a wait
// that times out before the first byte starts over while a request is in
// service or one finished less than the timeout ago, and is errIdle
// otherwise; a header cut short by the timeout ends the connection. The
// deadline is set before the shutdown flag is checked, so that Shutdown's
// interruption is never lost.
func (t *transmission) readHeader(hdr *[requestHeaderLen]byte) error {
	if t.r.Buffered() < requestHeaderLen {
		t.flushHeld()
	}
	deadline := time.Now().Add(t.idle)
	for {
		if t.idle > 0 {
			t.raw.SetReadDeadline(deadline)
		}
		if t.srv.shuttingDown() {
			return ErrServerClosed
		}
		n, err := io.ReadFull(t.r, hdr[:])
		if err == nil || n != 0 || t.idle == 0 || !isTimeout(err) || t.srv.shuttingDown() {
			return err
		}
		now := time.Now()
		if t.budget.busy() {
			deadline = now.Add(t.idle)
			continue
		}
		if last := time.Unix(0, t.lastDone.Load()); now.Sub(last) < t.idle {
			deadline = last.Add(t.idle)
			continue
		}
		return errIdle
	}
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

// readLoop is the request reader. It returns why it stopped and whether
// the connection may be closed gracefully.
func (t *transmission) readLoop() (reason string, graceful bool) {
	var hdr [requestHeaderLen]byte
	for {
		if err := t.readHeader(&hdr); err != nil {
			switch {
			case t.srv.shuttingDown():
				return "shutdown", true
			case errors.Is(err, io.EOF):
				return "client closed", true
			case errors.Is(err, errIdle):
				return "idle", true
			}
			return "read failed: " + err.Error(), false
		}
		req, ok := parseRequest(&hdr)
		if !ok {
			t.log.Info("bad request magic", "header", fmt.Sprintf("%x", hdr[:8]))
			return "bad magic", false
		}
		if req.typ == cmdDisc {
			return "disc", true
		}
		errno := validate(req, t.sess)
		plen := payloadLen(req)
		if errno != 0 {
			t.log.Debug("request refused", "cmd", req.typ.String(), "offset", req.offset, "length", req.length, "flags", uint16(req.flags), "errno", uint32(errno))
			if plen > 0 {
				if plen > maxDiscard {
					t.replyError(req, errno, "request too long")
					return "refused payload too long to skip", false
				}
				if err := t.discard(int64(plen)); err != nil {
					return "short payload", false
				}
			}
			t.replyError(req, errno, "request refused")
			continue
		}
		if req.typ == cmdRead && t.fast != nil && req.length <= maxInlineRead && t.readInline(req) {
			continue
		}
		weight := int64(0)
		if req.typ == cmdRead || req.typ == cmdWrite {
			weight = int64(bufSize(int(req.length)))
		}
		t.budget.acquire(weight)
		shared := false
		if req.typ == cmdRead {
			if weight > readReserve || !t.reserved.CompareAndSwap(false, true) {
				t.srv.readMem.acquire(weight)
				shared = true
			}
		}
		var payload []byte
		if plen > 0 {
			var err error
			if payload, err = t.readPayload(int(plen)); err != nil {
				t.budget.release(weight)
				return "short payload", false
			}
		}
		t.dispatch(job{req: req, payload: payload, weight: weight, shared: shared})
	}
}

// readPayload reads a WRITE payload of n bytes into a pooled buffer that
// starts at firstPayloadBuf and doubles as the bytes arrive. Each piece's
// read is bounded by the idle timeout.
func (t *transmission) readPayload(n int) ([]byte, error) {
	buf := getBuf(min(n, firstPayloadBuf))
	for got := 0; ; {
		if t.r.Buffered() < len(buf)-got {
			t.flushHeld()
		}
		t.armRead()
		m, err := io.ReadFull(t.r, buf[got:])
		got += m
		if err != nil {
			putBuf(buf)
			return nil, err
		}
		if got == n {
			return buf, nil
		}
		nb := getBuf(min(n, 2*len(buf)))
		copy(nb, buf[:got])
		putBuf(buf)
		buf = nb
	}
}

// discard reads and drops n bytes of a refused payload, in pieces whose
// reads are each bounded by the idle timeout.
func (t *transmission) discard(n int64) error {
	for n > 0 {
		t.armRead()
		m, err := io.CopyN(io.Discard, t.r, min(n, discardPiece))
		n -= m
		if err != nil {
			return err
		}
	}
	return nil
}

// handle runs one validated request and sends its reply. A READ gives
// back its share of the server's bound when shared is set, else the
// connection's reserve.
func (t *transmission) handle(req request, payload []byte, weight int64, shared bool) {
	defer t.handlers.Done()
	defer t.budget.release(weight)
	if t.idle > 0 {
		defer func() { t.lastDone.Store(time.Now().UnixNano()) }()
	}
	fua := req.flags&cmdFlagFUA != 0
	off, n := int64(req.offset), int64(req.length)
	var err error
	switch req.typ {
	case cmdRead:
		t.read(req)
		if shared {
			t.srv.readMem.release(weight)
		} else {
			t.reserved.Store(false)
		}
		return
	case cmdBlockStatus:
		t.blockStatus(req)
		return
	case cmdWrite:
		_, err = t.dev.WriteAt(payload, off, fua)
		putBuf(payload)
		t.wrote(err)
	case cmdFlush:
		t.dirty.Store(false)
		if err = t.dev.Flush(); err != nil {
			t.dirty.Store(true)
		}
	case cmdTrim:
		err = t.dev.Discard(off, n)
		if isNotSupported(err) {
			err = nil // TRIM is a hint
		}
		t.wrote(err)
		if err == nil && fua {
			err = t.dev.Flush()
		}
	case cmdCache:
		// A hint with no effect here; success is allowed.
	case cmdWriteZeroes:
		mayUnmap := req.flags&cmdFlagNoHole == 0
		if req.flags&cmdFlagFastZero != 0 && (t.exp.CanFastZero == nil || !t.exp.CanFastZero(off, n, mayUnmap)) {
			t.replyError(req, ENOTSUP, "fast zero not possible")
			return
		}
		err = t.dev.WriteZeroes(off, n, mayUnmap, fua)
		t.wrote(err)
	}
	if err != nil {
		errno := errnoOf(err, req.typ)
		t.log.Warn("request failed", "cmd", req.typ.String(), "offset", off, "length", n, "errno", uint32(errno), "err", err)
		t.replyError(req, errno, req.typ.String()+" failed")
		return
	}
	t.send(func(w *bufio.Writer) error { return writeSimple(w, req.handle, 0) })
}

// wrote records that a write command finished.
func (t *transmission) wrote(err error) {
	if err == nil {
		t.dirty.Store(true)
	}
}

// read serves NBD_CMD_READ. The data is read in full before the reply
// header goes out, so a device error is always reported as an error
// reply: never after a success header.
func (t *transmission) read(req request) {
	off, n := int64(req.offset), int(req.length)
	if !t.structured {
		buf := getBuf(n)
		defer putBuf(buf)
		if err := readFull(t.dev, buf, off); err != nil {
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
	if req.flags&cmdFlagDF != 0 || n < minHole {
		// Too short to hold a hole worth a chunk of its own: skip the
		// extent lookups.
		pieces = []piece{{off: off, n: int64(n)}}
	} else {
		pieces = mapHoles(t.dev, off, int64(n))
	}
	buf := getBuf(n)
	defer putBuf(buf)
	for _, p := range pieces {
		if p.hole {
			continue
		}
		if err := readFull(t.dev, buf[p.off-off:p.off-off+p.n], p.off); err != nil {
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
func readFull(dev block.Device, p []byte, off int64) error {
	n, err := dev.ReadAt(p, off)
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
// device's extents (StatusZero makes a hole). Holes shorter than minHole
// count as data; after maxReadExtents lookups, or on a lookup error or an
// extent of no length, the rest is data. The pieces cover the range
// exactly once, in order, and adjacent pieces differ in kind.
func mapHoles(dev block.Device, off, n int64) []piece {
	var runs []piece
	add := func(p piece) {
		if k := len(runs) - 1; k >= 0 && runs[k].hole == p.hole {
			runs[k].n += p.n
			return
		}
		runs = append(runs, p)
	}
	cur, end := off, off+n
	for i := 0; cur < end; i++ {
		rest := end - cur
		if i == maxReadExtents {
			add(piece{off: cur, n: rest})
			break
		}
		e, err := dev.Extent(cur, rest)
		if err != nil || e.Length <= 0 {
			add(piece{off: cur, n: rest})
			break
		}
		l := min(e.Length, rest)
		add(piece{off: cur, n: l, hole: e.Status&block.StatusZero != 0})
		cur += l
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
	runs, err := statusRuns(t.dev, int64(req.offset), int64(req.length), req.flags&cmdFlagReqOne != 0)
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

// statusRuns walks [off, off+n) with Device.Extent: at most
// maxStatusExtents runs, one with reqOne. An error on the first lookup is
// returned; a later one ends the walk early, which the spec allows. An
// extent of no length (a device bug) reports the rest of the range as
// data at depth 1, the status a server may always report.
func statusRuns(dev block.Device, off, n int64, reqOne bool) ([]statusRun, error) {
	var runs []statusRun
	cur, end := off, off+n
	for cur < end && len(runs) < maxStatusExtents {
		rest := end - cur
		e, err := dev.Extent(cur, rest)
		if err != nil {
			if len(runs) == 0 {
				return nil, err
			}
			break
		}
		r := statusRun{depth: uint32(max(e.Depth, 0))}
		l := min(e.Length, rest)
		if l <= 0 {
			l, r.depth = rest, 1
		} else {
			if e.Status&block.StatusHole != 0 {
				r.flags |= stateHole
			}
			if e.Status&block.StatusZero != 0 {
				r.flags |= stateZero
			}
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

// replyError sends an error reply: an NBD_REPLY_TYPE_ERROR chunk with a
// message when structured replies were negotiated, else a simple reply.
func (t *transmission) replyError(req request, errno Errno, msg string) {
	t.send(func(w *bufio.Writer) error {
		if !t.structured {
			return writeSimple(w, req.handle, errno)
		}
		return writeErrorChunk(w, req.handle, errno, msg)
	})
}

// send writes one reply under wmu. The last of the replies waiting for the
// lock flushes, so replies that complete together share a write. After a
// write error the socket is closed, which ends the reader, and later
// replies are dropped.
func (t *transmission) send(fn func(w *bufio.Writer) error) {
	t.pending.Add(1)
	t.wmu.Lock()
	defer t.wmu.Unlock()
	last := t.pending.Add(-1) == 0
	if t.werr != nil {
		return
	}
	t.armWrite()
	err := fn(t.w)
	if err == nil && last {
		err = t.w.Flush()
		t.held.Store(false)
	}
	if err != nil {
		t.werr = err
		t.raw.Close()
	}
}

// errnoOf maps a device error to the NBD error a client sees: an Errno
// in the chain as is; block.ErrReadOnly, EPERM, EACCES and EROFS as
// EPERM; block.ErrOutOfRange as ENOSPC for writes and EINVAL otherwise;
// ENOSPC, EDQUOT and EFBIG as ENOSPC (the spec asks for that mapping);
// ENOMEM as ENOMEM; block.ErrClosed as ESHUTDOWN; anything else as EIO.
func errnoOf(err error, typ cmdType) Errno {
	var e Errno
	switch {
	case errors.As(err, &e) && e != 0:
		return e
	case errors.Is(err, block.ErrReadOnly), errors.Is(err, syscall.EPERM), errors.Is(err, syscall.EACCES), errors.Is(err, syscall.EROFS):
		return EPERM
	case errors.Is(err, block.ErrOutOfRange):
		if typ == cmdWrite || typ == cmdWriteZeroes {
			return ENOSPC
		}
		return EINVAL
	case errors.Is(err, syscall.ENOSPC), errors.Is(err, syscall.EDQUOT), errors.Is(err, syscall.EFBIG):
		return ENOSPC
	case errors.Is(err, syscall.ENOMEM):
		return ENOMEM
	case errors.Is(err, block.ErrClosed):
		return ESHUTDOWN
	}
	return EIO
}

func isNotSupported(err error) bool {
	return err != nil && (errors.Is(err, syscall.EOPNOTSUPP) || errors.Is(err, errors.ErrUnsupported))
}

// budget bounds requests in service by count and by buffer bytes. A
// connection's budget is acquired only by its reader; the server's
// (Server.readMem) by every connection's reader. Handlers release.
type budget struct {
	mu       sync.Mutex
	cond     sync.Cond
	maxReqs  int
	maxBytes int64
	reqs     int
	bytes    int64
}

func (b *budget) init(maxReqs int, maxBytes int64) {
	b.cond.L = &b.mu
	b.maxReqs, b.maxBytes = maxReqs, maxBytes
}

// acquire waits until one more request of n bytes fits. A request always
// fits when nothing else is in service.
func (b *budget) acquire(n int64) {
	b.mu.Lock()
	for b.reqs >= b.maxReqs || (b.reqs > 0 && b.bytes+n > b.maxBytes) {
		b.cond.Wait()
	}
	b.reqs++
	b.bytes += n
	b.mu.Unlock()
}

// release gives back a request of n bytes. Every waiter is woken: waiters
// of different sizes may wait on the server's budget, and the one that
// now fits may not be the first.
func (b *budget) release(n int64) {
	b.mu.Lock()
	b.reqs--
	b.bytes -= n
	b.mu.Unlock()
	b.cond.Broadcast()
}

// busy reports whether a request is in service.
func (b *budget) busy() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.reqs > 0
}
