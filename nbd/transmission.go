package nbd

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ovis-storage/ovis/block"
)

// This file holds a connection's transmission phase: the request reader
// (headers, WRITE payloads, refused payloads dropped), the idle timeouts,
// the dispatch of each request to its handler, and the end of the
// connection.

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
	srv *Server
	// ctx is passed to every device call of the connection. It is
	// cancelled when the client goes away without NBD_CMD_DISC, and by
	// the server's Close (which Shutdown calls once its grace period
	// ends), so that a device call waiting on a lock, a replica or a
	// network cannot keep the connection, or the server, from ending.
	ctx    context.Context
	cancel context.CancelFunc
	exp    *Export
	dev    block.Device
	raw    net.Conn // the socket: closing it is the hard disconnect
	conn   net.Conn // raw or the TLS connection over it
	r      *bufio.Reader
	log    *slog.Logger
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
	t.ctx, t.cancel = context.WithCancel(s.ctx)
	t.budget.init(s.cfg.MaxInFlight, 2*int64(s.cfg.MaxPayload))
	t.jobs = make(chan job)
	t.done = make(chan struct{})
	t.fast, _ = block.As[block.NoWaitReader](n.export.Device)
	return t
}

// serve reads requests until the client disconnects (NBD_CMD_DISC or a
// closed socket), the stream breaks, or Shutdown stops the reading. Then
// it waits for the requests in service, flushes a dirty device and closes
// the connection.
func (t *transmission) serve() {
	defer t.cancel()
	reason, graceful := t.readLoop()
	if reason != "disc" && reason != "shutdown" {
		// The client is gone: nobody waits for the replies of the
		// requests in service, which may end early.
		t.cancel()
	}
	t.handlers.Wait()
	close(t.done)
	if t.dirty.Load() {
		// Under the server's context: the connection's may be
		// cancelled, and Close must still be able to end this.
		if err := t.dev.Flush(t.srv.ctx); err != nil {
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
		if err := t.acquireRoom(&t.budget, weight); err != nil {
			return "closed while waiting for requests in service", false
		}
		shared := false
		if req.typ == cmdRead {
			if weight > readReserve || !t.reserved.CompareAndSwap(false, true) {
				if err := t.acquireRoom(&t.srv.readMem, weight); err != nil {
					t.budget.release(weight)
					return "closed while waiting for read buffers", false
				}
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
	flags := deviceFlags(req.flags)
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
		_, err = t.dev.WriteAt(t.ctx, payload, off, flags)
		putBuf(payload)
		t.wrote(err)
	case cmdFlush:
		// A failed flush leaves the connection dirty only if it was:
		// one with nothing written has nothing to flush on the way out.
		was := t.dirty.Swap(false)
		if err = t.dev.Flush(t.ctx); err != nil && was {
			t.dirty.Store(true)
		}
	case cmdTrim:
		err = t.dev.Discard(t.ctx, off, n, flags)
		if isNotSupported(err) {
			err = nil // TRIM is a hint
		}
		t.wrote(err)
	case cmdCache:
		// A hint with no effect here; success is allowed.
	case cmdWriteZeroes:
		err = t.dev.WriteZeroes(t.ctx, off, n, flags)
		if errors.Is(err, block.ErrNoFallback) {
			t.replyError(req, ENOTSUP, "fast zero not possible")
			return
		}
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

// deviceFlags maps a request's NBD command flags onto the device's, one
// to one: FUA, NO_HOLE (NoUnmap) and FAST_ZERO (NoFallback). The others
// (DF, REQ_ONE) shape the reply and do not reach the device.
func deviceFlags(f cmdFlags) block.Flags {
	var d block.Flags
	if f&cmdFlagFUA != 0 {
		d |= block.FUA
	}
	if f&cmdFlagNoHole != 0 {
		d |= block.NoUnmap
	}
	if f&cmdFlagFastZero != 0 {
		d |= block.NoFallback
	}
	return d
}
