package nbd

import (
	"bytes"
	"context"
	"encoding/binary"
	"io"
	"math/rand/v2"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ovis-storage/ovis/block"
)

// Tests in this file speak the protocol byte by byte (client_test.go):
// requests no real client would send, and the replies' exact shape.

const wireSize = 1 << 20

func wireServer(t *testing.T) string {
	t.Helper()
	rw, _ := newRawDevice(t, wireSize, false)
	ro, _ := newRawDevice(t, wireSize, true)
	_, sock := startWire(t, Config{Exports: FixedExports(
		Export{Name: "", Description: "writable", Device: rw},
		Export{Name: "ro", Description: "read-only", Device: ro, ReadOnly: true},
	)})
	return sock
}

func pattern(seed uint64, n int) []byte {
	b := make([]byte, n)
	r := rand.New(rand.NewPCG(seed, seed))
	for i := range b {
		b[i] = byte(r.Uint32())
	}
	return b
}

// TestBadRequests sends requests a client must not send, checks the error
// each gets, and checks that the next good request is served correctly.
func TestBadRequests(t *testing.T) {
	t.Parallel()
	sock := wireServer(t)
	for _, structured := range []bool{false, true} {
		w := dialWire(t, "unix", sock)
		size, flags := w.negotiate("", structured)
		if size != wireSize {
			t.Fatalf("size %d, want %d", size, wireSize)
		}
		if flags&flagHasFlags == 0 || flags&flagReadOnly != 0 || flags&flagCanMultiConn != 0 {
			t.Fatalf("flags %#x", flags)
		}
		if (flags&flagSendDF != 0) != structured {
			t.Fatalf("SEND_DF %v with structured %v", flags&flagSendDF != 0, structured)
		}
		data := pattern(1, 8192)
		handle := uint64(100)
		good := func() {
			t.Helper()
			handle++
			w.request(0, cmdRead, handle, 4096, 8192, nil)
			r := w.mustReply(8192, 4096)
			if r.handle != handle || r.errno != 0 || !bytes.Equal(r.data, data) {
				t.Fatalf("good read after bad request: handle %d errno %v, data equal %v", r.handle, r.errno, bytes.Equal(r.data, data))
			}
		}
		w.request(0, cmdWrite, 1, 4096, 8192, data)
		if r := w.mustReply(0, 0); r.errno != 0 || r.handle != 1 {
			t.Fatalf("write: %+v", r)
		}
		good()

		// badRequest is a request the server must refuse with want.
		type badRequest struct {
			name    string
			flags   cmdFlags
			typ     cmdType
			off     uint64
			length  uint32
			payload []byte
			want    Errno
		}
		cases := []badRequest{
			{"read past end", 0, cmdRead, wireSize - 512, 4096, nil, EINVAL},
			{"read offset overflow", 0, cmdRead, 1<<64 - 512, 4096, nil, EINVAL},
			{"write past end", 0, cmdWrite, wireSize - 512, 4096, pattern(2, 4096), ENOSPC},
			{"write offset past end", 0, cmdWrite, 1 << 40, 512, pattern(2, 512), ENOSPC},
			{"write zeroes past end", 0, cmdWriteZeroes, wireSize, 1, nil, ENOSPC},
			{"trim past end", 0, cmdTrim, wireSize - 1, 2, nil, EINVAL},
			{"block status past end", 0, cmdBlockStatus, wireSize, 1, nil, EINVAL},
			{"read over max payload", 0, cmdRead, 0, DefaultMaxPayload + 1, nil, EINVAL},
			{"write over max payload", 0, cmdWrite, 0, DefaultMaxPayload + 1, make([]byte, DefaultMaxPayload+1), EINVAL},
			{"unknown command", 0, 99, 0, 512, nil, EINVAL},
			{"resize", 0, cmdResize, 0, 0, nil, EINVAL},
			{"unknown flag", 1 << 9, cmdRead, 0, 512, nil, EINVAL},
			{"flag of another command", cmdFlagNoHole, cmdWrite, 0, 512, pattern(3, 512), EINVAL},
			{"req_one on read", cmdFlagReqOne, cmdRead, 0, 512, nil, EINVAL},
			{"flush with offset", 0, cmdFlush, 512, 0, nil, EINVAL},
			{"block status without contexts", 0, cmdBlockStatus, 0, 512, nil, EINVAL},
		}
		if !structured {
			cases = append(cases, badRequest{"df without structured replies", cmdFlagDF, cmdRead, 0, 512, nil, EINVAL})
		}
		for _, c := range cases {
			handle++
			w.request(c.flags, c.typ, handle, c.off, c.length, c.payload)
			r := w.mustReply(0, 0)
			if r.handle != handle || r.errno != c.want {
				t.Errorf("structured=%v %s: handle %d errno %v, want %d %v", structured, c.name, r.handle, r.errno, handle, c.want)
			}
			if structured && (len(r.chunks) != 1 || r.chunks[0].typ != replyTypeError || r.chunks[0].flags&replyFlagDone == 0) {
				t.Errorf("%s: structured error reply is %+v, want one final error chunk", c.name, r.chunks)
			}
			good()
		}

		// Nothing of the refused writes landed.
		handle++
		w.request(0, cmdRead, handle, wireSize-4096, 4096, nil)
		if r := w.mustReply(4096, wireSize-4096); r.errno != 0 || !bytes.Equal(r.data, make([]byte, 4096)) {
			t.Errorf("tail after refused writes: errno %v, zero %v", r.errno, bytes.Equal(r.data, make([]byte, 4096)))
		}

		// Zero-length requests succeed and do nothing.
		for _, typ := range []cmdType{cmdRead, cmdWrite, cmdTrim, cmdWriteZeroes, cmdCache} {
			handle++
			w.request(0, typ, handle, 4096, 0, nil)
			if r := w.mustReply(0, 4096); r.errno != 0 || len(r.data) != 0 {
				t.Errorf("zero-length %v: %+v", typ, r)
			}
		}
		good()

		// A refused write too long to skip: error, then the connection
		// ends.
		w.request(0, cmdWrite, 7, 0, 0xffffffff, nil)
		if r := w.mustReply(0, 0); r.errno != EINVAL || r.handle != 7 {
			t.Errorf("huge write: %+v", r)
		}
		w.expectClosed()
	}
}

