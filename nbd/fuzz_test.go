package nbd

import (
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/ovis-storage/ovis/block"
)

// Fuzz targets feed arbitrary bytes as the client side of a net.Pipe. The
// server must neither panic nor hang: once the input is sent and the
// client's end closed, the connection must end within fuzzHang.

const fuzzHang = 10 * time.Second

// fuzzServer returns a server over a 1 MiB raw file with a writable and a
// read-only export, a small maximum payload and no logs.
func fuzzServer(f *testing.F) *Server {
	dir := f.TempDir()
	p := filepath.Join(dir, "disk.raw")
	if err := os.WriteFile(p, nil, 0o644); err != nil {
		f.Fatal(err)
	}
	if err := os.Truncate(p, 1<<20); err != nil {
		f.Fatal(err)
	}
	dev, err := block.OpenRaw(p, false)
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() { dev.Close() })
	s, err := New(Config{
		Exports: FixedExports(
			Export{Name: "", Device: dev},
			Export{Name: "ro", Device: dev, ReadOnly: true, MultiConn: true},
		),
		MaxPayload:       64 << 10,
		HandshakeTimeout: fuzzHang / 2,
		Logger:           slog.New(slog.DiscardHandler),
	})
	if err != nil {
		f.Fatal(err)
	}
	return s
}

// runFuzzConn serves one connection whose client sends input and then
// hangs up, reading and dropping everything the server sends.
func runFuzzConn(t *testing.T, s *Server, input []byte) {
	client, server := net.Pipe()
	c := &serverConn{srv: s, raw: server, log: s.log}
	done := make(chan struct{})
	go func() {
		defer close(done)
		c.serve(s.ctx)
	}()
	go io.Copy(io.Discard, client)
	client.SetWriteDeadline(time.Now().Add(fuzzHang))
	client.Write(input)
	client.Close()
	select {
	case <-done:
	case <-time.After(fuzzHang):
		t.Fatalf("server still serving %d bytes of input after %v", len(input), fuzzHang)
	}
}

func FuzzHandshake(f *testing.F) {
	s := fuzzServer(f)
	f.Add(handshakeBytes("", true, contextBaseAllocation, contextAllocDepth))
	f.Add(handshakeBytes("ro", false))
	f.Fuzz(func(t *testing.T, input []byte) {
		runFuzzConn(t, s, input)
	})
}

// fuzzPrefix is the handshake FuzzRequests starts from: structured
// replies, both contexts, the writable export.
var fuzzPrefix = handshakeBytes("", true, contextBaseAllocation, contextAllocDepth)

func FuzzRequests(f *testing.F) {
	s := fuzzServer(f)
	f.Add(append(requestBytes(0, cmdRead, 1, 0, 4096), requestBytes(0, cmdDisc, 2, 0, 0)...))
	f.Fuzz(func(t *testing.T, input []byte) {
		runFuzzConn(t, s, append(fuzzPrefix[:len(fuzzPrefix):len(fuzzPrefix)], input...))
	})
}
