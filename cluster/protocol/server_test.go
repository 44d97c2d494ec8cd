package protocol

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ovis-storage/ovis/cluster/object"
)

// echoHandler answers reads with bytes derived from the request, writes
// with their payload reversed, and sleeps up to maxSleep first.
type echoHandler struct {
	maxSleep time.Duration
	arrived  atomic.Int64
	finished atomic.Int64
	inverted atomic.Int64 // requests finished in another order than they came
	served   atomic.Int64
}

func readData(req *Request) []byte {
	p := make([]byte, req.Length)
	for i := range p {
		p[i] = byte(uint64(req.Object) + req.Offset + uint64(i))
	}
	return p
}

func (h *echoHandler) Serve(ctx context.Context, req *Request, resp *Response) {
	h.served.Add(1)
	n := h.arrived.Add(1)
	if h.maxSleep > 0 {
		time.Sleep(rand.N(h.maxSleep))
	}
	if h.finished.Add(1) != n {
		h.inverted.Add(1)
	}
	resp.Epoch = req.Epoch + 1
	resp.Version = req.Offset + 7
	switch req.Op {
	case OpRead:
		resp.Payload = append(resp.Payload, readData(req)...)
	case OpWrite:
		for i := len(req.Payload) - 1; i >= 0; i-- {
			resp.Payload = append(resp.Payload, req.Payload[i])
		}
	case OpStat:
		resp.Payload = AppendObjectInfos(resp.Payload, []ObjectInfo{{ID: req.Object, Version: 3, Allocated: 4096}})
	case OpFlush:
	default:
		resp.SetError(StatusNoEnt, fmt.Sprintf("no %s", req.Object))
	}
}

func reversed(p []byte) []byte {
	q := make([]byte, len(p))
	for i := range p {
		q[len(p)-1-i] = p[i]
	}
	return q
}

// TestOutOfOrder: 1000 concurrent calls on one connection, answered in
// random order, each gets its own reply.
func TestOutOfOrder(t *testing.T) {
	for _, network := range []string{"pipe", "tcp"} {
		t.Run(network, func(t *testing.T) {
			noLeaks(t)
			h := &echoHandler{maxSleep: 2 * time.Millisecond}
			ts := startServer(t, network, h, ServerOptions{MaxInFlight: 128})
			c := ts.client(t)
			const n = 1000
			var wg sync.WaitGroup
			errs := make(chan error, n)
			for i := range n {
				wg.Go(func() {
					id := object.Make(object.VDI(i+1), uint32(i))
					var resp Response
					if i%2 == 0 {
						req := &Request{Op: OpRead, Epoch: uint64(i), Object: id, Offset: uint64(i), Length: uint32(i % 300)}
						if err := c.Call(ctx, req, &resp); err != nil {
							errs <- err
							return
						}
						if string(resp.Payload) != string(readData(req)) {
							errs <- fmt.Errorf("read %d: got %x", i, resp.Payload)
						}
					} else {
						p := []byte(fmt.Sprintf("write number %d of object %s", i, id))
						req := &Request{Op: OpWrite, Flags: FlagSync, Epoch: uint64(i), Object: id, Offset: uint64(i), Payload: p}
						if err := c.Call(ctx, req, &resp); err != nil {
							errs <- err
							return
						}
						if string(resp.Payload) != string(reversed(p)) {
							errs <- fmt.Errorf("write %d: got %q", i, resp.Payload)
						}
					}
					if resp.Epoch != uint64(i)+1 || resp.Version != uint64(i)+7 || resp.Status != StatusOK {
						errs <- fmt.Errorf("call %d: response %+v", i, resp)
					}
				})
			}
			wg.Wait()
			close(errs)
			for err := range errs {
				t.Error(err)
			}
			if h.served.Load() != n {
				t.Errorf("handler served %d, want %d", h.served.Load(), n)
			}
			if h.inverted.Load() == 0 {
				t.Errorf("no request finished out of order")
			}
			t.Logf("%d of %d requests finished out of order", h.inverted.Load(), n)
		})
	}
}