func TestReadOnlyExport(t *testing.T) {
	t.Parallel()
	sock := wireServer(t)
	w := dialWire(t, "unix", sock)
	_, flags := w.negotiate("ro", true)
	if flags&flagReadOnly == 0 || flags&(flagSendTrim|flagSendWriteZeroes|flagSendFastZero) != 0 {
		t.Fatalf("read-only export flags %#x", flags)
	}
	for i, c := range []struct {
		typ     cmdType
		length  uint32
		payload []byte
	}{
		{cmdWrite, 4096, pattern(4, 4096)},
		{cmdTrim, 4096, nil},
		{cmdWriteZeroes, 4096, nil},
		{cmdWrite, wireSize, make([]byte, wireSize)},
	} {
		w.request(0, c.typ, uint64(i), 0, c.length, c.payload)
		if r := w.mustReply(0, 0); r.errno != EPERM {
			t.Errorf("%v on read-only export: errno %v, want EPERM", c.typ, r.errno)
		}
		w.request(0, cmdRead, 50, 0, 4096, nil)
		if r := w.mustReply(4096, 0); r.errno != 0 || !bytes.Equal(r.data, make([]byte, 4096)) {
			t.Fatalf("read after refused %v: %+v", c.typ, r.errno)
		}
	}
	w.request(cmdFlagFUA, cmdFlush, 60, 0, 0, nil)
	if r := w.mustReply(0, 0); r.errno != 0 {
		t.Errorf("flush on read-only export: %v", r.errno)
	}
	w.request(0, cmdDisc, 61, 0, 0, nil)
	w.expectClosed()
}

