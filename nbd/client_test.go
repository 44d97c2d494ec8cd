package nbd

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/ovis-storage/ovis/block"
)

// This file holds a minimal NBD client that speaks the wire format byte by
// byte, for tests that must send what no real client sends.

// wireClient is one raw connection to a server under test.
type wireClient struct {
	t testing.TB
	c net.Conn
	r *bufio.Reader
	// structured is set once STRUCTURED_REPLY was acknowledged.
	structured bool
}

func dialWire(t testing.TB, network, addr string) *wireClient {
	t.Helper()
	c, err := net.DialTimeout(network, addr, 5*time.Second)
	if err != nil {
		t.Fatalf("dial %s: %v", addr, err)
	}
	c.SetDeadline(time.Now().Add(20 * time.Second))
	t.Cleanup(func() { c.Close() })
	return &wireClient{t: t, c: c, r: bufio.NewReader(c)}
}

// hello reads the server greeting and answers with client flags.
func (w *wireClient) hello(flags clientFlags) handshakeFlags {
	w.t.Helper()
	var b [18]byte
	if _, err := io.ReadFull(w.r, b[:]); err != nil {
		w.t.Fatalf("read greeting: %v", err)
	}
	if binary.BigEndian.Uint64(b[0:8]) != nbdMagic || binary.BigEndian.Uint64(b[8:16]) != optsMagic {
		w.t.Fatalf("bad greeting %x", b)
	}
	var cf [4]byte
	binary.BigEndian.PutUint32(cf[:], uint32(flags))
	w.write(cf[:])
	return handshakeFlags(binary.BigEndian.Uint16(b[16:18]))
}

func (w *wireClient) write(b []byte) {
	w.t.Helper()
	if _, err := w.c.Write(b); err != nil {
		w.t.Fatalf("write: %v", err)
	}
}

func optBytes(opt optType, data []byte) []byte {
	b := make([]byte, 16, 16+len(data))
	binary.BigEndian.PutUint64(b[0:8], optsMagic)
	binary.BigEndian.PutUint32(b[8:12], uint32(opt))
	binary.BigEndian.PutUint32(b[12:16], uint32(len(data)))
	return append(b, data...)
}

func (w *wireClient) sendOpt(opt optType, data []byte) {
	w.t.Helper()
	w.write(optBytes(opt, data))
}

type optReply struct {
	opt  optType
	typ  repType
	data []byte
}

func (w *wireClient) readOptReply() optReply {
	w.t.Helper()
	var h [20]byte
	if _, err := io.ReadFull(w.r, h[:]); err != nil {
		w.t.Fatalf("read option reply: %v", err)
	}
	if binary.BigEndian.Uint64(h[0:8]) != repMagic {
		w.t.Fatalf("bad option reply magic %x", h[0:8])
	}
	rep := optReply{
		opt: optType(binary.BigEndian.Uint32(h[8:12])),
		typ: repType(binary.BigEndian.Uint32(h[12:16])),
	}
	rep.data = make([]byte, binary.BigEndian.Uint32(h[16:20]))
	if _, err := io.ReadFull(w.r, rep.data); err != nil {
		w.t.Fatalf("read option reply data: %v", err)
	}
	return rep
}

// replies reads option replies up to and including the final one (ACK or
// an error).
func (w *wireClient) replies() []optReply {
	w.t.Helper()
	var out []optReply
	for {
		r := w.readOptReply()
		out = append(out, r)
		if r.typ == repAck || r.typ&repFlagError != 0 {
			return out
		}
	}
}

func infoData(name string, infos ...infoType) []byte {
	b := binary.BigEndian.AppendUint32(nil, uint32(len(name)))
	b = append(b, name...)
	b = binary.BigEndian.AppendUint16(b, uint16(len(infos)))
	for _, i := range infos {
		b = binary.BigEndian.AppendUint16(b, uint16(i))
	}
	return b
}

func metaData(export string, queries ...string) []byte {
	b := binary.BigEndian.AppendUint32(nil, uint32(len(export)))
	b = append(b, export...)
	b = binary.BigEndian.AppendUint32(b, uint32(len(queries)))
	for _, q := range queries {
		b = binary.BigEndian.AppendUint32(b, uint32(len(q)))
		b = append(b, q...)
	}
	return b
}

