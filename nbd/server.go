package nbd

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/ovis-storage/ovis/block"
)

// Export is one block device offered under a name.
type Export struct {
	// Name is what clients ask for (NBD_OPT_GO, NBD_OPT_EXPORT_NAME).
	// At most 4096 bytes. A client asking for the empty name gets the
	// export named "" if there is one, else (unless Config.ExactNames)
	// the first export listed (see Exports).
	Name string
	// Description is shown to humans (NBD_OPT_LIST, NBD_INFO_DESCRIPTION).
	// At most 4096 bytes; empty means none.
	Description string
	// Device serves the export's bytes. The Server does not close it.
	Device block.Device
	// ReadOnly advertises NBD_FLAG_READ_ONLY; WRITE, TRIM and
	// WRITE_ZEROES then fail with EPERM before reaching the Device.
	ReadOnly bool
	// MultiConn advertises NBD_FLAG_CAN_MULTI_CONN, the export's own
	// declaration that a client may spread its requests over several
	// connections. Set it only when a flush on one connection covers the
	// writes made on all of them (and a FUA write is durable for all):
	// the Device is one shared object, as every connection to this
	// export gets the same Device. Leave it false for a Device whose
	// caching is per connection. The Server does not second-guess it. The
	// default (false) makes clients use one connection.
	MultiConn bool
	// Bitmaps are dirty bitmaps offered as the metadata contexts
	// "qemu:dirty-bitmap:NAME" (qemu-nbd -B), in this order.
	Bitmaps []ExportBitmap
	// NoAllocationDepth leaves the qemu:allocation-depth context out, as
	// qemu-nbd does without -A. The default (false) offers it.
	NoAllocationDepth bool
	// NoHoleMap answers every structured READ with its data, without
	// first asking the device where its holes are (as qemu-nbd does, to
	// send them as hole chunks). Set it for a device whose Extents cost
	// as much as a read: a network one, where the lookup is a round trip
	// of its own. BLOCK_STATUS is unaffected.
	NoHoleMap bool
	// NoFUA leaves NBD_FLAG_SEND_FUA out, so that clients send a write
	// and then a flush where they would send a FUA write (QEMU does;
	// a FUA flag on a command is then refused with EINVAL). It is a
	// diagnostic, for measuring emulated writethrough against native FUA
	// with a guest whose client is QEMU's. The default (false)
	// advertises FUA.
	NoFUA bool
}

// ExportBitmap is a dirty bitmap of an export's device.
type ExportBitmap struct {
	Name string
	// Extent describes the run of equal dirtiness that starts at off, at
	// most n bytes long; a length of 0 is a device bug, reported dirty.
	Extent func(off, n int64) (length int64, dirty bool, err error)
}

// exportFlags is the transmission flags advertised for e. HAS_FLAGS,
// SEND_FLUSH and SEND_CACHE are always set, SEND_FUA unless e.NoFUA; a
// writable export
// adds SEND_TRIM, SEND_WRITE_ZEROES and SEND_FAST_ZERO, a read-only one
// READ_ONLY; SEND_DF needs structured replies; CAN_MULTI_CONN only when
// configured.
func exportFlags(e *Export, structured bool) transmissionFlags {
	f := flagHasFlags | flagSendFlush | flagSendFUA | flagSendCache
	if e.NoFUA {
		f &^= flagSendFUA
	}
	if e.ReadOnly {
		f |= flagReadOnly
	} else {
		f |= flagSendTrim | flagSendWriteZeroes | flagSendFastZero
	}
	if structured {
		f |= flagSendDF
	}
	if e.MultiConn {
		f |= flagCanMultiConn
	}
	return f
}