// blockHandler blocks every request until release is closed (or its
// context ends, when honourCtx), telling started about each.
type blockHandler struct {
	started   chan uint64
	release   chan struct{}
	honourCtx bool
	inService atomic.Int32
	maxSeen   atomic.Int32
}

func newBlockHandler() *blockHandler {
	return &blockHandler{started: make(chan uint64, 1000), release: make(chan struct{})}
}

func (h *blockHandler) Serve(ctx context.Context, req *Request, resp *Response) {
	n := h.inService.Add(1)
	defer h.inService.Add(-1)
	for {
		m := h.maxSeen.Load()
		if n <= m || h.maxSeen.CompareAndSwap(m, n) {
			break
		}
	}
	h.started <- uint64(req.Object)
	if h.honourCtx {
		select {
		case <-h.release:
		case <-ctx.Done():
			resp.SetError(StatusShutdown, "stopping")
			return
		}
	} else {
		<-h.release
	}
	resp.Version = uint64(req.Object)
	if req.Op == OpRead {
		resp.SetError(StatusNoEnt, "blockHandler serves no data")
	}
}

// wait waits for n requests to start, failing on an early error.
func (h *blockHandler) wait(t *testing.T, n int, errs chan error) {
	t.Helper()
	for range n {
		select {
		case <-h.started:
		case err := <-errs:
			t.Fatalf("call ended before starting: %v", err)
		case <-time.After(10 * time.Second):
			t.Fatal("requests did not start")
		}
	}
}