// handshakeBytes is everything a well-behaved client sends to reach
// transmission on export name: client flags, STRUCTURED_REPLY and
// SET_META_CONTEXT when structured, then GO.
func handshakeBytes(name string, structured bool, contexts ...string) []byte {
	b := binary.BigEndian.AppendUint32(nil, uint32(flagCFixedNewstyle|flagCNoZeroes))
	if structured {
		b = append(b, optBytes(optStructuredReply, nil)...)
		if len(contexts) > 0 {
			b = append(b, optBytes(optSetMetaContext, metaData(name, contexts...))...)
		}
	}
	return append(b, optBytes(optGo, infoData(name, infoBlockSize))...)
}

// negotiate runs a full handshake and returns the export size and flags.
func (w *wireClient) negotiate(name string, structured bool, contexts ...string) (uint64, transmissionFlags) {
	w.t.Helper()
	w.hello(flagCFixedNewstyle | flagCNoZeroes)
	if structured {
		w.sendOpt(optStructuredReply, nil)
		if r := w.replies(); r[len(r)-1].typ != repAck {
			w.t.Fatalf("STRUCTURED_REPLY: %#x", r[len(r)-1].typ)
		}
		w.structured = true
		if len(contexts) > 0 {
			w.sendOpt(optSetMetaContext, metaData(name, contexts...))
			if r := w.replies(); r[len(r)-1].typ != repAck || len(r) != len(contexts)+1 {
				w.t.Fatalf("SET_META_CONTEXT: %d replies, last %#x", len(r), r[len(r)-1].typ)
			}
		}
	}
	w.sendOpt(optGo, infoData(name, infoBlockSize))
	var size uint64
	var flags transmissionFlags
	for _, r := range w.replies() {
		switch {
		case r.typ&repFlagError != 0:
			w.t.Fatalf("GO %q: error %#x: %s", name, r.typ, r.data)
		case r.typ == repInfo && binary.BigEndian.Uint16(r.data) == uint16(infoExport):
			size = binary.BigEndian.Uint64(r.data[2:10])
			flags = transmissionFlags(binary.BigEndian.Uint16(r.data[10:12]))
		}
	}
	return size, flags
}

func requestBytes(flags cmdFlags, typ cmdType, handle, off uint64, length uint32) []byte {
	var b [requestHeaderLen]byte
	binary.BigEndian.PutUint32(b[0:4], requestMagic)
	binary.BigEndian.PutUint16(b[4:6], uint16(flags))
	binary.BigEndian.PutUint16(b[6:8], uint16(typ))
	binary.BigEndian.PutUint64(b[8:16], handle)
	binary.BigEndian.PutUint64(b[16:24], off)
	binary.BigEndian.PutUint32(b[24:28], length)
	return b[:]
}

func (w *wireClient) request(flags cmdFlags, typ cmdType, handle, off uint64, length uint32, payload []byte) {
	w.t.Helper()
	w.write(append(requestBytes(flags, typ, handle, off, length), payload...))
}

// reply is a decoded reply: simple, or all chunks of a structured one.
type reply struct {
	handle uint64
	errno  Errno
	// data is the READ content reassembled from simple data or
	// OFFSET_DATA/OFFSET_HOLE chunks, relative to base.
	data   []byte
	chunks []chunk
}

type chunk struct {
	flags   replyFlags
	typ     replyType
	payload []byte
}

