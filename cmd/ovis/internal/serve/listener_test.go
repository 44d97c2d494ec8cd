package serve

import (
	"errors"
	"net"
	"testing"
	"time"
)

// TestGateLimit checks that a gate of two admits two connections, holds
// the third in the backlog until one closes, and that Close wakes an
// Accept waiting for a slot.
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
	first.Close() // a second Close gives no second slot back
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
	second.Close()
	third.Close()
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
	}
	// conns[0] never completes a handshake; 1 and 2 do.
	conns[0].SetDeadline(time.Now().Add(time.Second))
	conns[1].SetDeadline(time.Time{})
	conns[2].SetDeadline(time.Time{})
	conns[2].SetDeadline(time.Time{}) // counted once
	conns[0].Close()
	conns[1].Close()
	select {
	case <-idle:
		t.Fatal("idle with a client still connected")
	case <-time.After(50 * time.Millisecond):
	}
	conns[2].Close()
	select {
	case <-idle:
	case <-time.After(time.Second):
		t.Fatal("idle not called after the last client left")
	}
	conns[2].Close()
	select {
	case <-idle:
		t.Fatal("idle called twice")
	case <-time.After(50 * time.Millisecond):
	}
}