// TestCancel: a call whose context ends returns at once; its reply is
// dropped when it comes and the connection goes on.
func TestCancel(t *testing.T) {
	noLeaks(t)
	h := newBlockHandler()
	ts := startServer(t, "pipe", h, ServerOptions{})
	c := ts.client(t)
	cctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() {
		var resp Response
		done <- c.Call(cctx, &Request{Op: OpRead, Object: 1, Length: 4096}, &resp)
	}()
	<-h.started
	cancel()
	select {
	case err := <-done:
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("cancelled call: %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("cancelled call did not return")
	}
	close(h.release)
	var resp Response
	if err := c.Call(ctx, &Request{Op: OpStat, Object: 2}, &resp); err != nil || resp.Version != 2 {
		t.Fatalf("call after a cancel: %v, %+v", err, resp)
	}
	// A call cancelled before it starts never reaches the server.
	cancelled, cancel2 := context.WithCancel(ctx)
	cancel2()
	if err := c.Call(cancelled, &Request{Op: OpStat, Object: 3}, &resp); !errors.Is(err, context.Canceled) {
		t.Fatalf("call with a cancelled context: %v", err)
	}
	c.mu.Lock()
	pending := len(c.mu.pending)
	c.mu.Unlock()
	if pending != 0 {
		t.Fatalf("%d calls still pending", pending)
	}
}

// TestShutdownInFlight: Shutdown waits for the requests in service and
// their replies, then closes.
func TestShutdownInFlight(t *testing.T) {
	noLeaks(t)
	h := newBlockHandler()
	ts := startServer(t, "pipe", h, ServerOptions{})
	c := ts.client(t)
	const n = 10
	errs := make(chan error, n)
	for i := range n {
		go func() {
			var resp Response
			err := c.Call(ctx, &Request{Op: OpStat, Object: object.ID(i + 1)}, &resp)
			if err == nil && resp.Version != uint64(i+1) {
				err = fmt.Errorf("call %d: version %d", i, resp.Version)
			}
			errs <- err
		}()
	}
	h.wait(t, n, errs)
	stopped := make(chan error, 1)
	go func() { stopped <- ts.s.Shutdown(ctx) }()
	select {
	case err := <-stopped:
		t.Fatalf("Shutdown returned %v with %d requests in service", err, n)
	case <-time.After(50 * time.Millisecond):
	}
	close(h.release)
	for range n {
		if err := <-errs; err != nil {
			t.Error(err)
		}
	}
	if err := <-stopped; err != nil {
		t.Fatalf("shutdown: %v", err)
	}
	if err := <-ts.served; err != ErrServerClosed {
		t.Fatalf("serve: %v", err)
	}
	ts.served <- ErrServerClosed
	var resp Response
	if err := c.Call(ctx, &Request{Op: OpStat, Object: 1}, &resp); !errors.Is(err, ErrConnection) {
		t.Fatalf("call after shutdown: %v", err)
	}
	if err := ts.s.Shutdown(ctx); err != ErrClosed {
		t.Fatalf("second shutdown: %v", err)
	}
}

// TestShutdownHard: when Shutdown's context ends, handlers are cancelled
// and connections closed; everything still ends.
func TestShutdownHard(t *testing.T) {
	noLeaks(t)
	h := newBlockHandler()
	h.honourCtx = true
	ts := startServer(t, "tcp", h, ServerOptions{})
	c := ts.client(t)
	errs := make(chan error, 3)
	for i := range 3 {
		go func() {
			var resp Response
			errs <- c.Call(ctx, &Request{Op: OpStat, Object: object.ID(i + 1)}, &resp)
		}()
	}
	h.wait(t, 3, errs)
	sctx, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
	defer cancel()
	if err := ts.s.Shutdown(sctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("hard shutdown: %v", err)
	}
	for range 3 {
		if err := <-errs; !errors.Is(err, ErrConnection) && StatusOf(err) != StatusShutdown {
			t.Errorf("call during hard stop: %v", err)
		}
	}
}

// TestDeadPeer: a peer that dies fails every pending call with an error
// naming it, and later calls as not sent.
func TestDeadPeer(t *testing.T) {
	noLeaks(t)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	const n = 5
	go func() {
		conn, err := l.Accept()
		if err != nil {
			return
		}
		br := bufio.NewReader(conn)
		var r Request
		for range n {
			if ReadRequest(br, &r) != nil {
				break
			}
		}
		conn.Close()
	}()
	conn, err := net.Dial("tcp", l.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	c := NewClient(conn)
	defer c.Close()
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			var resp Response
			err := c.Call(ctx, &Request{Op: OpWrite, Object: object.ID(i), Payload: []byte("x")}, &resp)
			if !errors.Is(err, ErrConnection) || !strings.Contains(err.Error(), l.Addr().String()) {
				t.Errorf("pending call: %v; want ErrConnection naming %s", err, l.Addr())
			}
		})
	}
	wg.Wait()
	var resp Response
	if err := c.Call(ctx, &Request{Op: OpStat}, &resp); !errors.Is(err, ErrNotSent) || !errors.Is(err, ErrConnection) {
		t.Fatalf("call on a dead connection: %v", err)
	}
	if err := c.Close(); err != nil {
		t.Fatalf("close: %v", err)
	}
	if err := c.Close(); err != ErrClosed {
		t.Fatalf("second close: %v", err)
	}
}

// TestClientClose: Close fails pending calls and waits.
func TestClientClose(t *testing.T) {
	noLeaks(t)
	h := newBlockHandler()
	ts := startServer(t, "pipe", h, ServerOptions{})
	defer close(h.release)
	c := ts.client(t)
	done := make(chan error, 1)
	go func() {
		var resp Response
		done <- c.Call(ctx, &Request{Op: OpStat, Object: 1}, &resp)
	}()
	<-h.started
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	if err := <-done; !errors.Is(err, ErrConnection) || !errors.Is(err, ErrClosed) {
		t.Fatalf("pending call at Close: %v", err)
	}
}

