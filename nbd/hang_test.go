package nbd

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/ovis-storage/ovis/block"
)

// Tests in this file hold device calls that never return on their own, as
// a device waiting on a lost replica or a dead network would, and check
// that the server still ends: at the end of Shutdown's grace period, at
// Close, and when the client goes away.

// hangDevice is a device whose ReadAt, WriteAt and Flush wait until their
// context ends and then fail with its error. It records each call's entry
// and how it ended.
type hangDevice struct {
	block.Device
	// writesPass serves WriteAt from the device underneath.
	writesPass bool
	entered    chan string // one send per call, on entry
	mu         sync.Mutex
	waiting    int     // calls entered and not returned
	ended      []error // the error each finished call returned
}

func newHangDevice(t *testing.T) *hangDevice {
	raw, _ := newRawDevice(t, wireSize, false)
	return &hangDevice{Device: raw, entered: make(chan string, 64)}
}

func (d *hangDevice) hang(ctx context.Context, op string) error {
	d.mu.Lock()
	d.waiting++
	d.mu.Unlock()
	d.entered <- op
	<-ctx.Done()
	d.mu.Lock()
	d.waiting--
	d.ended = append(d.ended, fmt.Errorf("%s: %w", op, ctx.Err()))
	d.mu.Unlock()
	return ctx.Err()
}

func (d *hangDevice) ReadAt(ctx context.Context, p []byte, off int64) (int, error) {
	return 0, d.hang(ctx, "read")
}

func (d *hangDevice) WriteAt(ctx context.Context, p []byte, off int64, f block.Flags) (int, error) {
	if d.writesPass {
		return d.Device.WriteAt(ctx, p, off, f)
	}
	return 0, d.hang(ctx, "write")
}

func (d *hangDevice) Flush(ctx context.Context) error {
	return d.hang(ctx, "flush")
}

// waitEntered waits for n calls to have entered the device.
func (d *hangDevice) waitEntered(t *testing.T, n int) {
	t.Helper()
	timeout := time.After(10 * time.Second)
	for i := 0; i < n; i++ {
		select {
		case <-d.entered:
		case <-timeout:
			t.Fatalf("%d of %d device calls entered", i, n)
		}
	}
}

// waitReturned waits up to d for every call that entered to have returned
// and checks that want of them did, each with its context cancelled.
func (dev *hangDevice) waitReturned(t *testing.T, d time.Duration, want int) {
	t.Helper()
	deadline := time.Now().Add(d)
	for {
		dev.mu.Lock()
		waiting, ended := dev.waiting, append([]error(nil), dev.ended...)
		dev.mu.Unlock()
		if waiting == 0 {
			for i, err := range ended {
				if !errors.Is(err, context.Canceled) {
					t.Errorf("device call %d ended with %v, want context.Canceled", i, err)
				}
			}
			if len(ended) != want {
				t.Errorf("device calls returned: %v, want %d", ended, want)
			}
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d device calls still waiting after %v (returned: %v)", waiting, d, ended)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// serveUnix serves cfg on a unix socket and returns the server, the socket
// path and Serve's result. The test stops the server itself.
func serveUnix(t *testing.T, cfg Config) (*Server, string, <-chan error) {
	t.Helper()
	cfg.Logger = testLogger(t)
	s, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(t.TempDir(), "nbd.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- s.Serve(context.Background(), l) }()
	t.Cleanup(func() { s.Close() })
	return s, sock, served
}

// hangCase is a set of requests that all end up waiting: in the device,
// or (beyond MaxInFlight or the READ buffer bound) in the reader, waiting
// for room that the hung calls hold.
type hangCase struct {
	name string
	cfg  Config
	// send sends the requests; calls is how many reach the device.
	send  func(w *wireClient)
	calls int
}

func hangCases() []hangCase {
	return []hangCase{
		{
			name: "read write flush",
			send: func(w *wireClient) {
				w.request(0, cmdRead, 1, 0, 4096, nil)
				w.request(0, cmdWrite, 2, 4096, 4096, pattern(2, 4096))
				w.request(0, cmdFlush, 3, 0, 0, nil)
			},
			calls: 3,
		},
		{
			// The third request waits for a place in service.
			name: "MaxInFlight reached",
			cfg:  Config{MaxInFlight: 2},
			send: func(w *wireClient) {
				w.request(0, cmdWrite, 1, 0, 4096, pattern(1, 4096))
				w.request(0, cmdRead, 2, 0, 4096, nil)
				w.request(0, cmdFlush, 3, 0, 0, nil)
			},
			calls: 2,
		},
		{
			// The first READ takes the connection's reserve, the second
			// all of the server's READ buffers; the third waits for them.
			name: "READ buffers exhausted",
			cfg:  Config{MaxPayload: 64 << 10, MaxReadBufferBytes: 64 << 10},
			send: func(w *wireClient) {
				for h := uint64(1); h <= 3; h++ {
					w.request(0, cmdRead, h, 0, 64<<10, nil)
				}
			},
			calls: 2,
		},
	}
}

// start serves c on a new hanging device, connects a client and sends the
// case's requests, and returns once they have all reached the device.
func (c hangCase) start(t *testing.T) (*Server, *hangDevice, *wireClient, <-chan error) {
	t.Helper()
	dev := newHangDevice(t)
	cfg := c.cfg
	cfg.Exports = FixedExports(Export{Device: dev})
	s, sock, served := serveUnix(t, cfg)
	w := dialWire(t, "unix", sock)
	w.negotiate("", false)
	c.send(w)
	dev.waitEntered(t, c.calls)
	return s, dev, w, served
}

// closedSoon checks that the server closes w's connection within d, after
// whatever it still sends.
func closedSoon(t *testing.T, w *wireClient, d time.Duration) {
	t.Helper()
	w.c.SetReadDeadline(time.Now().Add(d))
	if _, err := io.Copy(io.Discard, w.r); err != nil {
		t.Errorf("connection not closed within %v: %v", d, err)
	}
}

// margin is how much later than its due time a stop may end: a scheduling
// allowance for a loaded machine under -race, far below the hang.
const margin = time.Second

// TestShutdownGraceEndsHungCalls: Shutdown with requests hung in the
// device (and more waiting behind them) returns its context's error once
// the grace period is over, not later, and the hung calls see their
// context cancelled and return.
func TestShutdownGraceEndsHungCalls(t *testing.T) {
	t.Parallel()
	const grace = 300 * time.Millisecond
	for _, c := range hangCases() {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			s, dev, w, served := c.start(t)
			sctx, cancel := context.WithTimeout(context.Background(), grace)
			defer cancel()
			start := time.Now()
			err := s.Shutdown(sctx)
			took := time.Since(start)
			if !errors.Is(err, context.DeadlineExceeded) {
				t.Errorf("Shutdown = %v, want context.DeadlineExceeded", err)
			}
			if took < grace-10*time.Millisecond || took > grace+margin {
				t.Errorf("Shutdown took %v, want the grace period %v (at most %v more)", took, grace, margin)
			}
			dev.waitReturned(t, 0, c.calls)
			if err := <-served; err != ErrServerClosed {
				t.Errorf("Serve = %v, want ErrServerClosed", err)
			}
			closedSoon(t, w, margin)
			if err := s.Close(); err != ErrServerClosed {
				t.Errorf("Close after Shutdown = %v, want ErrServerClosed", err)
			}
		})
	}
}

// TestCloseEndsHungCalls: Close alone returns at once with requests hung
// in the device, whose calls see their context cancelled.
func TestCloseEndsHungCalls(t *testing.T) {
	t.Parallel()
	for _, c := range hangCases() {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			s, dev, w, served := c.start(t)
			start := time.Now()
			if err := s.Close(); err != nil {
				t.Errorf("Close = %v", err)
			}
			if took := time.Since(start); took > margin {
				t.Errorf("Close took %v, want at most %v", took, margin)
			}
			dev.waitReturned(t, 0, c.calls)
			if err := <-served; err != ErrServerClosed {
				t.Errorf("Serve = %v, want ErrServerClosed", err)
			}
			closedSoon(t, w, margin)
		})
	}
}

