package protocol

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
)

// Handler serves the requests a Server has checked: a known op, flags
// and payload the op takes, a range inside an object, a payload that
// matched its checksum.
//
// Serve sets resp.Status, Epoch, Version and Payload; the server sets
// Handle. req.Payload is valid only until Serve returns (resp.Payload
// may be req.Payload itself, but no other slice of it). On entry
// resp.Payload is an empty buffer with room for req.Length bytes for
// OpRead, which Serve may fill (resp.Payload = resp.Payload[:n]); any
// slice Serve sets instead is only read, until its response is written.
// For an error status, Payload is a message, cut to MaxErrorMsg.
// A response payload over MaxPayload is replaced by StatusTooBig, and a
// successful OpRead reply of other than req.Length bytes by StatusEIO.
//
// ctx is cancelled when the server stops hard (Shutdown's ctx ended).
// Serve is called concurrently, up to MaxInFlight times per connection.
type Handler interface {
	Serve(ctx context.Context, req *Request, resp *Response)
}

// HandlerFunc adapts a function to Handler.
type HandlerFunc func(ctx context.Context, req *Request, resp *Response)

// Serve calls f.
func (f HandlerFunc) Serve(ctx context.Context, req *Request, resp *Response) { f(ctx, req, resp) }

// ServerOptions configures a Server. The zero value takes every default.
type ServerOptions struct {
	// MaxInFlight bounds the requests of one connection in service, from
	// the header read to the response written; the connection's reader
	// waits for room. The default is 64.
	MaxInFlight int
	// MaxInFlightBytes bounds the payload bytes of one connection's
	// requests in service: request payloads plus the lengths OpRead
	// asks for. At least MaxPayload. The default is 2 × MaxPayload.
	MaxInFlightBytes int
	// MaxConns bounds the connections served at once; one more is closed
	// as soon as it is accepted. The default is 1024.
	MaxConns int
	// IdleTimeout ends a connection on which no request header starts
	// arriving for that long. The default, 0, keeps idle connections,
	// as node-to-node connections are kept for reuse.
	IdleTimeout time.Duration
	// IOTimeout bounds the read of a payload once its header has
	// arrived, and the write of each response: a peer that stops
	// sending mid-request or stops reading loses the connection. The
	// default is 30 s.
	IOTimeout time.Duration
	// Logger receives the connection errors. The default is
	// slog.Default().
	Logger *slog.Logger
}

// Defaults.
const (
	DefaultMaxInFlight      = 64
	DefaultMaxInFlightBytes = 2 * MaxPayload
	DefaultMaxConns         = 1024
)

// Validate reports a negative or too small value, naming it.
func (o ServerOptions) Validate() error {
	switch {
	case o.MaxInFlight < 0:
		return fmt.Errorf("protocol: ServerOptions.MaxInFlight %d: want ≥ 0", o.MaxInFlight)
	case o.MaxInFlightBytes != 0 && o.MaxInFlightBytes < MaxPayload:
		return fmt.Errorf("protocol: ServerOptions.MaxInFlightBytes %d: want 0 or ≥ MaxPayload (%d)", o.MaxInFlightBytes, MaxPayload)
	case o.MaxConns < 0:
		return fmt.Errorf("protocol: ServerOptions.MaxConns %d: want ≥ 0", o.MaxConns)
	case o.IdleTimeout < 0:
		return fmt.Errorf("protocol: ServerOptions.IdleTimeout %v: want ≥ 0", o.IdleTimeout)
	case o.IOTimeout < 0:
		return fmt.Errorf("protocol: ServerOptions.IOTimeout %v: want ≥ 0", o.IOTimeout)
	}
	return nil
}

func (o ServerOptions) withDefaults() ServerOptions {
	if o.MaxInFlight == 0 {
		o.MaxInFlight = DefaultMaxInFlight
	}
	if o.MaxInFlightBytes == 0 {
		o.MaxInFlightBytes = DefaultMaxInFlightBytes
	}
	if o.MaxConns == 0 {
		o.MaxConns = DefaultMaxConns
	}
	if o.IOTimeout == 0 {
		o.IOTimeout = ioTimeout
	}
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	return o
}