// TestChecksumCorruption: a byte flipped on the wire in a request's
// payload gets StatusChecksum without reaching the handler; in a
// response's, the call fails with ErrChecksum. The connection goes on.
func TestChecksumCorruption(t *testing.T) {
	t.Run("request", func(t *testing.T) {
		noLeaks(t)
		h := &echoHandler{}
		ts := startServer(t, "pipe", h, ServerOptions{})
		conn, err := ts.dial(ctx, ts.addr)
		if err != nil {
			t.Fatal(err)
		}
		c := NewClient(&flipConn{Conn: conn, at: RequestHeaderLen + 5})
		defer c.Close()
		var resp Response
		err = c.Call(ctx, &Request{Op: OpWrite, Object: 9, Payload: []byte("some data to corrupt")}, &resp)
		if StatusOf(err) != StatusChecksum || resp.Status != StatusChecksum {
			t.Fatalf("corrupted write: %v", err)
		}
		if h.served.Load() != 0 {
			t.Fatalf("handler saw the corrupted write")
		}
		if err := c.Call(ctx, &Request{Op: OpWrite, Object: 9, Payload: []byte("abc")}, &resp); err != nil || string(resp.Payload) != "cba" {
			t.Fatalf("next write: %v %q", err, resp.Payload)
		}
	})
	t.Run("response", func(t *testing.T) {
		noLeaks(t)
		h := &echoHandler{}
		ts := startServer(t, "pipe", h, ServerOptions{})
		ts.pipe.wrapServer = func(c net.Conn) net.Conn { return &flipConn{Conn: c, at: ResponseHeaderLen + 1} }
		c := ts.client(t)
		var resp Response
		if err := c.Call(ctx, &Request{Op: OpRead, Object: 9, Length: 100}, &resp); !errors.Is(err, ErrChecksum) {
			t.Fatalf("corrupted read: %v", err)
		}
		if err := c.Call(ctx, &Request{Op: OpRead, Object: 9, Length: 100}, &resp); err != nil || string(resp.Payload) != string(readData(&Request{Object: 9, Length: 100})) {
			t.Fatalf("next read: %v", err)
		}
	})
}

// rawRequest encodes a request header with fields patched by f, and
// payload bytes after it.
func rawRequest(r *Request, f func(b []byte), payload []byte) []byte {
	b := make([]byte, RequestHeaderLen)
	n := int(r.Length)
	if payload != nil {
		n = len(payload)
	}
	putRequestHeader(b, r, r.Handle, payload != nil, n, Checksum(payload))
	if f != nil {
		f(b)
	}
	return append(b, payload...)
}