// readReply reads one reply. For a simple reply to a READ, readLen is the
// data length to expect on success; base is the READ's offset, used to
// place structured content.
func (w *wireClient) readReply(readLen int, base uint64) (reply, error) {
	var m [4]byte
	if _, err := io.ReadFull(w.r, m[:]); err != nil {
		return reply{}, err
	}
	switch binary.BigEndian.Uint32(m[:]) {
	case simpleReplyMagic:
		var h [12]byte
		if _, err := io.ReadFull(w.r, h[:]); err != nil {
			return reply{}, err
		}
		rep := reply{errno: Errno(binary.BigEndian.Uint32(h[0:4])), handle: binary.BigEndian.Uint64(h[4:12])}
		if rep.errno == 0 && readLen > 0 {
			rep.data = make([]byte, readLen)
			if _, err := io.ReadFull(w.r, rep.data); err != nil {
				return reply{}, err
			}
		}
		return rep, nil
	case structuredReplyMagic:
		var rep reply
		for first := true; ; first = false {
			if !first {
				if _, err := io.ReadFull(w.r, m[:]); err != nil {
					return reply{}, err
				}
				if binary.BigEndian.Uint32(m[:]) != structuredReplyMagic {
					return reply{}, fmt.Errorf("chunk magic %x", m)
				}
			}
			var h [16]byte
			if _, err := io.ReadFull(w.r, h[:]); err != nil {
				return reply{}, err
			}
			c := chunk{flags: replyFlags(binary.BigEndian.Uint16(h[0:2])), typ: replyType(binary.BigEndian.Uint16(h[2:4]))}
			handle := binary.BigEndian.Uint64(h[4:12])
			if !first && handle != rep.handle {
				return reply{}, fmt.Errorf("chunks of handles %d and %d interleaved", rep.handle, handle)
			}
			rep.handle = handle
			c.payload = make([]byte, binary.BigEndian.Uint32(h[12:16]))
			if _, err := io.ReadFull(w.r, c.payload); err != nil {
				return reply{}, err
			}
			rep.chunks = append(rep.chunks, c)
			switch c.typ {
			case replyTypeError:
				rep.errno = Errno(binary.BigEndian.Uint32(c.payload))
			case replyTypeOffsetData, replyTypeOffsetHole:
				if rep.data == nil {
					rep.data = make([]byte, readLen)
				}
				off := binary.BigEndian.Uint64(c.payload) - base
				if c.typ == replyTypeOffsetData {
					copy(rep.data[off:], c.payload[8:])
				} else {
					clear(rep.data[off : off+uint64(binary.BigEndian.Uint32(c.payload[8:]))])
				}
			}
			if c.flags&replyFlagDone != 0 {
				return rep, nil
			}
		}
	default:
		return reply{}, fmt.Errorf("reply magic %x", m)
	}
}

func (w *wireClient) mustReply(readLen int, base uint64) reply {
	w.t.Helper()
	r, err := w.readReply(readLen, base)
	if err != nil {
		w.t.Fatalf("read reply: %v", err)
	}
	return r
}

// expectClosed checks that the server closes the connection without
// sending anything more.
func (w *wireClient) expectClosed() {
	w.t.Helper()
	w.c.SetReadDeadline(time.Now().Add(5 * time.Second))
	b, err := w.r.ReadByte()
	if err == nil {
		w.t.Fatalf("server sent %#x, want the connection closed", b)
	}
	if ne, ok := err.(net.Error); ok && ne.Timeout() {
		w.t.Fatalf("server kept the connection open")
	}
}

// newRawDevice makes a raw file of size bytes (sparse) in a temporary
// folder and opens it.
func newRawDevice(t testing.TB, size int64, readOnly bool) (*block.Raw, string) {
	t.Helper()
	p := filepath.Join(t.TempDir(), "disk.raw")
	if err := os.WriteFile(p, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(p, size); err != nil {
		t.Fatal(err)
	}
	d, err := block.OpenRaw(p, readOnly)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Close() })
	return d, p
}

// testLogger logs to the test at debug level when -v is given.
func testLogger(t testing.TB) *slog.Logger {
	if !testing.Verbose() {
		return slog.New(slog.DiscardHandler)
	}
	return slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

type testWriter struct{ t testing.TB }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(string(bytes.TrimRight(p, "\n")))
	return len(p), nil
}

// startWire serves cfg on a unix socket in a temporary folder and returns
// the socket path; the server is shut down when the test ends and must
// leave no connection behind.
func startWire(t testing.TB, cfg Config) (*Server, string) {
	t.Helper()
	if cfg.Logger == nil {
		cfg.Logger = testLogger(t)
	}
	s, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(t.TempDir(), "nbd.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- s.Serve(context.Background(), l) }()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if err := s.Shutdown(ctx); err != nil {
			t.Errorf("Shutdown: %v", err)
		}
		if err := <-done; err != ErrServerClosed {
			t.Errorf("Serve returned %v, want ErrServerClosed", err)
		}
	})
	return s, sock
}