// TestDisconnectCancelsHungCalls: a client that closes its socket without
// NBD_CMD_DISC cancels the device calls of its requests in service, also
// when its reader is waiting for room that those calls hold, and the
// connection ends; the server goes on serving.
func TestDisconnectCancelsHungCalls(t *testing.T) {
	t.Parallel()
	for _, c := range hangCases() {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			s, dev, w, _ := c.start(t)
			w.c.Close()
			dev.waitReturned(t, 5*time.Second, c.calls)
			waitNoConns(t, s)
			sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			if err := s.Shutdown(sctx); err != nil {
				t.Errorf("Shutdown after the disconnect = %v", err)
			}
		})
	}
}

// TestDisconnectFlushEndsAtStop: a connection written since its last
// good flush flushes the device when its client goes away, under the
// server's context rather than the connection's (which the disconnect
// cancelled); a flush that hangs there is ended by the server's stop at
// the end of Shutdown's grace period.
func TestDisconnectFlushEndsAtStop(t *testing.T) {
	t.Parallel()
	const grace = 300 * time.Millisecond
	dev := newHangDevice(t)
	dev.writesPass = true
	s, sock, served := serveUnix(t, Config{Exports: FixedExports(Export{Device: dev})})
	w := dialWire(t, "unix", sock)
	w.negotiate("", false)
	w.request(0, cmdWrite, 1, 0, 4096, pattern(1, 4096))
	if r := w.mustReply(0, 0); r.errno != 0 {
		t.Fatalf("write: %v", r.errno)
	}
	w.request(0, cmdFlush, 2, 0, 0, nil)
	dev.waitEntered(t, 1)
	w.c.Close()
	// The FLUSH in service is cancelled; the one on the way out starts.
	dev.waitEntered(t, 1)
	dev.mu.Lock()
	ended := append([]error(nil), dev.ended...)
	dev.mu.Unlock()
	if len(ended) != 1 || !errors.Is(ended[0], context.Canceled) {
		t.Fatalf("after the disconnect, device calls returned: %v, want the FLUSH in service cancelled", ended)
	}
	sctx, cancel := context.WithTimeout(context.Background(), grace)
	defer cancel()
	start := time.Now()
	if err := s.Shutdown(sctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("Shutdown = %v, want context.DeadlineExceeded", err)
	}
	if took := time.Since(start); took > grace+margin {
		t.Errorf("Shutdown took %v, want at most %v", took, grace+margin)
	}
	dev.waitReturned(t, 0, 2)
	if err := <-served; err != ErrServerClosed {
		t.Errorf("Serve = %v, want ErrServerClosed", err)
	}
}