// Config configures a Server. The zero value of every field but Exports
// means its default.
type Config struct {
	// Exports finds the exports served, when clients ask for them:
	// FixedExports(list...) for a list fixed at start (at least one
	// export, distinct names), or any Exports whose set changes at run
	// time. Required.
	Exports Exports
	// TLS, when non-nil, makes the server insist on TLS (the spec's
	// FORCEDTLS mode): before NBD_OPT_STARTTLS every option but ABORT is
	// refused with NBD_REP_ERR_TLS_REQD, so not even the export list is
	// shown, and EXPORT_NAME closes the connection. It must carry a
	// certificate (Certificates, GetCertificate or GetConfigForClient).
	// A MinVersion below TLS 1.2 is raised to 1.2. The Server uses a
	// clone. The default (nil) serves without TLS and refuses STARTTLS
	// with NBD_REP_ERR_POLICY.
	TLS *tls.Config
	// ClientCAs, when non-nil, requires every client to present a
	// certificate that verifies against this pool
	// (tls.RequireAndVerifyClientCert). It needs TLS. The default (nil)
	// leaves TLS.ClientAuth as given.
	ClientCAs *x509.CertPool
	// MaxConnections bounds open connections, handshakes included. A
	// connection over it is closed as soon as it is accepted, before
	// anything is read from it or allocated for it (the warning about
	// refusals is logged at most once a second). The default is 128.
	MaxConnections int
	// MaxInFlight bounds the requests one connection has in service at
	// once; the connection stops reading requests while it is reached.
	// The default is 16; it must lie in [1, 1024].
	MaxInFlight int
	// MaxPayload is the largest READ or WRITE length, advertised as the
	// maximum block (payload) size in NBD_INFO_BLOCK_SIZE. A longer READ
	// or WRITE fails with EINVAL; a refused WRITE payload is read and
	// dropped in small pieces, and one longer than 64 MiB ends the
	// connection after the error reply. TRIM, WRITE_ZEROES, CACHE and
	// BLOCK_STATUS carry no payload, and the spec lets clients send them
	// longer than this maximum (QEMU does, for discards); they are served
	// whatever their length, since none needs a buffer that grows with it.
	// One connection holds at most twice this in request and reply
	// buffers. The default is 32 MiB; it must lie in [64 KiB, 256 MiB].
	MaxPayload int
	// MaxReadBufferBytes bounds the READ buffers of all connections
	// together (data being read from a device or sent), counted by buffer
	// capacity: a READ costs its client nothing but a header, and a client
	// that does not read its replies holds those buffers until
	// IdleTimeout. A READ that does not fit waits, and its connection reads
	// no further requests meanwhile. So that such clients cannot starve
	// the others, each connection may also have one READ of at most 1 MiB
	// in service outside this bound: READ buffers total at most
	// MaxReadBufferBytes plus 1 MiB per connection. WRITE buffers are not
	// counted here: they grow only as their payload arrives, so they hold
	// no more than twice what clients actually sent, within each
	// connection's bound. The default is 256 MiB or twice MaxPayload,
	// whichever is larger; it must be at least MaxPayload rounded up to a
	// power of two.
	MaxReadBufferBytes int64
	// HandshakeTimeout bounds the whole handshake of a connection, TLS
	// included. The default is 10 seconds.
	HandshakeTimeout time.Duration
	// IdleTimeout closes a connection in transmission that has had no
	// request in service and has sent no request for this long, and one
	// whose client has read none of a reply for this long, or has sent
	// none of a request's remaining bytes for this long (the buffers that
	// connection holds go back). The default (0) never closes an idle
	// connection, as qemu-nbd does: a guest's disk may rightly sit idle
	// for hours. It must not be negative.
	IdleTimeout time.Duration
	// HandshakeFailed, when non-nil, is called with the error that ended
	// a connection's handshake (not an ABORT, nor a stop of the server),
	// from the connection's goroutine; QemuReport words it as qemu-nbd
	// reports it. It must not block. The default (nil) only logs.
	HandshakeFailed func(err error)
	// ConnState, when non-nil, is called as each connection accepted by
	// Serve changes state (see ConnState), with the net.Conn the listener
	// returned (never the TLS layer over it). StateNew comes first, on
	// Serve's goroutine, before the connection counts against
	// MaxConnections; every later call comes from the connection's own
	// goroutine, and StateClosed comes exactly once, last, before
	// Shutdown or Close can return. It is called with no lock held and
	// must not block: StateNew delays the next Accept. The default (nil)
	// reports nothing.
	ConnState func(net.Conn, ConnState)
	// ExactNames makes the empty name match only an export named "", as
	// qemu-nbd -x NAME refuses a client that asks for the default export
	// ("export '' not present"). The default (false) serves the first
	// export to it.
	ExactNames bool
	// BlockStatus, when non-nil, is called once per client
	// NBD_CMD_BLOCK_STATUS request that reached the device, with the
	// length asked for, the time it took and its error (metrics). The
	// server's own lookups (a sparse read's hole map) are not reported.
	BlockStatus func(length int64, took time.Duration, err error)
	// Logger receives the server's logs. nil means slog.Default().
	Logger *slog.Logger
}