// TestStructuredRead checks READ replies over a device with holes: holes
// go out as OFFSET_HOLE, the chunks cover the request exactly once, the
// last is final, and DF gives one data chunk.
func TestStructuredRead(t *testing.T) {
	t.Parallel()
	sock := wireServer(t)
	w := dialWire(t, "unix", sock)
	w.negotiate("", true, contextBaseAllocation, contextAllocDepth)
	data := pattern(5, 64<<10)
	w.request(0, cmdWrite, 1, 128<<10, uint32(len(data)), data)
	if r := w.mustReply(0, 0); r.errno != 0 {
		t.Fatal(r.errno)
	}
	want := make([]byte, 512<<10)
	copy(want[128<<10:], data)

	for _, df := range []bool{false, true} {
		var fl cmdFlags
		if df {
			fl = cmdFlagDF
		}
		w.request(fl, cmdRead, 2, 0, uint32(len(want)), nil)
		r := w.mustReply(len(want), 0)
		if r.errno != 0 || !bytes.Equal(r.data, want) {
			t.Fatalf("df=%v: errno %v, equal %v", df, r.errno, bytes.Equal(r.data, want))
		}
		covered := make([]int, len(want))
		var holes, datas int
		for i, c := range r.chunks {
			if (c.flags&replyFlagDone != 0) != (i == len(r.chunks)-1) {
				t.Errorf("chunk %d of %d has flags %#x", i, len(r.chunks), c.flags)
			}
			off := binary.BigEndian.Uint64(c.payload)
			var n uint64
			switch c.typ {
			case replyTypeOffsetData:
				n = uint64(len(c.payload) - 8)
				datas++
			case replyTypeOffsetHole:
				n = uint64(binary.BigEndian.Uint32(c.payload[8:]))
				holes++
			default:
				t.Fatalf("chunk type %d", c.typ)
			}
			if n == 0 {
				t.Errorf("empty chunk")
			}
			for j := off; j < off+n; j++ {
				covered[j]++
			}
		}
		for i, c := range covered {
			if c != 1 {
				t.Fatalf("df=%v: byte %d covered %d times", df, i, c)
			}
		}
		if df && (holes != 0 || datas != 1) {
			t.Errorf("DF read: %d hole and %d data chunks, want one data chunk", holes, datas)
		}
		if !df && (holes != 2 || datas != 1) {
			t.Errorf("sparse read: %d hole and %d data chunks, want 2 and 1", holes, datas)
		}
	}

	// Short reads that the reader answers itself: zeros, a hole or
	// written zeros, go out as one hole chunk unless DF or shorter than
	// minHole; data as one data chunk.
	zeros := make([]byte, 8<<10)
	w.request(0, cmdWrite, 5, 320<<10, uint32(len(zeros)), zeros)
	if r := w.mustReply(0, 0); r.errno != 0 {
		t.Fatal(r.errno)
	}
	for _, tc := range []struct {
		name  string
		flags cmdFlags
		off   uint64
		n     uint32
		hole  bool // one hole chunk, else one data chunk
	}{
		{"hole", 0, 0, 4 << 10, true},
		{"written zeros", 0, 320 << 10, 8 << 10, true},
		{"hole DF", cmdFlagDF, 0, 4 << 10, false},
		{"short hole", 0, 0, 2 << 10, false},
		{"data", 0, 128 << 10, 4 << 10, false},
	} {
		w.request(tc.flags, cmdRead, 6, tc.off, tc.n, nil)
		r := w.mustReply(int(tc.n), tc.off)
		if r.errno != 0 || !bytes.Equal(r.data, want[tc.off:tc.off+uint64(tc.n)]) {
			t.Fatalf("%s: errno %v, data equal %v", tc.name, r.errno, bytes.Equal(r.data, want[tc.off:tc.off+uint64(tc.n)]))
		}
		typ := replyTypeOffsetData
		if tc.hole {
			typ = replyTypeOffsetHole
		}
		if len(r.chunks) != 1 || r.chunks[0].typ != typ {
			t.Errorf("%s: %d chunks, first of type %d; want one of type %d", tc.name, len(r.chunks), r.chunks[0].typ, typ)
		}
	}

	// Block status: one chunk per context, REQ_ONE gives one extent.
	for _, reqOne := range []bool{false, true} {
		var fl cmdFlags
		if reqOne {
			fl = cmdFlagReqOne
		}
		w.request(fl, cmdBlockStatus, 3, 64<<10, 256<<10, nil)
		r := w.mustReply(0, 0)
		if r.errno != 0 || len(r.chunks) != 2 {
			t.Fatalf("block status: errno %v, %d chunks", r.errno, len(r.chunks))
		}
		seen := map[uint32]bool{}
		for i, c := range r.chunks {
			if c.typ != replyTypeBlockStatus || (len(c.payload)-4)%8 != 0 || len(c.payload) < 12 {
				t.Fatalf("chunk %+v", c)
			}
			if (c.flags&replyFlagDone != 0) != (i == 1) {
				t.Errorf("chunk %d flags %#x", i, c.flags)
			}
			id := binary.BigEndian.Uint32(c.payload)
			seen[id] = true
			var sum uint64
			var got [][2]uint32
			for p := c.payload[4:]; len(p) > 0; p = p[8:] {
				l, f := binary.BigEndian.Uint32(p), binary.BigEndian.Uint32(p[4:])
				if l == 0 {
					t.Errorf("zero-length extent")
				}
				sum += uint64(l)
				got = append(got, [2]uint32{l, f})
			}
			if sum > 256<<10 {
				t.Errorf("extents sum to %d, more than the request", sum)
			}
			var want [][2]uint32
			switch {
			case id == idBaseAllocation && reqOne:
				want = [][2]uint32{{64 << 10, stateHole | stateZero}}
			case id == idBaseAllocation:
				want = [][2]uint32{{64 << 10, stateHole | stateZero}, {64 << 10, 0}, {128 << 10, stateHole | stateZero}}
			case id == idAllocDepth && reqOne:
				want = [][2]uint32{{64 << 10, 1}}
			case id == idAllocDepth:
				want = [][2]uint32{{256 << 10, 1}}
			}
			if !equalPairs(got, want) {
				t.Errorf("context %d reqOne=%v: extents %v, want %v", id, reqOne, got, want)
			}
		}
		if !seen[idBaseAllocation] || !seen[idAllocDepth] {
			t.Errorf("contexts in reply: %v", seen)
		}
	}
	w.request(0, cmdBlockStatus, 4, 0, 0, nil)
	if r := w.mustReply(0, 0); r.errno != EINVAL {
		t.Errorf("zero-length block status: %v", r.errno)
	}
}

