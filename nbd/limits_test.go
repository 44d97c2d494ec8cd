package nbd

import (
	"bytes"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"slices"
	"sync"
	"testing"
	"time"
)

// Tests of the limits hostile clients run into: the idle timeout, the
// bound on READ buffers, oversized requests, the connection states the
// ConnState hook sees, and client certificates.

// stateLog records the ConnState calls of each connection.
type stateLog struct {
	mu     sync.Mutex
	states map[net.Conn][]ConnState
	order  []net.Conn
}

func (l *stateLog) hook(c net.Conn, s ConnState) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.states == nil {
		l.states = map[net.Conn][]ConnState{}
	}
	if _, ok := l.states[c]; !ok {
		l.order = append(l.order, c)
	}
	l.states[c] = append(l.states[c], s)
}

// wait returns the states of the i-th connection accepted once it has
// been reported closed.
func (l *stateLog) wait(t *testing.T, i int) []ConnState {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		l.mu.Lock()
		var got []ConnState
		if i < len(l.order) {
			got = slices.Clone(l.states[l.order[i]])
		}
		l.mu.Unlock()
		if len(got) > 0 && got[len(got)-1] == StateClosed {
			return got
		}
		if time.Now().After(deadline) {
			t.Fatalf("connection %d: states %v, not closed after 10s", i, got)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestConnState: the hook sees every connection go New, Negotiating,
// Transmission, Closed; a failed handshake skips Transmission; a
// connection over MaxConnections goes straight from New to Closed.
func TestConnState(t *testing.T) {
	t.Parallel()
	raw, _ := newRawDevice(t, wireSize, false)
	var log stateLog
	_, sock := startWire(t, Config{Exports: FixedExports(Export{Device: raw}), MaxConnections: 1, ConnState: log.hook})

	w := dialWire(t, "unix", sock)
	w.negotiate("", false)
	over := dialWire(t, "unix", sock)
	over.expectClosed()
	if got := log.wait(t, 1); !slices.Equal(got, []ConnState{StateNew, StateClosed}) {
		t.Errorf("connection over the limit: states %v", got)
	}
	w.request(0, cmdDisc, 1, 0, 0, nil)
	w.expectClosed()
	if got := log.wait(t, 0); !slices.Equal(got, []ConnState{StateNew, StateNegotiating, StateTransmission, StateClosed}) {
		t.Errorf("served connection: states %v", got)
	}
	bad := dialWire(t, "unix", sock)
	bad.hello(1 << 7) // an unknown client flag
	bad.expectClosed()
	if got := log.wait(t, 2); !slices.Equal(got, []ConnState{StateNew, StateNegotiating, StateClosed}) {
		t.Errorf("failed handshake: states %v", got)
	}
	if s := ConnState(9).String(); s != "ConnState(9)" || StateTransmission.String() != "transmission" {
		t.Errorf("String: %q, %q", s, StateTransmission)
	}
}

// TestIdleTimeout: a connection with nothing in service and no request is
// closed after IdleTimeout; one whose request takes longer than that is
// not; a stalled payload, a stalled header and replies the client does
// not read end the connection too.
func TestIdleTimeout(t *testing.T) {
	t.Parallel()
	const idle = 300 * time.Millisecond
	raw, _ := newRawDevice(t, wireSize, false)
	dev := &hookDevice{Device: raw, readAt: func(p []byte, off int64) (int, error) {
		if off == 4096 {
			time.Sleep(3 * idle) // a slow request keeps the connection
		}
		return raw.ReadAt(ctx, p, off)
	}}
	var log stateLog
	_, sock := startWire(t, Config{Exports: FixedExports(Export{Device: dev}), IdleTimeout: idle, ConnState: log.hook})

	closedWithin := func(w *wireClient, what string, min, max time.Duration, start time.Time) {
		t.Helper()
		w.c.SetReadDeadline(time.Now().Add(max + 5*time.Second))
		_, err := io.Copy(io.Discard, w.r)
		if d := time.Since(start); d < min || d > max {
			t.Errorf("%s: closed after %v (err %v), want between %v and %v", what, d, err, min, max)
		}
	}

	// Idle from the start. The server's idle clock starts when the
	// handshake ends on its side, a little before the client has read
	// the last handshake reply: allow for that gap (CI saw 291 ms).
	w := dialWire(t, "unix", sock)
	w.negotiate("", true)
	closedWithin(w, "idle connection", idle-50*time.Millisecond, 10*idle, time.Now())

	// A request in service for three times the timeout: served, then
	// the connection idles out.
	w = dialWire(t, "unix", sock)
	w.negotiate("", false)
	w.request(0, cmdRead, 1, 4096, 512, nil)
	if r := w.mustReply(512, 4096); r.errno != 0 {
		t.Fatalf("slow read: %v", r.errno)
	}
	// The server's idle clock starts when it has sent the reply, a
	// little before the client has read it: allow for that gap.
	closedWithin(w, "connection after a slow request", idle-50*time.Millisecond, 10*idle, time.Now())

	// A payload that stops halfway, and a header that does.
	// The server's idle clock starts when the handshake ends on its side,
	// a little before the client's start: allow for that gap too.
	w = dialWire(t, "unix", sock)
	w.negotiate("", false)
	start := time.Now()
	w.request(0, cmdWrite, 2, 0, 65536, make([]byte, 1000))
	closedWithin(w, "stalled payload", idle-50*time.Millisecond, 10*idle, start)
	w = dialWire(t, "unix", sock)
	w.negotiate("", false)
	start = time.Now()
	w.write(requestBytes(0, cmdRead, 3, 0, 512)[:10])
	closedWithin(w, "stalled header", idle-50*time.Millisecond, 10*idle, start)

	// Replies that are never read: the server gives up on writing them
	// and closes, well before sending them all.
	w = dialWire(t, "unix", sock)
	w.negotiate("", false)
	const reads = 64
	for i := 0; i < reads; i++ {
		w.request(0, cmdRead, uint64(i), 0, 1<<20, nil)
	}
	time.Sleep(5 * idle)
	w.c.SetReadDeadline(time.Now().Add(5 * time.Second))
	n, err := io.Copy(io.Discard, w.r)
	if n >= reads<<20 {
		t.Errorf("a client that did not read got all %d replies (%d bytes, err %v)", reads, n, err)
	}
	for i := 0; i < 5; i++ {
		if got := log.wait(t, i); !slices.Equal(got, []ConnState{StateNew, StateNegotiating, StateTransmission, StateClosed}) {
			t.Errorf("connection %d: states %v", i, got)
		}
	}
}

// TestReadBudget: READs beyond a connection's reserve wait for the
// server's MaxReadBufferBytes, which clients that do not read their
// replies can fill; each connection's one READ within the reserve is
// still served; closing a hog lets the waiting READ through.
func TestReadBudget(t *testing.T) {
	t.Parallel()
	raw, _ := newRawDevice(t, 8<<20, false)
	_, sock := startWire(t, Config{Exports: FixedExports(Export{Device: raw}), MaxPayload: 1 << 20, MaxReadBufferBytes: 2 << 20})

	// Two hogs: each holds its reserve and 1 MiB of the shared 2 MiB.
	var hogs []*wireClient
	for i := 0; i < 2; i++ {
		h := dialWire(t, "unix", sock)
		h.negotiate("", false)
		for j := 0; j < 4; j++ {
			h.request(0, cmdRead, uint64(j), 0, 1<<20, nil)
		}
		hogs = append(hogs, h)
	}
	time.Sleep(300 * time.Millisecond)

	w := dialWire(t, "unix", sock)
	w.negotiate("", false)
	w.request(0, cmdRead, 1, 0, 1<<20, nil) // the reserve
	w.request(0, cmdRead, 2, 1<<20, 1<<20, nil)
	w.c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if r := w.mustReply(1<<20, 0); r.errno != 0 || r.handle != 1 {
		t.Fatalf("READ on the reserve: %+v", r.errno)
	}
	w.c.SetReadDeadline(time.Now().Add(300 * time.Millisecond))
	if _, err := w.readReply(1<<20, 0); err == nil {
		t.Fatal("a READ over the reserve was served while hogs held the shared bound")
	} else if ne, ok := err.(net.Error); !ok || !ne.Timeout() {
		t.Fatalf("waiting READ: %v", err)
	}
	hogs[0].c.Close()
	w.c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if r := w.mustReply(1<<20, 0); r.errno != 0 || r.handle != 2 {
		t.Fatalf("READ after a hog left: %+v", r.errno)
	}
}

// TestOversized: READ and WRITE over MaxPayload fail with EINVAL and the
// stream stays in sync; commands without a payload (TRIM, WRITE_ZEROES,
// CACHE, BLOCK_STATUS) are served over MaxPayload, as the spec lets
// clients send them.
func TestOversized(t *testing.T) {
	t.Parallel()
	raw, _ := newRawDevice(t, wireSize, false)
	const maxPayload = 64 << 10
	_, sock := startWire(t, Config{Exports: FixedExports(Export{Device: raw}), MaxPayload: maxPayload})
	for _, structured := range []bool{false, true} {
		w := dialWire(t, "unix", sock)
		if structured {
			w.negotiate("", true, contextBaseAllocation)
		} else {
			w.negotiate("", false)
		}
		data := pattern(5, wireSize)
		for off := 0; off < wireSize; off += maxPayload {
			w.request(0, cmdWrite, 1, uint64(off), maxPayload, data[off:off+maxPayload])
			if r := w.mustReply(0, 0); r.errno != 0 {
				t.Fatalf("write: %v", r.errno)
			}
		}
		for _, c := range []struct {
			typ     cmdType
			flags   cmdFlags
			length  uint32
			payload []byte
			want    Errno
		}{
			{cmdRead, 0, maxPayload + 1, nil, EINVAL},
			{cmdWrite, 0, maxPayload + 1, make([]byte, maxPayload+1), EINVAL},
			{cmdCache, 0, wireSize, nil, 0},
			{cmdWriteZeroes, cmdFlagNoHole, wireSize / 2, nil, 0},
			{cmdTrim, 0, wireSize / 2, nil, 0},
		} {
			w.request(c.flags, c.typ, 7, 0, c.length, c.payload)
			if r := w.mustReply(0, 0); r.errno != c.want || r.handle != 7 {
				t.Errorf("structured=%v %v of %d: %v, want %v", structured, c.typ, c.length, r.errno, c.want)
			}
		}
		if structured {
			w.request(0, cmdBlockStatus, 8, 0, wireSize, nil)
			r := w.mustReply(0, 0)
			var sum uint64
			for p := r.chunks[0].payload[4:]; len(p) >= 8; p = p[8:] {
				sum += uint64(be.Uint32(p))
			}
			if r.errno != 0 || sum != wireSize {
				t.Errorf("BLOCK_STATUS of the whole export: %v, extents cover %d", r.errno, sum)
			}
		}
		w.request(0, cmdRead, 9, wireSize/2, maxPayload, nil)
		r := w.mustReply(maxPayload, wireSize/2)
		if r.errno != 0 || !bytes.Equal(r.data, data[wireSize/2:wireSize/2+maxPayload]) {
			t.Errorf("structured=%v: data after WRITE_ZEROES of the first half: %v", structured, r.errno)
		}
		w.request(0, cmdRead, 10, 0, maxPayload, nil)
		if r := w.mustReply(maxPayload, 0); r.errno != 0 || !bytes.Equal(r.data, make([]byte, maxPayload)) {
			t.Errorf("structured=%v: first half not zero after WRITE_ZEROES", structured)
		}
	}
}

// TestClientCertWithGetConfigForClient: with ClientCAs, a client
// certificate is required and checked against them even when the
// server's certificate comes from a GetConfigForClient hook, whose
// configuration says nothing about client certificates.
func TestClientCertWithGetConfigForClient(t *testing.T) {
	t.Parallel()
	pki := NewTestPKI(t)
	rw, _ := newRawDevice(t, wireSize, false)
	serverTLS := &tls.Config{GetConfigForClient: func(*tls.ClientHelloInfo) (*tls.Config, error) {
		return &tls.Config{Certificates: []tls.Certificate{pki.Server}}, nil
	}}
	_, sock := startWire(t, Config{Exports: FixedExports(Export{Device: rw}), TLS: serverTLS, ClientCAs: pki.CAPool})
	checkClientCerts(t, pki, sock)
}

// TestRefusedQuickly: with the server full of stalled handshakes, further
// connections are closed at once, without being read from.
func TestRefusedQuickly(t *testing.T) {
	t.Parallel()
	raw, _ := newRawDevice(t, wireSize, false)
	var log stateLog
	s, sock := startWire(t, Config{Exports: FixedExports(Export{Device: raw}), MaxConnections: 4, ConnState: log.hook})
	for i := 0; i < 4; i++ {
		w := dialWire(t, "unix", sock)
		var b [18]byte
		if _, err := io.ReadFull(w.r, b[:]); err != nil {
			t.Fatal(err)
		}
	}
	for i := 0; i < 50; i++ {
		start := time.Now()
		c, err := net.Dial("unix", sock)
		if err != nil {
			t.Fatal(err)
		}
		c.Write(bytes.Repeat([]byte{0xff}, 4096))
		c.SetReadDeadline(time.Now().Add(5 * time.Second))
		_, err = c.Read(make([]byte, 1))
		c.Close()
		if !errors.Is(err, io.EOF) && !errors.Is(err, net.ErrClosed) && !isReset(err) {
			t.Fatalf("connection %d over the limit: %v", i, err)
		}
		if d := time.Since(start); d > time.Second {
			t.Errorf("connection %d over the limit took %v to refuse", i, d)
		}
	}
	if s.lastRefusal.Load() == 0 {
		t.Errorf("the refusals were not logged")
	}
	for i := 4; i < 54; i++ {
		if got := log.wait(t, i); !slices.Equal(got, []ConnState{StateNew, StateClosed}) {
			t.Errorf("connection %d over the limit: states %v", i, got)
		}
	}
}

// isReset reports whether err is a connection reset: the server closed a
// socket whose input it had not read.
func isReset(err error) bool {
	var ne *net.OpError
	return errors.As(err, &ne) && !ne.Timeout()
}

// TestWritePayloadSizes: WRITE payloads around and far above the first
// buffer (which then doubles as the bytes arrive) land intact, pipelined
// behind one another.
func TestWritePayloadSizes(t *testing.T) {
	t.Parallel()
	const size = 16 << 20
	raw, _ := newRawDevice(t, size, false)
	_, sock := startWire(t, Config{Exports: FixedExports(Export{Device: raw})})
	w := dialWire(t, "unix", sock)
	w.negotiate("", true)
	sizes := []int{1, firstPayloadBuf - 1, firstPayloadBuf, firstPayloadBuf + 1, 3*firstPayloadBuf + 7, 1 << 20, 4<<20 + 5}
	var off uint64
	var all bytes.Buffer
	for i, n := range sizes {
		data := pattern(uint64(100+i), n)
		all.Write(requestBytes(0, cmdWrite, uint64(i), off, uint32(n)))
		all.Write(data)
		off += uint64(n)
	}
	go w.c.Write(all.Bytes())
	for range sizes {
		if r := w.mustReply(0, 0); r.errno != 0 {
			t.Fatalf("write %d: %v", r.handle, r.errno)
		}
	}
	off = 0
	for i, n := range sizes {
		w.request(0, cmdRead, uint64(i), off, uint32(n), nil)
		if r := w.mustReply(n, off); r.errno != 0 || !bytes.Equal(r.data, pattern(uint64(100+i), n)) {
			t.Errorf("payload of %d bytes: errno %v, intact %v", n, r.errno, bytes.Equal(r.data, pattern(uint64(100+i), n)))
		}
		off += uint64(n)
	}
}