// Defaults of Config.
const (
	DefaultMaxConnections     = 128
	DefaultMaxInFlight        = 16
	DefaultMaxPayload         = defaultMaxPayload
	DefaultMaxReadBufferBytes = 256 << 20
	DefaultHandshakeTimeout   = 10 * time.Second
	DefaultIdleTimeout        = 0
)

// Validate reports the first invalid field, naming the offending value. It
// accepts zero values, which mean defaults.
func (c *Config) Validate() error {
	if c.Exports == nil {
		return errors.New("nbd: config: no exports")
	}
	if f, ok := c.Exports.(*fixedExports); ok {
		if err := f.validate(); err != nil {
			return err
		}
	}
	if c.MaxConnections < 0 {
		return fmt.Errorf("nbd: config: MaxConnections %d is negative", c.MaxConnections)
	}
	if c.MaxInFlight < 0 || c.MaxInFlight > 1024 {
		return fmt.Errorf("nbd: config: MaxInFlight %d is outside [1, 1024]", c.MaxInFlight)
	}
	if c.MaxPayload != 0 && (c.MaxPayload < 64<<10 || c.MaxPayload > 256<<20) {
		return fmt.Errorf("nbd: config: MaxPayload %d is outside [65536, 268435456]", c.MaxPayload)
	}
	if c.MaxReadBufferBytes < 0 {
		return fmt.Errorf("nbd: config: MaxReadBufferBytes %d is negative", c.MaxReadBufferBytes)
	}
	payload := c.MaxPayload
	if payload == 0 {
		payload = DefaultMaxPayload
	}
	if c.MaxReadBufferBytes != 0 && c.MaxReadBufferBytes < int64(bufSize(payload)) {
		return fmt.Errorf("nbd: config: MaxReadBufferBytes %d is less than one buffer of MaxPayload (%d)", c.MaxReadBufferBytes, bufSize(payload))
	}
	if c.HandshakeTimeout < 0 {
		return fmt.Errorf("nbd: config: HandshakeTimeout %v is negative", c.HandshakeTimeout)
	}
	if c.IdleTimeout < 0 {
		return fmt.Errorf("nbd: config: IdleTimeout %v is negative", c.IdleTimeout)
	}
	if c.TLS != nil && len(c.TLS.Certificates) == 0 && c.TLS.GetCertificate == nil && c.TLS.GetConfigForClient == nil {
		return errors.New("nbd: config: TLS has no certificate")
	}
	if c.ClientCAs != nil && c.TLS == nil {
		return errors.New("nbd: config: ClientCAs needs TLS")
	}
	return nil
}