func equalPairs(a, b [][2]uint32) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// TestPipelined sends many requests without waiting and matches the
// replies, which may come in any order, by handle.
func TestPipelined(t *testing.T) {
	t.Parallel()
	sock := wireServer(t)
	w := dialWire(t, "unix", sock)
	w.negotiate("", true)
	const n = 64
	var buf bytes.Buffer
	for i := 0; i < n; i++ {
		buf.Write(requestBytes(cmdFlagFUA, cmdWrite, uint64(i), uint64(i)*8192, 8192))
		buf.Write(pattern(uint64(i), 8192))
	}
	go w.c.Write(buf.Bytes())
	seen := map[uint64]bool{}
	for i := 0; i < n; i++ {
		r := w.mustReply(0, 0)
		if r.errno != 0 || seen[r.handle] || r.handle >= n {
			t.Fatalf("reply %+v (seen %v)", r, seen[r.handle])
		}
		seen[r.handle] = true
	}
	for i := 0; i < n; i++ {
		w.request(0, cmdRead, uint64(i), uint64(i)*8192, 8192, nil)
		if r := w.mustReply(8192, uint64(i)*8192); r.errno != 0 || !bytes.Equal(r.data, pattern(uint64(i), 8192)) {
			t.Fatalf("read back %d: %v", i, r.errno)
		}
	}
}

// TestDisconnectMidRequest: a client sends acknowledged writes, then half
// a write, and vanishes. The acknowledged data stays, the half write is
// not applied, and the connection's goroutines end.
func TestDisconnectMidRequest(t *testing.T) {
	t.Parallel()
	srv, sock := wireServer2(t)
	w := dialWire(t, "unix", sock)
	w.negotiate("", false)
	data := pattern(6, 65536)
	w.request(0, cmdWrite, 1, 0, 65536, data)
	if r := w.mustReply(0, 0); r.errno != 0 {
		t.Fatal(r.errno)
	}
	w.request(0, cmdWrite, 2, 65536, 65536, data[:1000])
	w.c.Close()
	waitNoConns(t, srv)

	w = dialWire(t, "unix", sock)
	w.negotiate("", false)
	w.request(0, cmdRead, 3, 0, 131072, nil)
	r := w.mustReply(131072, 0)
	if r.errno != 0 || !bytes.Equal(r.data[:65536], data) || !bytes.Equal(r.data[65536:], make([]byte, 65536)) {
		t.Fatalf("after disconnect: errno %v, acknowledged write kept %v, half write absent %v",
			r.errno, bytes.Equal(r.data[:65536], data), bytes.Equal(r.data[65536:], make([]byte, 65536)))
	}
	w.request(0, cmdDisc, 4, 0, 0, nil)
	w.expectClosed()
	waitNoConns(t, srv)
}