// TestHostileRequests: requests the op table refuses get an error reply
// and the connection goes on; broken framing closes it, logged with the
// peer and the field.
func TestHostileRequests(t *testing.T) {
	valid := rawRequest(&Request{Op: OpStat, Handle: 99, Object: 5}, nil, nil)
	tests := []struct {
		name   string
		in     []byte
		status Status // reply to handle 1; the valid request then gets its reply
		closes string // the log says this and the connection closes
	}{
		{"unknown op", rawRequest(&Request{Op: 200, Handle: 1}, nil, nil), StatusUnsupported, ""},
		{"unknown op with payload", rawRequest(&Request{Op: 0, Handle: 1}, nil, []byte("skip me")), StatusUnsupported, ""},
		{"read with payload", rawRequest(&Request{Op: OpRead, Handle: 1}, nil, []byte("x")), StatusEINVAL, ""},
		{"read too long", rawRequest(&Request{Op: OpRead, Handle: 1, Length: MaxPayload + 1}, nil, nil), StatusTooBig, ""},
		{"read past object", rawRequest(&Request{Op: OpRead, Handle: 1, Offset: MaxObjectSpan, Length: 1}, nil, nil), StatusEINVAL, ""},
		{"write offset overflow", rawRequest(&Request{Op: OpWrite, Handle: 1, Offset: 1<<64 - 1}, nil, []byte("x")), StatusEINVAL, ""},
		{"write without payload", rawRequest(&Request{Op: OpWrite, Handle: 1, Length: 3}, nil, nil), StatusEINVAL, ""},
		{"unknown flag", rawRequest(&Request{Op: OpWrite, Handle: 1, Flags: 1 << 5}, nil, []byte("x")), StatusEINVAL, ""},
		{"no-unmap on write", rawRequest(&Request{Op: OpWrite, Handle: 1, Flags: FlagNoUnmap}, nil, []byte("x")), StatusEINVAL, ""},
		{"sync on read", rawRequest(&Request{Op: OpRead, Handle: 1, Flags: FlagSync, Length: 1}, nil, nil), StatusEINVAL, ""},
		{"flush with offset", rawRequest(&Request{Op: OpFlush, Handle: 1, Offset: 4}, nil, nil), StatusEINVAL, ""},
		{"list too long", rawRequest(&Request{Op: OpList, Handle: 1, Length: MaxListEntries + 1}, nil, nil), StatusEINVAL, ""},
		{"hello too long", rawRequest(&Request{Op: OpHello, Handle: 1}, nil, make([]byte, MaxHelloPayload+1)), StatusEINVAL, ""},
		{"gated read", rawRequest(&Request{Op: OpRead, Handle: 1, Flags: FlagGated, Gate: 7, Length: 1}, nil, nil), StatusEINVAL, ""},
		{"gated flush", rawRequest(&Request{Op: OpFlush, Handle: 1, Flags: FlagGated, Gate: 7}, nil, nil), StatusEINVAL, ""},
		{"settle without payload", rawRequest(&Request{Op: OpSettle, Handle: 1}, nil, nil), StatusEINVAL, ""},
		{"settle of no ids", rawRequest(&Request{Op: OpSettle, Handle: 1}, nil, []byte{}), StatusEINVAL, ""},
		{"settle of a part id", rawRequest(&Request{Op: OpSettle, Handle: 1}, nil, make([]byte, 12)), StatusEINVAL, ""},
		{"settle with offset", rawRequest(&Request{Op: OpSettle, Handle: 1, Offset: 8}, nil, make([]byte, 8)), StatusEINVAL, ""},
		{"settle too long", rawRequest(&Request{Op: OpSettle, Handle: 1}, nil, make([]byte, MaxSettlePayload+8)), StatusEINVAL, ""},
		{"gated settle", rawRequest(&Request{Op: OpSettle, Handle: 1, Flags: FlagGated}, nil, make([]byte, 8)), StatusEINVAL, ""},
		{"bad crc", rawRequest(&Request{Op: OpWrite, Handle: 1}, func(b []byte) { b[63] ^= 1 }, []byte("data")), StatusChecksum, ""},
		{"bad magic", rawRequest(&Request{Op: OpStat, Handle: 1}, func(b []byte) { b[1] = 'x' }, nil), 0, "magic"},
		{"bad version", rawRequest(&Request{Op: OpStat, Handle: 1}, func(b []byte) { b[4] = 9 }, nil), 0, "version"},
		{"length over max", rawRequest(&Request{Op: OpWrite, Handle: 1}, func(b []byte) { b[6] |= 0x80; binary.BigEndian.PutUint32(b[56:], MaxPayload+1) }, nil), 0, "length"},
		{"crc without payload", rawRequest(&Request{Op: OpStat, Handle: 1}, func(b []byte) { b[60] = 1 }, nil), 0, "crc32c"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			noLeaks(t)
			ts := startServer(t, "pipe", &echoHandler{}, ServerOptions{})
			conn, err := ts.dial(ctx, ts.addr)
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close()
			go func() {
				conn.Write(tt.in)
				conn.Write(valid)
			}()
			conn.SetReadDeadline(time.Now().Add(10 * time.Second))
			var resp Response
			err = ReadResponse(conn, &resp)
			if tt.closes != "" {
				if err != io.EOF {
					t.Fatalf("after a broken header: %v, %+v; want the connection closed", err, resp)
				}
				// Only the first handshake goroutine stops writing here.
				if log := ts.log.String(); !strings.Contains(log, "peer=pipe") || !strings.Contains(log, tt.closes) {
					t.Fatalf("log %q does not name the peer and %q", log, tt.closes)
				}
				return
			}
			// The two replies come in either order.
			var second Response
			if err == nil {
				err = ReadResponse(conn, &second)
			}
			if resp.Handle == 99 {
				resp, second = second, resp
			}
			if err != nil || resp.Handle != 1 || resp.Status != tt.status || len(resp.Payload) == 0 {
				t.Fatalf("reply %+v, %v; want handle 1 status %s with a message", resp, err, tt.status)
			}
			if second.Handle != 99 || second.Status != StatusOK {
				t.Fatalf("valid request after: %+v", second)
			}
		})
	}
}