// Server serves the protocol on listeners, one goroutine reading each
// connection, one writing its responses and one per request in
// service.
//
// Locking: mu guards the listeners, the connections and the shutdown
// mark; it is never held across I/O. Safe for concurrent use. Stop with
// Shutdown.
type Server struct {
	h    Handler
	opts ServerOptions
	err  error // from Validate, returned by Serve
	log  *slog.Logger

	// ctx is the handlers' context; cancel ends it on a hard stop.
	ctx    context.Context
	cancel context.CancelFunc
	// stopping is set once Shutdown starts; readers check it after
	// every read deadline they set.
	stopping atomic.Bool
	wg       sync.WaitGroup // every goroutine of every connection

	mu struct {
		sync.Mutex
		listeners map[net.Listener]struct{}
		conns     map[*serverConn]struct{}
		shutdown  bool
	}
}

// NewServer returns a Server of h. Invalid opts make Serve fail.
func NewServer(h Handler, opts ServerOptions) *Server {
	s := &Server{h: h, err: opts.Validate(), opts: opts.withDefaults()}
	s.log = s.opts.Logger
	s.ctx, s.cancel = context.WithCancel(context.Background())
	s.mu.listeners = make(map[net.Listener]struct{})
	s.mu.conns = make(map[*serverConn]struct{})
	return s
}

// Serve accepts connections on l and serves them until Shutdown, after
// which it returns ErrServerClosed; it returns other Accept errors as
// they come, but for temporary ones, after which it waits and retries.
// Serve closes l. It may be called on several listeners at once.
func (s *Server) Serve(l net.Listener) error {
	if s.err != nil {
		l.Close()
		return s.err
	}
	s.mu.Lock()
	if s.mu.shutdown {
		s.mu.Unlock()
		l.Close()
		return ErrServerClosed
	}
	s.mu.listeners[l] = struct{}{}
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		delete(s.mu.listeners, l)
		s.mu.Unlock()
		l.Close()
	}()
	var backoff time.Duration
	for {
		conn, err := l.Accept()
		if err != nil {
			if s.stopping.Load() {
				return ErrServerClosed
			}
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				backoff = min(max(2*backoff, 5*time.Millisecond), time.Second)
				s.log.Warn("protocol accept", "addr", l.Addr().String(), "err", err, "retry", backoff)
				time.Sleep(backoff)
				continue
			}
			return fmt.Errorf("protocol: accept on %s: %w", l.Addr(), err)
		}
		backoff = 0
		s.startConn(conn)
	}
}

// startConn registers conn and starts serving it, or closes it when the
// server is full or stopping.
func (s *Server) startConn(conn net.Conn) {
	s.mu.Lock()
	if s.mu.shutdown {
		s.mu.Unlock()
		conn.Close()
		return
	}
	if len(s.mu.conns) >= s.opts.MaxConns {
		s.mu.Unlock()
		s.log.Warn("protocol connection refused", "peer", conn.RemoteAddr().String(), "reason", "too many connections", "max", s.opts.MaxConns)
		conn.Close()
		return
	}
	sc := &serverConn{
		s:     s,
		conn:  conn,
		peer:  conn.RemoteAddr().String(),
		out:   make(chan outReply, s.opts.MaxInFlight),
		slots: make(chan struct{}, s.opts.MaxInFlight),
		done:  make(chan struct{}),
	}
	sc.budget.max = s.opts.MaxInFlightBytes
	sc.budget.room = make(chan struct{}, 1)
	s.mu.conns[sc] = struct{}{}
	s.wg.Add(2)
	s.mu.Unlock()
	go sc.writeLoop()
	go sc.readLoop()
}

// Shutdown stops accepting, stops reading requests, lets the requests
// in service finish and their responses be written, then closes every
// connection. When ctx ends first it cancels the handlers' context,
// closes the connections, waits for the handlers to return and returns
// ctx.Err(). Every goroutine has ended when it returns. A second
// Shutdown returns ErrClosed.
func (s *Server) Shutdown(ctx context.Context) error {
	s.mu.Lock()
	if s.mu.shutdown {
		s.mu.Unlock()
		return ErrClosed
	}
	s.mu.shutdown = true
	s.stopping.Store(true)
	for l := range s.mu.listeners {
		l.Close()
	}
	for sc := range s.mu.conns {
		sc.conn.SetReadDeadline(time.Now()) // wake the reader
	}
	s.mu.Unlock()

	idle := make(chan struct{})
	go func() { s.wg.Wait(); close(idle) }()
	select {
	case <-idle:
		s.cancel()
		return nil
	case <-ctx.Done():
	}
	s.cancel()
	s.mu.Lock()
	for sc := range s.mu.conns {
		sc.conn.Close()
	}
	s.mu.Unlock()
	<-idle
	return ctx.Err()
}

