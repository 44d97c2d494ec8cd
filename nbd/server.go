package nbd

import (
	"context"
	"crypto/tls"
	"crypto/x509"
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

// Export is one block device offered under a name.
type Export struct {
	// Name is what clients ask for (NBD_OPT_GO, NBD_OPT_EXPORT_NAME).
	// At most 4096 bytes. A client asking for the empty name gets the
	// export named "" if there is one, else the first export.
	Name string
	// Description is shown to humans (NBD_OPT_LIST, NBD_INFO_DESCRIPTION).
	// At most 4096 bytes; empty means none.
	Description string
	// Device serves the export's bytes. The Server does not close it.
	Device block.Device
	// ReadOnly advertises NBD_FLAG_READ_ONLY; WRITE, TRIM and
	// WRITE_ZEROES then fail with EPERM before reaching the Device.
	ReadOnly bool
	// MultiConn advertises NBD_FLAG_CAN_MULTI_CONN: the Device is one
	// shared object whose Flush and FUA writes cover writes made through
	// every connection, so a client may spread its requests over several
	// connections. Leave it false for a Device whose caching is per
	// connection. The default (false) makes clients use one connection.
	MultiConn bool
	// CanFastZero reports whether WriteZeroes of [off, off+n) with the
	// given mayUnmap is certain to be faster than writing zeros, with no
	// fallback to writing them. It answers NBD_CMD_FLAG_FAST_ZERO: true
	// lets the request proceed, false fails it at once with ENOTSUP and
	// leaves the export untouched. nil fails every FAST_ZERO request with
	// ENOTSUP, which the spec allows (the flag is still advertised), and
	// is the safe choice because block.Device has no way to forbid the
	// slow fallback (block.Raw writes zeros when fallocate is missing).
	CanFastZero func(off, n int64, mayUnmap bool) bool
}

// exportFlags is the transmission flags advertised for e. HAS_FLAGS,
// SEND_FLUSH, SEND_FUA and SEND_CACHE are always set; a writable export
// adds SEND_TRIM, SEND_WRITE_ZEROES and SEND_FAST_ZERO, a read-only one
// READ_ONLY; SEND_DF needs structured replies; CAN_MULTI_CONN only when
// configured.
func exportFlags(e *Export, structured bool) transmissionFlags {
	f := flagHasFlags | flagSendFlush | flagSendFUA | flagSendCache
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
	// Exports are the devices served. At least one is required; names
	// must be distinct.
	Exports []Export
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
	// MaxConnections bounds open connections, handshakes included;
	// connections over it are closed at once. The default is 128.
	MaxConnections int
	// MaxInFlight bounds the requests one connection has in service at
	// once; the connection stops reading requests while it is reached.
	// The default is 16.
	MaxInFlight int
	// MaxPayload is the largest READ or WRITE length, advertised as the
	// maximum block size (NBD_INFO_BLOCK_SIZE). Longer ones fail with
	// EINVAL. One connection holds at most twice this in request and
	// reply buffers. The default is 32 MiB; it must lie in
	// [64 KiB, 256 MiB].
	MaxPayload int
	// HandshakeTimeout bounds the whole handshake of a connection, TLS
	// included. The default is 10 seconds.
	HandshakeTimeout time.Duration
	// Logger receives the server's logs. nil means slog.Default().
	Logger *slog.Logger
}

// Defaults of Config.
const (
	DefaultMaxConnections   = 128
	DefaultMaxInFlight      = 16
	DefaultMaxPayload       = defaultMaxPayload
	DefaultHandshakeTimeout = 10 * time.Second
)

// Validate reports the first invalid field, naming the offending value. It
// accepts zero values, which mean defaults.
func (c *Config) Validate() error {
	if len(c.Exports) == 0 {
		return errors.New("nbd: config: no exports")
	}
	seen := make(map[string]bool, len(c.Exports))
	for i, e := range c.Exports {
		switch {
		case e.Device == nil:
			return fmt.Errorf("nbd: config: export %d (%q) has no device", i, truncate(e.Name))
		case len(e.Name) > maxStringLen:
			return fmt.Errorf("nbd: config: export %d name is %d bytes, more than %d", i, len(e.Name), maxStringLen)
		case len(e.Description) > maxStringLen:
			return fmt.Errorf("nbd: config: export %q description is %d bytes, more than %d", truncate(e.Name), len(e.Description), maxStringLen)
		case e.Device.Size() < 0:
			return fmt.Errorf("nbd: config: export %q has negative size %d", truncate(e.Name), e.Device.Size())
		case seen[e.Name]:
			return fmt.Errorf("nbd: config: export name %q used twice", truncate(e.Name))
		}
		seen[e.Name] = true
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
	if c.HandshakeTimeout < 0 {
		return fmt.Errorf("nbd: config: HandshakeTimeout %v is negative", c.HandshakeTimeout)
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

// Server serves exports over NBD (fixed newstyle handshake, structured
// replies, block status, TLS) on any number of listeners.
//
// Requests on one connection are served concurrently, up to
// Config.MaxInFlight, and replies go out in completion order; one mutex
// serializes reply writes. A READ's reply is sent only once its data has
// been read.
//
// Locking: mu guards the listener and connection sets; a connection's own
// mu guards its phase. mu is taken before a connection's mu, never the
// other way, and neither is held across network or device I/O (closing a
// socket and setting a deadline excepted).
//
// Safe for concurrent use. End with Shutdown (graceful) or Close.
type Server struct {
	cfg       Config
	exports   []Export
	byName    map[string]*Export
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
		exports: append([]Export(nil), cfg.Exports...),
		log:     cfg.Logger,
	}
	s.byName = make(map[string]*Export, len(s.exports))
	for i := range s.exports {
		s.byName[s.exports[i].Name] = &s.exports[i]
	}
	if cfg.TLS != nil {
		t := cfg.TLS.Clone()
		if t.MinVersion < tls.VersionTLS12 {
			t.MinVersion = tls.VersionTLS12
		}
		if cfg.ClientCAs != nil {
			t.ClientCAs = cfg.ClientCAs
			t.ClientAuth = tls.RequireAndVerifyClientCert
		}
		s.tlsConfig = t
	}
	s.ctx, s.cancel = context.WithCancel(context.Background())
	s.mu.listeners = make(map[net.Listener]struct{})
	s.mu.conns = make(map[*serverConn]struct{})
	return s, nil
}

// lookup returns the export a client names, or nil. The empty name picks
// the export named "" or else the first one.
func (s *Server) lookup(name string) *Export {
	if e, ok := s.byName[name]; ok {
		return e
	}
	if name == "" {
		return &s.exports[0]
	}
	return nil
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
// the server is closing or full.
func (s *Server) start(nc net.Conn) {
	c := &serverConn{srv: s, raw: nc, log: s.log.With("remote", nc.RemoteAddr().String())}
	s.mu.Lock()
	switch {
	case s.closing.Load():
		s.mu.Unlock()
		nc.Close()
		return
	case len(s.mu.conns) >= s.cfg.MaxConnections:
		s.mu.Unlock()
		c.log.Warn("connection refused", "reason", "too many connections", "max", s.cfg.MaxConnections)
		nc.Close()
		return
	}
	s.mu.conns[c] = struct{}{}
	s.conns.Add(1)
	s.mu.Unlock()
	c.log.Debug("connection accepted")
	go func() {
		defer s.conns.Done()
		defer func() {
			s.mu.Lock()
			delete(s.mu.conns, c)
			s.mu.Unlock()
		}()
		c.serve(s.ctx)
	}()
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
// transmission until the client disconnects or the server stops.
func (c *serverConn) serve(ctx context.Context) {
	s := c.srv
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

	log := c.log.With("export", truncate(n.export.Name))
	log.Debug("transmission started", "structured", n.structured, "contexts", len(n.contexts), "tls", n.tls)
	t := newTransmission(s, c.raw, n, log)
	t.serve()
}