// TestInFlightBound: a connection never has more than MaxInFlight
// requests, nor more than MaxInFlightBytes of them, in service.
func TestInFlightBound(t *testing.T) {
	tests := []struct {
		name string
		opts ServerOptions
		req  Request
		want int32
	}{
		{"requests", ServerOptions{MaxInFlight: 4}, Request{Op: OpStat}, 4},
		{"bytes", ServerOptions{MaxInFlight: 64, MaxInFlightBytes: MaxPayload}, Request{Op: OpRead, Length: MaxObjectSpan}, 1},
		{"bytes two", ServerOptions{MaxInFlight: 64, MaxInFlightBytes: 2 * MaxPayload}, Request{Op: OpRead, Length: MaxPayload/2 + 1}, 3},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			noLeaks(t)
			h := newBlockHandler()
			ts := startServer(t, "pipe", h, tt.opts)
			c := ts.client(t)
			const n = 12
			errs := make(chan error, n)
			for range n {
				go func() {
					req := tt.req
					var resp Response
					errs <- c.Call(ctx, &req, &resp)
				}()
			}
			h.wait(t, int(tt.want), errs)
			time.Sleep(50 * time.Millisecond) // room for one too many to start
			if got := h.inService.Load(); got != tt.want {
				t.Fatalf("%d in service, want %d", got, tt.want)
			}
			close(h.release)
			for range n {
				if err := <-errs; err != nil && StatusOf(err) != StatusNoEnt {
					t.Error(err)
				}
			}
			if got := h.maxSeen.Load(); got != tt.want {
				t.Fatalf("at most %d in service, want %d", got, tt.want)
			}
		})
	}
}

// TestMaxConns: a connection over MaxConns is closed at once.
func TestMaxConns(t *testing.T) {
	noLeaks(t)
	ts := startServer(t, "pipe", &echoHandler{}, ServerOptions{MaxConns: 1})
	c := ts.client(t)
	var resp Response
	if err := c.Call(ctx, &Request{Op: OpStat}, &resp); err != nil {
		t.Fatal(err)
	}
	c2 := ts.client(t)
	if err := c2.Call(ctx, &Request{Op: OpStat}, &resp); !errors.Is(err, ErrConnection) {
		t.Fatalf("call over MaxConns: %v", err)
	}
	if !strings.Contains(ts.log.String(), "too many connections") {
		t.Fatalf("log: %s", ts.log.String())
	}
}

func TestServerOptionsValidate(t *testing.T) {
	for _, o := range []ServerOptions{{MaxInFlight: -1}, {MaxInFlightBytes: 100}, {MaxConns: -2}, {IdleTimeout: -1}} {
		if err := o.Validate(); err == nil {
			t.Errorf("%+v: no error", o)
		}
		if err := NewServer(&echoHandler{}, o).Serve(newPipeListener()); err == nil || err == ErrServerClosed {
			t.Errorf("Serve with %+v: %v", o, err)
		}
	}
	if err := (ServerOptions{}).Validate(); err != nil {
		t.Errorf("zero options: %v", err)
	}
}

// TestIdleTimeout: an idle connection ends after IdleTimeout when set.
func TestIdleTimeout(t *testing.T) {
	noLeaks(t)
	ts := startServer(t, "pipe", &echoHandler{}, ServerOptions{IdleTimeout: 30 * time.Millisecond})
	c := ts.client(t)
	select {
	case <-c.done:
	case <-time.After(5 * time.Second):
		t.Fatal("idle connection kept")
	}
}