// serverConn is one connection being served.
type serverConn struct {
	s    *Server
	conn net.Conn
	peer string
	// out carries responses to the writer. It has room for MaxInFlight,
	// and each request holds a slot until its response is written, so a
	// handler never waits to send.
	out   chan outReply
	slots chan struct{} // one per request in service
	// done is closed when the writer has stopped writing, so that a
	// reader waiting for room stops.
	done     chan struct{}
	budget   budget
	handlers sync.WaitGroup
}

// outReply is a response for the writer, with what to release once it
// is written.
type outReply struct {
	resp *Response
	cost int
	buf  []byte // the server's read buffer to reuse, if any
}

// readLoop reads requests and starts a handler for each, until the
// connection ends or the server stops; it then waits for the handlers
// and tells the writer to finish.
func (sc *serverConn) readLoop() {
	s := sc.s
	defer func() {
		sc.handlers.Wait()
		close(sc.out)
		s.wg.Done()
	}()
	br := bufio.NewReaderSize(sc.conn, 64<<10)
	var hdr [RequestHeaderLen]byte
	for {
		// Room for one more request before reading it.
		select {
		case sc.slots <- struct{}{}:
		case <-sc.done:
			return
		}
		if s.opts.IdleTimeout > 0 {
			sc.conn.SetReadDeadline(time.Now().Add(s.opts.IdleTimeout))
		} else {
			sc.conn.SetReadDeadline(time.Time{})
		}
		if s.stopping.Load() {
			return
		}
		if _, err := io.ReadFull(br, hdr[:]); err != nil {
			sc.readFailed("request header", err)
			return
		}
		req := new(Request)
		h, err := parseRequestHeader(hdr[:], req)
		if err != nil {
			s.log.Error("protocol bad request", "peer", sc.peer, "err", err)
			return
		}
		cost := 0
		if h.payload {
			cost += int(req.Length)
		}
		if int(req.Op) < len(ops) && ops[req.Op].readLen && req.Length <= MaxPayload {
			cost += int(req.Length)
		}
		cost = min(cost, sc.budget.max)
		if !sc.budget.acquire(cost, sc.done) {
			return
		}
		var buf []byte
		if h.payload {
			sc.conn.SetReadDeadline(time.Now().Add(s.opts.IOTimeout))
			if s.stopping.Load() {
				sc.budget.release(cost)
				return
			}
			buf = getBuf(int(req.Length))
			req.Payload, err = readPayload(br, buf, int(req.Length))
			if err != nil {
				sc.budget.release(cost)
				sc.readFailed(fmt.Sprintf("%s request handle %d payload of %d bytes", req.Op, req.Handle, req.Length), err)
				return
			}
			if req.Payload == nil {
				req.Payload = []byte{}
			}
		}
		sc.handlers.Add(1)
		go sc.handle(req, h, cost)
	}
}

// readFailed logs why reading stopped, unless the peer closed cleanly or
// the server is stopping.
func (sc *serverConn) readFailed(what string, err error) {
	if sc.s.stopping.Load() || err == io.EOF {
		return
	}
	select {
	case <-sc.done:
		return // the writer failed and closed the connection; it logged
	default:
	}
	sc.s.log.Error("protocol read", "peer", sc.peer, "reading", what, "err", unexpected(err))
}

