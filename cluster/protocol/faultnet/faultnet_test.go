package faultnet

import (
	"context"
	"errors"
	"net"
	"testing"
	"time"
)

// TestCutAndDrop: a cut fails dials at once; a drop (from a to b) hangs
// a's dials to b until their context ends, and no third node's;
// Heal ends both.
func TestCutAndDrop(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			c.Close()
		}
	}()
	n := New()
	n.Name(l.Addr().String(), "b")
	dial := func(from string, wait time.Duration) (time.Duration, error) {
		ctx, cancel := context.WithTimeout(context.Background(), wait)
		defer cancel()
		start := time.Now()
		c, err := n.Dialer(from)(ctx, l.Addr().String())
		if err == nil {
			c.Close()
		}
		return time.Since(start), err
	}
	if _, err := dial("a", time.Second); err != nil {
		t.Fatalf("dial before any cut: %v", err)
	}
	n.Cut("a", "b")
	if took, err := dial("a", time.Second); !errors.Is(err, ErrCut) || took > 500*time.Millisecond {
		t.Fatalf("dial across a cut: %v after %v, want ErrCut at once", err, took)
	}
	n.Heal("b", "a")
	if _, err := dial("a", time.Second); err != nil {
		t.Fatalf("dial after the heal: %v", err)
	}
	n.Drop("a", "b")
	if took, err := dial("a", 300*time.Millisecond); !errors.Is(err, ErrCut) || !errors.Is(err, context.DeadlineExceeded) || took < 300*time.Millisecond {
		t.Fatalf("dial across a drop: %v after %v, want ErrCut once its context ended", err, took)
	}
	if _, err := dial("c", time.Second); err != nil {
		t.Fatalf("dial by a third node: %v", err)
	}
	n.Heal("a", "b")
	if _, err := dial("a", time.Second); err != nil {
		t.Fatalf("dial after healing the drop: %v", err)
	}
}