func wireServer2(t *testing.T) (*Server, string) {
	rw, _ := newRawDevice(t, wireSize, false)
	return startWire(t, Config{Exports: FixedExports(Export{Device: rw})})
}

func waitNoConns(t *testing.T, s *Server) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		s.mu.Lock()
		n := len(s.mu.conns)
		s.mu.Unlock()
		if n == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d connections still open", n)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func TestBadMagicCloses(t *testing.T) {
	t.Parallel()
	_, sock := wireServer2(t)
	w := dialWire(t, "unix", sock)
	w.negotiate("", false)
	b := requestBytes(0, cmdRead, 1, 0, 512)
	b[0] ^= 0xff
	w.write(b)
	w.expectClosed()
}

// TestHandshake runs option sequences and checks every reply type and
// whether the handshake can go on.
func TestHandshake(t *testing.T) {
	t.Parallel()
	sock := wireServer(t)
	type step struct {
		opt  optType
		data []byte
		want []repType // reply types in order; nil: connection closed
	}
	cases := []struct {
		name       string
		flags      clientFlags
		steps      []step
		thenGo     bool
		thenClosed bool
	}{
		{name: "unknown option then go", steps: []step{
			{1234, []byte("junk"), []repType{repErrUnsup}},
			{optExtendedHeaders, nil, []repType{repErrUnsup}},
			{optPeekExport, nil, []repType{repErrUnsup}},
		}, thenGo: true},
		{name: "list", steps: []step{
			{optList, nil, []repType{repServer, repServer, repAck}},
			{optList, []byte("x"), []repType{repErrInvalid}},
		}, thenGo: true},
		{name: "info", steps: []step{
			{optInfo, infoData("ro", infoName, infoDescription, infoBlockSize, 77), []repType{repInfo, repInfo, repInfo, repInfo, repAck}},
			{optInfo, infoData("nope"), []repType{repErrUnknown}},
			{optInfo, []byte{0, 0, 0, 9, 'a', 0, 0}, []repType{repErrInvalid}},
			{optGo, infoData("", 1, 2)[:7], []repType{repErrInvalid}},
			{optGo, infoData("nope"), []repType{repErrUnknown}},
		}, thenGo: true},
		{name: "meta contexts", steps: []step{
			{optSetMetaContext, metaData("", contextBaseAllocation), []repType{repErrInvalid}},
			{optStructuredReply, []byte{1}, []repType{repErrInvalid}},
			{optStructuredReply, nil, []repType{repAck}},
			{optListMetaContext, metaData(""), []repType{repMetaContext, repMetaContext, repAck}},
			{optListMetaContext, metaData("", "qemu:"), []repType{repMetaContext, repAck}},
			{optListMetaContext, metaData("", "base:", "base:allocation", "x-foo:bar", "nocolon"), []repType{repMetaContext, repAck}},
			{optSetMetaContext, metaData("", "base:", "qemu:"), []repType{repAck}},
			{optSetMetaContext, metaData("nope", contextBaseAllocation), []repType{repErrUnknown}},
			{optSetMetaContext, metaData("", contextBaseAllocation)[:10], []repType{repErrInvalid}},
			{optSetMetaContext, append(metaData("", contextBaseAllocation), 0), []repType{repErrInvalid}},
			{optSetMetaContext, metaData("", contextAllocDepth, contextBaseAllocation, contextAllocDepth), []repType{repMetaContext, repMetaContext, repAck}},
		}, thenGo: true},
		{name: "starttls without tls", steps: []step{
			{optStartTLS, nil, []repType{repErrPolicy}},
		}, thenGo: true},
		{name: "abort", steps: []step{
			{optAbort, []byte("ignored"), []repType{repAck}},
		}, thenClosed: true},
		{name: "option too long", steps: []step{
			{optInfo, make([]byte, maxOptionLen+1), []repType{repErrTooBig}},
		}, thenClosed: true},
		{name: "export name unknown", steps: []step{
			{optExportName, []byte("nope"), nil},
		}},
		{name: "unknown client flags", flags: 1 << 5, thenClosed: true},
		{name: "not fixed newstyle", flags: flagCNoZeroes, thenGo: true},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			w := dialWire(t, "unix", sock)
			flags := c.flags
			if flags == 0 {
				flags = flagCFixedNewstyle | flagCNoZeroes
			}
			if hs := w.hello(flags); hs != flagFixedNewstyle|flagNoZeroes {
				t.Fatalf("handshake flags %#x", hs)
			}
			for i, s := range c.steps {
				w.sendOpt(s.opt, s.data)
				if s.want == nil {
					w.expectClosed()
					return
				}
				for j, want := range s.want {
					r := w.readOptReply()
					if r.opt != s.opt || r.typ != want {
						t.Fatalf("step %d reply %d: option %v type %#x (%q), want %v %#x", i, j, r.opt, r.typ, r.data, s.opt, want)
					}
				}
			}
			switch {
			case c.thenClosed:
				w.expectClosed()
			case c.thenGo:
				w.sendOpt(optGo, infoData(""))
				reps := w.replies()
				if last := reps[len(reps)-1]; last.typ != repAck {
					t.Fatalf("GO: %#x %q", last.typ, last.data)
				}
				w.request(0, cmdRead, 1, 0, 512, nil)
				if r, err := w.readReply(512, 0); err != nil || r.errno != 0 {
					t.Fatalf("read after handshake: %v %v", err, r.errno)
				}
			}
		})
	}
}