// handle checks one request, serves it and queues its response.
// The checksum is verified here, off the reader, so that one request's
// CRC overlaps the next one's arrival.
func (sc *serverConn) handle(req *Request, h requestHeader, cost int) {
	defer sc.handlers.Done()
	resp := new(Response)
	var readBuf []byte
	crcOK := !h.payload || Checksum(req.Payload) == h.crc
	if st, msg := check(req, crcOK, h.crc); st != StatusOK {
		resp.SetError(st, msg)
	} else {
		if req.Op == OpRead {
			readBuf = getBuf(int(req.Length))
			resp.Payload = readBuf[:0]
		}
		sc.s.h.Serve(sc.s.ctx, req, resp)
		if resp.Status != StatusOK && len(resp.Payload) > MaxErrorMsg {
			resp.Payload = resp.Payload[:MaxErrorMsg]
		}
		if len(resp.Payload) > MaxPayload {
			n := len(resp.Payload)
			resp.Payload = nil // the handler's; not ours to overwrite
			resp.SetError(StatusTooBig, fmt.Sprintf("%s reply of %d bytes over %d", req.Op, n, MaxPayload))
		}
		if req.Op == OpRead && resp.Status == StatusOK && len(resp.Payload) != int(req.Length) {
			// A short read on the wire would be taken for data.
			n := len(resp.Payload)
			resp.Payload = nil
			resp.SetError(StatusEIO, fmt.Sprintf("read %s: %d bytes served of %d", req.Object, n, req.Length))
		}
	}
	resp.Handle = req.Handle
	// The buffer the reply is written from is reused only after the
	// write: the read buffer the handler filled, or the request's when
	// the handler answers with it (an echo).
	keep := readBuf
	switch {
	case sameArray(req.Payload, resp.Payload):
		keep = req.Payload
		putBuf(readBuf)
	case sameArray(readBuf, resp.Payload):
		putBuf(req.Payload)
	default:
		putBuf(req.Payload)
		putBuf(readBuf)
		keep = nil
	}
	req.Payload = nil
	sc.out <- outReply{resp: resp, cost: cost, buf: keep}
}

// check is the wire's checks: the payload's checksum, then the op table
// (validate); it returns StatusOK and "" when the handler may serve req.
func check(req *Request, crcOK bool, crc uint32) (Status, string) {
	if req.Op.Known() && !crcOK {
		return StatusChecksum, fmt.Sprintf("%s %s: payload crc32c %#08x, header says %#08x", req.Op, req.Object, Checksum(req.Payload), crc)
	}
	return validate(req)
}

// Validate applies the op table to req, as a Server does before its
// handler sees a request: a request served in process (cluster/node's
// own gateway reaching its own node) goes through the same rules. It
// returns nil, or an *Error whose Status says why (StatusUnsupported,
// StatusEINVAL, StatusTooBig) and whose message names what is wrong.
func Validate(req *Request) error {
	if st, msg := validate(req); st != StatusOK {
		return &Error{Status: st, Op: req.Op, Object: req.Object, Msg: msg}
	}
	return nil
}

func validate(req *Request) (Status, string) {
	if !req.Op.Known() {
		return StatusUnsupported, fmt.Sprintf("unknown op %d", uint8(req.Op))
	}
	spec := &ops[req.Op]
	if bad := req.Flags &^ spec.flags; bad != 0 {
		return StatusEINVAL, fmt.Sprintf("%s %s: flags %s not valid", req.Op, req.Object, bad)
	}
	if req.Payload != nil && !spec.payload {
		return StatusEINVAL, fmt.Sprintf("%s %s: unexpected payload of %d bytes", req.Op, req.Object, len(req.Payload))
	}
	if spec.maxPayload > 0 && len(req.Payload) > spec.maxPayload {
		return StatusEINVAL, fmt.Sprintf("%s: payload of %d bytes over %d", req.Op, len(req.Payload), spec.maxPayload)
	}
	if req.Op == OpWrite && req.Payload == nil {
		return StatusEINVAL, fmt.Sprintf("write %s: no payload", req.Object)
	}
	if req.Op == OpWrite && uint64(len(req.Payload)) != uint64(req.Length) {
		return StatusEINVAL, fmt.Sprintf("write %s: payload of %d bytes, header says %d", req.Object, len(req.Payload), req.Length)
	}
	if spec.readLen && req.Length > MaxPayload {
		return StatusTooBig, fmt.Sprintf("%s %s: length %d over %d", req.Op, req.Object, req.Length, MaxPayload)
	}
	switch spec.bounds {
	case boundsObject:
		if req.Offset > MaxObjectSpan || uint64(req.Length) > MaxObjectSpan-req.Offset {
			return StatusEINVAL, fmt.Sprintf("%s %s: range %d+%d beyond the largest object (%d)", req.Op, req.Object, req.Offset, req.Length, MaxObjectSpan)
		}
	case boundsList:
		if req.Length > MaxListEntries {
			return StatusEINVAL, fmt.Sprintf("list %s: %d entries over %d", req.Object, req.Length, MaxListEntries)
		}
	case boundsCursor:
		if len(req.Payload) == 0 {
			return StatusEINVAL, fmt.Sprintf("%s: no node named in the payload", req.Op)
		}
	case boundsSettle:
		if req.Offset != 0 || len(req.Payload) == 0 || len(req.Payload)%8 != 0 {
			return StatusEINVAL, fmt.Sprintf("settle %s: offset %d, payload of %d bytes: want offset 0 and 1 to %d gate ids of 8 bytes", req.Object, req.Offset, len(req.Payload), MaxSettleIDs)
		}
	case boundsNone:
		if req.Offset != 0 || (req.Payload == nil && req.Length != 0) {
			return StatusEINVAL, fmt.Sprintf("%s %s: offset %d length %d, want 0", req.Op, req.Object, req.Offset, req.Length)
		}
	}
	return StatusOK, ""
}

