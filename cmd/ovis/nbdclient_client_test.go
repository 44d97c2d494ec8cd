package main

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/ovis-storage/ovis/block"
	"github.com/ovis-storage/ovis/nbd"
)

// TestNBDConn checks the tests' NBD client (nbdConn) against ovis's NBD
// server: the read-only flag, FUA and flushed writes read back, error
// replies as nbdReplyError, and a deadline that ends a silent handshake.
func TestNBDConn(t *testing.T) {
	p := filepath.Join(t.TempDir(), "disk.raw")
	if err := os.WriteFile(p, make([]byte, 1<<20), 0o644); err != nil {
		t.Fatal(err)
	}
	dev, err := block.OpenRaw(p, false)
	if err != nil {
		t.Fatal(err)
	}
	defer dev.Close()
	srv, err := nbd.New(nbd.Config{
		Exports: nbd.FixedExports(nbd.Export{Name: "rw", Device: dev}, nbd.Export{Name: "ro", Device: dev, ReadOnly: true}),
		Logger:  slog.New(slog.DiscardHandler),
	})
	if err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(context.Background(), l) }()
	defer func() {
		srv.Close()
		if err := <-served; !errors.Is(err, nbd.ErrServerClosed) {
			t.Errorf("Serve: %v", err)
		}
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()

	rw, err := dialNBD(ctx, "tcp", l.Addr().String(), "rw")
	if err != nil {
		t.Fatal(err)
	}
	defer rw.Close()
	if rw.readOnly() || rw.size != 1<<20 || rw.flags&nbdFlagSendFUA == 0 {
		t.Errorf("rw export: read-only %v, size %d, flags %#x", rw.readOnly(), rw.size, rw.flags)
	}
	a, b := bytes.Repeat([]byte{0xa5}, 4096), bytes.Repeat([]byte{0x5a}, 4096)
	if err := rw.write(ctx, 8192, a, true); err != nil {
		t.Fatalf("FUA write: %v", err)
	}
	if err := rw.write(ctx, 12288, b, false); err != nil {
		t.Fatalf("write: %v", err)
	}
	if err := rw.flush(ctx); err != nil {
		t.Fatalf("flush: %v", err)
	}
	ro, err := dialNBD(ctx, "tcp", l.Addr().String(), "ro")
	if err != nil {
		t.Fatal(err)
	}
	defer ro.Close()
	if !ro.readOnly() {
		t.Errorf("ro export not read-only: flags %#x", ro.flags)
	}
	got := make([]byte, 8192)
	if err := ro.read(ctx, 8192, got); err != nil || !bytes.Equal(got[:4096], a) || !bytes.Equal(got[4096:], b) {
		t.Errorf("read back through the other connection: %v, %x… %x…", err, got[:4], got[4096:4100])
	}
	var nbdErr *nbdReplyError
	if err := ro.write(ctx, 0, a, true); !errors.As(err, &nbdErr) || nbdErr.errno != 1 {
		t.Errorf("write to a read-only export: %v, want NBD error 1 (EPERM)", err)
	}
	// The connection goes on after an error reply.
	if err := ro.read(ctx, 8192, got[:4096]); err != nil || !bytes.Equal(got[:4096], a) {
		t.Errorf("read after an error reply: %v", err)
	}
	if _, err := dialNBD(ctx, "tcp", l.Addr().String(), "none"); err == nil {
		t.Error("an unknown export was opened")
	}

	// A server that accepts and says nothing: the deadline ends the
	// handshake.
	silent, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer silent.Close()
	short, cancelShort := context.WithTimeout(ctx, 200*time.Millisecond)
	defer cancelShort()
	start := time.Now()
	if _, err := dialNBD(short, "tcp", silent.Addr().String(), "x"); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("silent server: %v, want a deadline error", err)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("the deadline took %v to end the handshake", d)
	}
}