// TestExportName covers the old way into transmission, with and without
// the 124 zero bytes.
func TestExportName(t *testing.T) {
	t.Parallel()
	sock := wireServer(t)
	for _, noZeroes := range []bool{false, true} {
		w := dialWire(t, "unix", sock)
		flags := flagCFixedNewstyle
		if noZeroes {
			flags |= flagCNoZeroes
		}
		w.hello(flags)
		w.sendOpt(optExportName, []byte("ro"))
		n := 10
		if !noZeroes {
			n += 124
		}
		b := make([]byte, n)
		if _, err := io.ReadFull(w.r, b); err != nil {
			t.Fatal(err)
		}
		if binary.BigEndian.Uint64(b) != wireSize || transmissionFlags(binary.BigEndian.Uint16(b[8:]))&flagReadOnly == 0 {
			t.Fatalf("EXPORT_NAME reply %x", b[:10])
		}
		if !bytes.Equal(b[10:], make([]byte, n-10)) {
			t.Fatalf("padding not zero")
		}
		w.request(0, cmdRead, 9, 0, 512, nil)
		if r := w.mustReply(512, 0); r.errno != 0 || r.handle != 9 {
			t.Fatalf("read: %+v", r)
		}
	}
}

// TestShutdownGraceful: Shutdown ends handshakes, lets requests in service
// reply, and closes transmission connections.
func TestShutdownGraceful(t *testing.T) {
	t.Parallel()
	rw, _ := newRawDevice(t, wireSize, false)
	s, err := New(Config{Exports: FixedExports(Export{Device: rw}), Logger: testLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	sock := t.TempDir() + "/s"
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- s.Serve(t.Context(), l) }()
	hs := dialWire(t, "unix", sock)
	hs.hello(flagCFixedNewstyle)
	tx := dialWire(t, "unix", sock)
	tx.negotiate("", false)
	tx.request(0, cmdWrite, 1, 0, 4096, pattern(7, 4096))
	if r := tx.mustReply(0, 0); r.errno != 0 {
		t.Fatal(r.errno)
	}
	if err := s.Shutdown(t.Context()); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != ErrServerClosed {
		t.Fatalf("Serve: %v", err)
	}
	hs.expectClosed()
	tx.expectClosed()
	if err := s.Shutdown(t.Context()); err != ErrServerClosed {
		t.Errorf("second Shutdown: %v", err)
	}
	if err := s.Close(); err != ErrServerClosed {
		t.Errorf("Close after Shutdown: %v", err)
	}
	buf := make([]byte, 4096)
	rw.ReadAt(ctx, buf, 0)
	if !bytes.Equal(buf, pattern(7, 4096)) {
		t.Errorf("write lost")
	}
}

func TestConfigValidate(t *testing.T) {
	t.Parallel()
	rw, _ := newRawDevice(t, 4096, false)
	for _, c := range []struct {
		cfg  Config
		want string
	}{
		{Config{}, "no exports"},
		{Config{Exports: FixedExports(Export{Name: "a"})}, "has no device"},
		{Config{Exports: FixedExports(Export{Name: "a", Device: rw}, Export{Name: "a", Device: rw})}, `"a" used twice`},
		{Config{Exports: FixedExports(Export{Device: rw}), MaxPayload: 1000}, "MaxPayload 1000"},
		{Config{Exports: FixedExports(Export{Device: rw}), MaxInFlight: -1}, "MaxInFlight -1"},
		{Config{Exports: FixedExports(Export{Device: rw}), ClientCAs: nil, TLS: nil, MaxConnections: -2}, "MaxConnections -2"},
		{Config{Exports: FixedExports(Export{Device: rw}), HandshakeTimeout: -1}, "HandshakeTimeout -1ns"},
		{Config{Exports: FixedExports(Export{Device: rw}), IdleTimeout: -time.Second}, "IdleTimeout -1s"},
		{Config{Exports: FixedExports(Export{Device: rw}), MaxReadBufferBytes: -1}, "MaxReadBufferBytes -1"},
		{Config{Exports: FixedExports(Export{Device: rw}), MaxReadBufferBytes: 1 << 20}, "MaxReadBufferBytes 1048576 is less than one buffer of MaxPayload (33554432)"},
		{Config{Exports: FixedExports(Export{Device: rw}), MaxPayload: 100 << 10, MaxReadBufferBytes: 100 << 10}, "(131072)"},
	} {
		err := c.cfg.Validate()
		if err == nil || !bytes.Contains([]byte(err.Error()), []byte(c.want)) {
			t.Errorf("Validate(%+v) = %v, want it to mention %q", c.cfg, err, c.want)
		}
	}
	if err := (&Config{Exports: FixedExports(Export{Device: rw})}).Validate(); err != nil {
		t.Errorf("minimal config: %v", err)
	}
}

// extentCounter counts a device's Extents calls.
type extentCounter struct {
	block.Device
	calls atomic.Int64
}

func (e *extentCounter) Extents(ctx context.Context, off, n int64, dst []block.Extent) ([]block.Extent, error) {
	e.calls.Add(1)
	return e.Device.Extents(ctx, off, n, dst)
}

func (e *extentCounter) Unwrap() block.Device { return e.Device }

// TestNoHoleMap: with Export.NoHoleMap a structured READ is answered
// with its data and no Extents lookup, holes included; without it the
// same READ looks the holes up and sends them as hole chunks.
func TestNoHoleMap(t *testing.T) {
	t.Parallel()
	for _, noMap := range []bool{false, true} {
		rw, _ := newRawDevice(t, wireSize, false)
		dev := &extentCounter{Device: rw}
		_, sock := startWire(t, Config{Exports: FixedExports(Export{Device: dev, NoHoleMap: noMap})})
		w := dialWire(t, "unix", sock)
		w.negotiate("", true)
		data := pattern(9, 64<<10)
		w.request(0, cmdWrite, 1, 128<<10, uint32(len(data)), data)
		if r := w.mustReply(0, 0); r.errno != 0 {
			t.Fatal(r.errno)
		}
		want := make([]byte, 512<<10)
		copy(want[128<<10:], data)
		before := dev.calls.Load()
		w.request(0, cmdRead, 2, 0, uint32(len(want)), nil)
		r := w.mustReply(len(want), 0)
		if r.errno != 0 || !bytes.Equal(r.data, want) {
			t.Fatalf("NoHoleMap=%v: errno %v, equal %v", noMap, r.errno, bytes.Equal(r.data, want))
		}
		holes := 0
		for _, c := range r.chunks {
			if c.typ == replyTypeOffsetHole {
				holes++
			}
		}
		calls := dev.calls.Load() - before
		if noMap && (calls != 0 || holes != 0) {
			t.Errorf("NoHoleMap: %d Extents calls and %d hole chunks, want none", calls, holes)
		}
		if !noMap && (calls == 0 || holes != 2) {
			t.Errorf("hole map: %d Extents calls and %d hole chunks, want some and 2", calls, holes)
		}
	}
}