// withDefaults returns c with zero fields replaced by their defaults.
func (c Config) withDefaults() Config {
	if c.MaxConnections == 0 {
		c.MaxConnections = DefaultMaxConnections
	}
	if c.MaxInFlight == 0 {
		c.MaxInFlight = DefaultMaxInFlight
	}
	if c.MaxPayload == 0 {
		c.MaxPayload = DefaultMaxPayload
	}
	if c.MaxReadBufferBytes == 0 {
		c.MaxReadBufferBytes = max(DefaultMaxReadBufferBytes, 2*int64(bufSize(c.MaxPayload)))
	}
	if c.HandshakeTimeout == 0 {
		c.HandshakeTimeout = DefaultHandshakeTimeout
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c
}

// ErrServerClosed is returned by Serve after Shutdown or Close, and by a
// second Shutdown or Close.
var ErrServerClosed = errors.New("nbd: server closed")

// ConnState is where a connection is in its life, as Config.ConnState
// reports it. A connection goes New, then either Closed (refused) or
// Negotiating, then Transmission if its handshake succeeds, and Closed
// last.
type ConnState uint8

const (
	// StateNew: the connection was just accepted; nothing has been read
	// from or written to it. Every connection starts here, those then
	// refused (MaxConnections, shutdown) included.
	StateNew ConnState = iota
	// StateNegotiating: the connection was admitted and its handshake
	// (greeting, option haggling, TLS) is under way, bounded by
	// Config.HandshakeTimeout.
	StateNegotiating
	// StateTransmission: the handshake succeeded; the connection serves
	// requests.
	StateTransmission
	// StateClosed: the connection is closed and the server holds nothing
	// of it: no goroutine, no request in service, no buffer. Reported
	// exactly once, last.
	StateClosed
)

func (c ConnState) String() string {
	switch c {
	case StateNew:
		return "new"
	case StateNegotiating:
		return "negotiating"
	case StateTransmission:
		return "transmission"
	case StateClosed:
		return "closed"
	}
	return fmt.Sprintf("ConnState(%d)", uint8(c))
}

// Server serves exports over NBD (fixed newstyle handshake, structured
// replies, block status, TLS) on any number of listeners.
//
// Requests on one connection are served concurrently, up to
// Config.MaxInFlight, and replies go out in completion order; one mutex
// serializes reply writes. A READ's reply is sent only once its data has
// been read.
//
// Memory: besides a connection's handshake buffers (at most 64 KiB per
// option and 80 KiB of buffered I/O), request and reply buffers are
// bounded per connection (twice Config.MaxPayload); READ buffers, which a
// client gets for the price of a header, also for the whole server
// (Config.MaxReadBufferBytes, plus one 1 MiB READ per connection); WRITE
// buffers hold at most twice the payload bytes clients have sent.
//
// Locking: mu guards the listener and connection sets; a connection's own
// mu guards its phase. mu is taken before a connection's mu, never the
// other way, and neither is held across network or device I/O (closing a
// socket and setting a deadline excepted). The buffer budgets' mutexes are
// leaves.
//
// Safe for concurrent use. End with Shutdown (graceful) or Close.
type Server struct {
	cfg       Config
	exports   Exports
	tlsConfig *tls.Config
	log       *slog.Logger

	// ctx is canceled by Close; connection goroutines run under it.
	ctx    context.Context
	cancel context.CancelFunc
	// closing is set by the first Shutdown or Close: no new
	// connections, handshakes refused.
	closing atomic.Bool
	// conns counts connection goroutines, for Shutdown and Close.
	conns sync.WaitGroup
	// readMem bounds the READ buffers of all connections
	// (MaxReadBufferBytes).
	readMem budget
	// refused counts connections refused for MaxConnections since the
	// last warning; lastRefusal is when that warning was logged (Unix
	// nanoseconds), so that a flood logs one line a second.
	refused     atomic.Int64
	lastRefusal atomic.Int64

	mu struct {
		sync.Mutex
		listeners map[net.Listener]struct{}
		conns     map[*serverConn]struct{}
		// closed is set by Close: a second Close or Shutdown returns
		// ErrServerClosed.
		closed bool
	}
}

// New validates cfg and returns a Server for it. It returns Validate's
// error for a bad configuration.
func New(cfg Config) (*Server, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg = cfg.withDefaults()
	s := &Server{
		cfg:     cfg,
		exports: cfg.Exports,
		log:     cfg.Logger,
	}
	if cfg.TLS != nil {
		s.tlsConfig = serverTLS(cfg.TLS, cfg.ClientCAs)
	}
	s.readMem.init(math.MaxInt, cfg.MaxReadBufferBytes)
	s.ctx, s.cancel = context.WithCancel(context.Background())
	s.mu.listeners = make(map[net.Listener]struct{})
	s.mu.conns = make(map[*serverConn]struct{})
	return s, nil
}

// serverTLS returns the TLS configuration the server uses: a clone of base
// with at least TLS 1.2 and, when clientCAs is not nil, client
// certificates required and verified against clientCAs. The
// configurations a GetConfigForClient hook returns get the same
// treatment, so that the hook cannot drop the client check.
func serverTLS(base *tls.Config, clientCAs *x509.CertPool) *tls.Config {
	harden := func(t *tls.Config) {
		if t.MinVersion < tls.VersionTLS12 {
			t.MinVersion = tls.VersionTLS12
		}
		if clientCAs != nil {
			t.ClientCAs = clientCAs
			t.ClientAuth = tls.RequireAndVerifyClientCert
		}
	}
	t := base.Clone()
	harden(t)
	if get := t.GetConfigForClient; get != nil {
		t.GetConfigForClient = func(hello *tls.ClientHelloInfo) (*tls.Config, error) {
			c, err := get(hello)
			if err != nil || c == nil {
				return c, err
			}
			c = c.Clone()
			harden(c)
			return c, nil
		}
	}
	return t
}

func (s *Server) shuttingDown() bool { return s.closing.Load() }

// Serve accepts connections on l and serves them until l fails, ctx is
// done, or Shutdown or Close is called; l is closed when Serve returns.
// It returns ErrServerClosed after Shutdown or Close, ctx.Err() when ctx
// ended it, else the accept error. Connections already accepted outlive
// Serve: Shutdown or Close ends them. Serve may run on several listeners
// at once.
func (s *Server) Serve(ctx context.Context, l net.Listener) error {
	s.mu.Lock()
	if s.closing.Load() {
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
	stop := context.AfterFunc(ctx, func() { l.Close() })
	defer stop()

	var backoff time.Duration
	for {
		nc, err := l.Accept()
		if err != nil {
			switch {
			case s.closing.Load():
				return ErrServerClosed
			case ctx.Err() != nil:
				return ctx.Err()
			}
			if retryableAccept(err) {
				backoff = min(max(2*backoff, 5*time.Millisecond), time.Second)
				s.log.Warn("accept failed", "err", err, "retry_in", backoff)
				time.Sleep(backoff)
				continue
			}
			return fmt.Errorf("nbd: accept: %w", err)
		}
		backoff = 0
		s.start(nc)
	}
}

// retryableAccept reports whether an accept error passes: a timeout, a
// connection aborted before it was accepted, or running out of file
// descriptors (which closing connections will give back).
func retryableAccept(err error) bool {
	var ne net.Error
	return (errors.As(err, &ne) && ne.Timeout()) ||
		errors.Is(err, syscall.ECONNABORTED) || errors.Is(err, syscall.EMFILE) || errors.Is(err, syscall.ENFILE)
}

// start registers nc and serves it on its own goroutine, or closes it when
// the server is closing or full. Nothing is allocated for a refused
// connection.
func (s *Server) start(nc net.Conn) {
	s.connState(nc, StateNew)
	s.mu.Lock()
	switch {
	case s.closing.Load():
		s.mu.Unlock()
		nc.Close()
		s.connState(nc, StateClosed)
		return
	case len(s.mu.conns) >= s.cfg.MaxConnections:
		s.mu.Unlock()
		nc.Close()
		s.refusedOne(time.Now())
		s.connState(nc, StateClosed)
		return
	}
	c := &serverConn{srv: s, raw: nc}
	s.mu.conns[c] = struct{}{}
	s.conns.Add(1)
	s.mu.Unlock()
	go func() {
		defer s.conns.Done()
		c.log = s.log.With("remote", nc.RemoteAddr().String())
		c.log.Debug("connection accepted")
		c.serve(s.ctx)
		s.mu.Lock()
		delete(s.mu.conns, c)
		s.mu.Unlock()
		s.connState(nc, StateClosed)
	}()
}

// connState reports a connection's new state to Config.ConnState.
func (s *Server) connState(nc net.Conn, st ConnState) {
	if s.cfg.ConnState != nil {
		s.cfg.ConnState(nc, st)
	}
}

// refusedOne counts a connection refused for MaxConnections and logs the
// refusals at most once a second.
func (s *Server) refusedOne(now time.Time) {
	s.refused.Add(1)
	last := s.lastRefusal.Load()
	if now.UnixNano()-last < int64(time.Second) || !s.lastRefusal.CompareAndSwap(last, now.UnixNano()) {
		return
	}
	s.log.Warn("connections refused", "reason", "too many connections", "max", s.cfg.MaxConnections, "count", s.refused.Swap(0))
}

// Shutdown stops accepting, ends connections still in the handshake,
// stops reading requests on the others, lets the requests already read
// finish and send their replies, flushes devices written since their last
// flush, and closes the connections. It waits for all of that, or for ctx:
// then it calls Close and returns ctx.Err(). Devices are not closed. A
// second call returns ErrServerClosed.
func (s *Server) Shutdown(ctx context.Context) error {
	s.mu.Lock()
	if s.mu.closed || s.closing.Load() {
		s.mu.Unlock()
		return ErrServerClosed
	}
	s.closing.Store(true)
	for l := range s.mu.listeners {
		l.Close()
	}
	for c := range s.mu.conns {
		c.interrupt()
	}
	s.mu.Unlock()

	done := make(chan struct{})
	go func() {
		s.conns.Wait()
		close(done)
	}()
	select {
	case <-done:
		s.mu.Lock()
		s.mu.closed = true
		s.mu.Unlock()
		s.cancel()
		return nil
	case <-ctx.Done():
		s.hardClose()
		<-done
		return ctx.Err()
	}
}

// Close stops the server at once: listeners and connections are closed
// without waiting for replies. It waits for the connection goroutines,
// which end as soon as the device calls they are in return. Devices are
// not closed. A second call returns ErrServerClosed.
func (s *Server) Close() error {
	s.mu.Lock()
	if s.mu.closed {
		s.mu.Unlock()
		return ErrServerClosed
	}
	s.mu.Unlock()
	s.hardClose()
	s.conns.Wait()
	return nil
}

func (s *Server) hardClose() {
	s.mu.Lock()
	s.closing.Store(true)
	s.mu.closed = true
	for l := range s.mu.listeners {
		l.Close()
	}
	for c := range s.mu.conns {
		c.raw.Close()
	}
	s.mu.Unlock()
	s.cancel()
}

// connPhase is where a connection is in the protocol.
type connPhase uint8

const (
	phaseHandshake connPhase = iota
	phaseTransmission
)

// serverConn is one accepted connection.
type serverConn struct {
	srv *Server
	// raw is the accepted socket, under any TLS layer: closing it is the
	// hard disconnect.
	raw net.Conn
	log *slog.Logger

	mu struct {
		sync.Mutex
		phase connPhase
	}
}

// aLongTimeAgo is a deadline in the past, which interrupts blocked reads.
var aLongTimeAgo = time.Unix(1, 0)

// interrupt is Shutdown's action on one connection: a handshake is ended,
// a connection in transmission stops reading requests (its requests in
// service finish and reply).
func (c *serverConn) interrupt() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.mu.phase == phaseHandshake {
		c.raw.Close()
		return
	}
	c.raw.SetReadDeadline(aLongTimeAgo)
}

// serve runs one connection: the handshake under its deadline, then
// transmission until the client disconnects or the server stops. The
// socket is closed when it returns.
func (c *serverConn) serve(ctx context.Context) {
	s := c.srv
	s.connState(c.raw, StateNegotiating)
	c.raw.SetDeadline(time.Now().Add(s.cfg.HandshakeTimeout))
	hctx, cancel := context.WithTimeout(ctx, s.cfg.HandshakeTimeout)
	n, err := s.runHandshake(hctx, c.raw)
	cancel()
	if err != nil {
		switch {
		case errors.Is(err, errAbort):
			c.log.Debug("handshake aborted by client")
		case s.closing.Load(), errors.Is(err, io.EOF):
			c.log.Debug("handshake ended", "err", err)
		default:
			c.log.Info("handshake failed", "err", err)
		}
		if s.cfg.HandshakeFailed != nil && !errors.Is(err, errAbort) && !s.closing.Load() {
			s.cfg.HandshakeFailed(err)
		}
		c.raw.Close()
		return
	}
	c.mu.Lock()
	if s.closing.Load() {
		c.mu.Unlock()
		c.raw.Close()
		return
	}
	c.raw.SetDeadline(time.Time{})
	c.mu.phase = phaseTransmission
	c.mu.Unlock()
	s.connState(c.raw, StateTransmission)

	log := c.log.With("export", truncate(n.export.Name))
	log.Debug("transmission started", "structured", n.structured, "contexts", len(n.contexts), "tls", n.tls)
	t := newTransmission(s, c.raw, n, log)
	t.serve()
}
