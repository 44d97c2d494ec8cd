package serve

import (
	"context"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestRunIdleTimeout runs Run with an idle timeout and without -t: a
// client that completes its handshake and then sends nothing is
// disconnected after the timeout, and since it was the last client, Run
// returns; a connection that never completed a handshake does not count.
func TestRunIdleTimeout(t *testing.T) {
	dir := t.TempDir()
	image := filepath.Join(dir, "disk.raw")
	if err := os.WriteFile(image, make([]byte, 1<<20), 0o644); err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(dir, "s.sock")
	ready := make(chan struct{})
	const idle = 300 * time.Millisecond
	done := make(chan error, 1)
	go func() {
		done <- Run(context.Background(), Config{
			File: image, Format: "raw", Socket: sock, Shared: 2,
			IdleTimeout: idle,
			Logger:      slog.New(slog.DiscardHandler),
			Ready:       func(net.Addr) { close(ready) },
		})
	}()
	select {
	case <-ready:
	case err := <-done:
		t.Fatalf("Run: %v", err)
	}
	// A connection that stalls in the handshake is not a client.
	stalled, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer stalled.Close()
	c := clientOn(t, "unix", sock)
	start := time.Now()
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.Copy(io.Discard, c); err != nil {
		t.Fatalf("waiting for the server to hang up: %v", err)
	}
	// The server's idle clock starts when the handshake ends on its
	// side, a little before the client's start (nbd's TestIdleTimeout
	// failed in CI on that gap).
	if d := time.Since(start); d < idle-50*time.Millisecond || d > 10*idle {
		t.Errorf("idle client disconnected after %v, want about %v", d, idle)
	}
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("Run: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Run still serving after its last client idled out")
	}

	cfg := Config{File: image, IdleTimeout: -time.Second}
	if err := cfg.Validate(); err == nil || !strings.Contains(err.Error(), "idle timeout") {
		t.Errorf("Validate with a negative idle timeout: %v", err)
	}
}
