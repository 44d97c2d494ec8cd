package serve

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/ovis-storage/ovis/block"
	"github.com/ovis-storage/ovis/nbd"
)

// TestGateLimit checks that a gate of two admits two connections, holds
// the third in the backlog until one is reported closed, and that Close
// wakes an Accept waiting for a slot.
func TestGateLimit(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	g := newGate(l, 2, nil)
	accepted := make(chan net.Conn, 4)
	acceptErr := make(chan error, 1)
	go func() {
		for {
			c, err := g.Accept()
			if err != nil {
				acceptErr <- err
				return
			}
			g.connState(c, nbd.StateNew)
			accepted <- c
		}
	}()
	for i := 0; i < 3; i++ {
		c, err := net.Dial("tcp", l.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
	}
	first, second := <-accepted, <-accepted
	select {
	case <-accepted:
		t.Fatal("a third connection was accepted with -e 2")
	case <-time.After(100 * time.Millisecond):
	}
	first.Close()
	g.connState(first, nbd.StateClosed)
	third := <-accepted
	select {
	case <-accepted:
		t.Fatal("a fourth connection appeared")
	case <-time.After(50 * time.Millisecond):
	}
	g.Close()
	if err := <-acceptErr; !errors.Is(err, net.ErrClosed) {
		t.Errorf("Accept after Close: %v, want net.ErrClosed", err)
	}
	for _, c := range []net.Conn{second, third} {
		c.Close()
		g.connState(c, nbd.StateClosed)
	}
}

// TestGateIdle checks that idle is called once the last connection that
// completed its handshake closes, and not for one that never did.
func TestGateIdle(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	idle := make(chan struct{}, 2)
	g := newGate(l, 0, func() { idle <- struct{}{} })
	defer g.Close()
	conns := make([]net.Conn, 3)
	for i := range conns {
		c, err := net.Dial("tcp", l.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		if conns[i], err = g.Accept(); err != nil {
			t.Fatal(err)
		}
		g.connState(conns[i], nbd.StateNew)
		g.connState(conns[i], nbd.StateNegotiating)
	}
	// conns[0] never completes a handshake; 1 and 2 do.
	g.connState(conns[1], nbd.StateTransmission)
	g.connState(conns[2], nbd.StateTransmission)
	g.connState(conns[0], nbd.StateClosed)
	g.connState(conns[1], nbd.StateClosed)
	select {
	case <-idle:
		t.Fatal("idle with a client still connected")
	case <-time.After(50 * time.Millisecond):
	}
	g.connState(conns[2], nbd.StateClosed)
	select {
	case <-idle:
	case <-time.After(time.Second):
		t.Fatal("idle not called after the last client left")
	}
}

// TestGateWithServer runs the gate under a real nbd.Server: with -e 1 a
// second client waits in the backlog until the first leaves; a client
// that fails its handshake does not count as one; and the last client
// leaving calls idle exactly once.
func TestGateWithServer(t *testing.T) {
	p := filepath.Join(t.TempDir(), "disk.raw")
	if err := os.WriteFile(p, make([]byte, 1<<20), 0o644); err != nil {
		t.Fatal(err)
	}
	dev, err := block.OpenRaw(p, false)
	if err != nil {
		t.Fatal(err)
	}
	defer dev.Close()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	idle := make(chan struct{}, 2)
	g := newGate(l, 1, func() { idle <- struct{}{} })
	srv, err := nbd.New(nbd.Config{
		Exports:   nbd.FixedExports(nbd.Export{Device: dev}),
		ConnState: g.connState,
		Logger:    slog.New(slog.DiscardHandler),
	})
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(context.Background(), g) }()
	defer srv.Close()

	// A client that sends garbage: its handshake fails and its slot
	// comes back, without idle being called.
	bad, err := net.Dial("tcp", l.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	greeting(t, bad)
	bad.Write([]byte("garbage!"))
	io.Copy(io.Discard, bad)
	bad.Close()

	first := client(t, l.Addr().String())
	second, err := net.Dial("tcp", l.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer second.Close()
	second.SetReadDeadline(time.Now().Add(200 * time.Millisecond))
	if _, err := second.Read(make([]byte, 1)); err == nil {
		t.Fatal("a second client was served with -e 1")
	}
	select {
	case <-idle:
		t.Fatal("idle called with a client connected")
	default:
	}
	first.Close()
	second.SetReadDeadline(time.Now().Add(5 * time.Second))
	greeting(t, second)
	select {
	case <-idle:
	case <-time.After(5 * time.Second):
		t.Fatal("idle not called after the client left")
	}
}

// greeting reads the server's 18-byte greeting.
func greeting(t *testing.T, c net.Conn) {
	t.Helper()
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.ReadFull(c, make([]byte, 18)); err != nil {
		t.Fatalf("greeting: %v", err)
	}
}

// client connects over TCP and completes a handshake with
// NBD_OPT_EXPORT_NAME.
func client(t *testing.T, addr string) net.Conn {
	t.Helper()
	return clientOn(t, "tcp", addr)
}

// clientOn is client on any network.
func clientOn(t *testing.T, network, addr string) net.Conn {
	t.Helper()
	c, err := net.Dial(network, addr)
	if err != nil {
		t.Fatal(err)
	}
	greeting(t, c)
	msg := []byte{0, 0, 0, 3} // FIXED_NEWSTYLE | NO_ZEROES
	msg = append(msg, "IHAVEOPT"...)
	msg = append(msg, 0, 0, 0, 1, 0, 0, 0, 0) // EXPORT_NAME, ""
	if _, err := c.Write(msg); err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(c, make([]byte, 10)); err != nil {
		t.Fatalf("export name reply: %v", err)
	}
	return c
}