// writeLoop writes responses until out is closed, flushing whenever it
// is empty; after a write error it closes the connection and only
// releases what the responses hold.
func (sc *serverConn) writeLoop() {
	s := sc.s
	defer func() {
		sc.conn.Close()
		s.mu.Lock()
		delete(s.mu.conns, sc)
		s.mu.Unlock()
		s.wg.Done()
	}()
	bw := bufio.NewWriterSize(sc.conn, 64<<10)
	var hdr [ResponseHeaderLen]byte
	var failed error
	for r := range sc.out {
		if failed == nil {
			failed = sc.writeReply(bw, r.resp, hdr[:])
			if failed == nil && len(sc.out) == 0 {
				failed = bw.Flush()
			}
			if failed != nil {
				if !s.stopping.Load() {
					s.log.Error("protocol write", "peer", sc.peer, "handle", r.resp.Handle, "err", failed)
				}
				close(sc.done)
				sc.conn.Close() // ends the reader
			}
		}
		putBuf(r.buf)
		sc.budget.release(r.cost)
		<-sc.slots
	}
	if failed == nil {
		close(sc.done)
	}
}

// writeReply encodes one response into bw.
func (sc *serverConn) writeReply(bw *bufio.Writer, r *Response, hdr []byte) error {
	if err := sc.conn.SetWriteDeadline(time.Now().Add(sc.s.opts.IOTimeout)); err != nil {
		return err
	}
	putResponseHeader(hdr, r, Checksum(r.Payload))
	if _, err := bw.Write(hdr); err != nil {
		return err
	}
	_, err := bw.Write(r.Payload)
	return err
}

// budget bounds the bytes of one connection's requests in service. Only
// the connection's reader acquires, so one waiter at most.
type budget struct {
	max  int
	mu   sync.Mutex
	used int
	room chan struct{} // signalled on release
}

// acquire takes n bytes, waiting for room; it reports false when stop
// is closed first.
func (b *budget) acquire(n int, stop <-chan struct{}) bool {
	for {
		b.mu.Lock()
		if b.used+n <= b.max {
			b.used += n
			b.mu.Unlock()
			return true
		}
		b.mu.Unlock()
		select {
		case <-b.room:
		case <-stop:
			return false
		}
	}
}

func (b *budget) release(n int) {
	if n == 0 {
		return
	}
	b.mu.Lock()
	b.used -= n
	b.mu.Unlock()
	select {
	case b.room <- struct{}{}:
	default:
	}
}

// Buffers for payloads are reused up to this capacity: a default-size
// object (4 MiB) and room.
const maxPooledBuf = 4<<20 + 4096

var bufPool sync.Pool // of *[]byte

// getBuf returns an empty buffer, with room for n bytes when n is small
// enough to be pooled; a larger payload grows its own as it arrives.
func getBuf(n int) []byte {
	if n > maxPooledBuf {
		return nil
	}
	if p, ok := bufPool.Get().(*[]byte); ok && cap(*p) >= n {
		return (*p)[:0]
	}
	return make([]byte, 0, max(n, 4096))
}

func putBuf(b []byte) {
	if cap(b) == 0 || cap(b) > maxPooledBuf {
		return
	}
	b = b[:0]
	bufPool.Put(&b)
}

// sameArray reports whether a and b share their first byte of backing
// array.
func sameArray(a, b []byte) bool {
	return cap(a) > 0 && cap(b) > 0 && &a[:1][0] == &b[:1][0]
}