// TestShortRead: a successful read reply must be exactly the length
// asked; the server turns a short one into StatusEIO, and a client
// refuses one from a peer that sends it anyway.
func TestShortRead(t *testing.T) {
	noLeaks(t)
	short := HandlerFunc(func(ctx context.Context, req *Request, resp *Response) {
		resp.Payload = append(resp.Payload, "abc"...)
	})
	ts := startServer(t, "pipe", short, ServerOptions{})
	c := ts.client(t)
	var resp Response
	if err := c.Call(ctx, &Request{Op: OpRead, Length: 10}, &resp); StatusOf(err) != StatusEIO {
		t.Fatalf("short read served: %v", err)
	}
	if err := c.Call(ctx, &Request{Op: OpRead, Length: 3}, &resp); err != nil || string(resp.Payload) != "abc" {
		t.Fatalf("exact read: %v %q", err, resp.Payload)
	}

	a, b := net.Pipe()
	go func() {
		defer b.Close()
		var r Request
		if ReadRequest(b, &r) == nil {
			WriteResponse(b, &Response{Handle: r.Handle, Payload: []byte("ab")})
		}
	}()
	c2 := NewClient(a)
	defer c2.Close()
	if err := c2.Call(ctx, &Request{Op: OpRead, Length: 10}, &resp); !errors.Is(err, ErrMalformed) {
		t.Fatalf("short read received: %v", err)
	}
}

// TestPeerStopsReading: a peer that sends requests and never reads the
// replies holds at most MaxInFlight of them in service and loses the
// connection after IOTimeout.
func TestPeerStopsReading(t *testing.T) {
	noLeaks(t)
	h := &echoHandler{}
	ts := startServer(t, "pipe", h, ServerOptions{MaxInFlight: 4, IOTimeout: 100 * time.Millisecond})
	conn, err := ts.dial(ctx, ts.addr)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	req := rawRequest(&Request{Op: OpRead, Length: 4096}, nil, nil)
	done := make(chan error, 1)
	go func() {
		for {
			if _, err := conn.Write(req); err != nil {
				done <- err
				return
			}
		}
	}()
	select {
	case err := <-done:
		if !errors.Is(err, io.ErrClosedPipe) && !errors.Is(err, io.EOF) {
			t.Logf("write ended with %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("server still reading from a peer that reads nothing")
	}
	// Replies wait in the writer's 64 KiB buffer, one is being written
	// when the writer blocks, and MaxInFlight more are in service.
	if got, max := h.served.Load(), int64(4+1+(64<<10)/(ResponseHeaderLen+4096)); got > max {
		t.Fatalf("%d requests served for a peer that read no reply; MaxInFlight 4 allows %d", got, max)
	}
	if !strings.Contains(ts.log.String(), "protocol write") {
		t.Fatalf("log: %s", ts.log.String())
	}
}

// TestEchoPayload: a handler may answer with the request's payload
// itself; the buffer is not reused before the reply is written.
func TestEchoPayload(t *testing.T) {
	noLeaks(t)
	echo := HandlerFunc(func(ctx context.Context, req *Request, resp *Response) {
		if req.Op == OpWrite {
			resp.Payload = req.Payload
		}
	})
	ts := startServer(t, "pipe", echo, ServerOptions{})
	c := ts.client(t)
	var wg sync.WaitGroup
	for i := range 200 {
		wg.Go(func() {
			p := make([]byte, 4096+i)
			for j := range p {
				p[j] = byte(i)
			}
			var resp Response
			if err := c.Call(ctx, &Request{Op: OpWrite, Payload: p}, &resp); err != nil {
				t.Error(err)
				return
			}
			if string(resp.Payload) != string(p) {
				t.Errorf("call %d: echo differs", i)
			}
		})
	}
	wg.Wait()
}
