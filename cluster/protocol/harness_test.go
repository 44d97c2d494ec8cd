package protocol

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"net"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// pipeListener is a net.Listener whose connections are net.Pipes made
// by its Dial, so that tests need no network and can count dials and
// wrap either end.
type pipeListener struct {
	conns chan net.Conn
	done  chan struct{}
	once  sync.Once
	dials atomic.Int32
	// wrapServer, when set, wraps the server's end of each connection.
	wrapServer func(net.Conn) net.Conn
}

func newPipeListener() *pipeListener {
	return &pipeListener{conns: make(chan net.Conn), done: make(chan struct{})}
}

func (l *pipeListener) Accept() (net.Conn, error) {
	select {
	case c := <-l.conns:
		return c, nil
	case <-l.done:
		return nil, net.ErrClosed
	}
}

func (l *pipeListener) Close() error {
	l.once.Do(func() { close(l.done) })
	return nil
}

func (l *pipeListener) Addr() net.Addr { return pipeAddr{} }

// Dial connects to the listener; it is a Dialer.
func (l *pipeListener) Dial(ctx context.Context, addr string) (net.Conn, error) {
	l.dials.Add(1)
	a, b := net.Pipe()
	if l.wrapServer != nil {
		b = l.wrapServer(b)
	}
	select {
	case l.conns <- b:
		return a, nil
	case <-l.done:
		a.Close()
		b.Close()
		return nil, errors.New("connection refused")
	case <-ctx.Done():
		a.Close()
		b.Close()
		return nil, ctx.Err()
	}
}

type pipeAddr struct{}

func (pipeAddr) Network() string { return "pipe" }
func (pipeAddr) String() string  { return "pipe" }

// logBuffer collects a Server's log lines.
type logBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *logBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *logBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// testServer is a Server on a listener, stopped at the test's end.
type testServer struct {
	s      *Server
	addr   string
	dial   Dialer
	pipe   *pipeListener // nil over TCP
	log    *logBuffer
	served chan error
}

// startServer serves h over net.Pipe (network "pipe") or TCP loopback
// ("tcp").
func startServer(t testing.TB, network string, h Handler, opts ServerOptions) *testServer {
	t.Helper()
	ts := &testServer{log: new(logBuffer), served: make(chan error, 1)}
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.NewTextHandler(ts.log, nil))
	}
	ts.s = NewServer(h, opts)
	var l net.Listener
	switch network {
	case "pipe":
		ts.pipe = newPipeListener()
		l, ts.addr, ts.dial = ts.pipe, "pipe", ts.pipe.Dial
	case "tcp":
		tl, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		l, ts.addr = tl, tl.Addr().String()
		d := &net.Dialer{}
		ts.dial = func(ctx context.Context, addr string) (net.Conn, error) { return d.DialContext(ctx, "tcp", addr) }
	default:
		t.Fatalf("network %q", network)
	}
	go func() { ts.served <- ts.s.Serve(l) }()
	t.Cleanup(func() { ts.stop(t) })
	return ts
}

// stop shuts the server down once and checks Serve's result.
func (ts *testServer) stop(t testing.TB) {
	sctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := ts.s.Shutdown(sctx); err != nil && err != ErrClosed {
		t.Errorf("shutdown: %v", err)
	}
	if err := <-ts.served; err != nil && err != ErrServerClosed {
		t.Errorf("serve: %v", err)
	}
	ts.served <- ErrServerClosed // for a second stop
}

// client dials a Client to the server, closed at the test's end.
func (ts *testServer) client(t testing.TB) *Client {
	t.Helper()
	conn, err := ts.dial(ctx, ts.addr)
	if err != nil {
		t.Fatal(err)
	}
	c := NewClient(conn)
	t.Cleanup(func() { c.Close() })
	return c
}

// noLeaks fails the test if goroutines started during it outlive it.
func noLeaks(t *testing.T) {
	base := runtime.NumGoroutine()
	t.Cleanup(func() {
		deadline := time.Now().Add(5 * time.Second)
		for runtime.NumGoroutine() > base {
			if time.Now().After(deadline) {
				buf := make([]byte, 1<<20)
				t.Errorf("%d goroutines, %d before the test:\n%s", runtime.NumGoroutine(), base, buf[:runtime.Stack(buf, true)])
				return
			}
			time.Sleep(10 * time.Millisecond)
		}
	})
}

// flipConn flips one byte of the bytes written through it, at stream
// offset at.
type flipConn struct {
	net.Conn
	mu      sync.Mutex
	written int
	at      int
}

func (c *flipConn) Write(p []byte) (int, error) {
	c.mu.Lock()
	if c.at >= c.written && c.at < c.written+len(p) {
		q := append([]byte(nil), p...)
		q[c.at-c.written] ^= 0x40
		p = q
	}
	c.written += len(p)
	c.mu.Unlock()
	return c.Conn.Write(p)
}

func discardLogger() *slog.Logger { return slog.New(slog.DiscardHandler) }
