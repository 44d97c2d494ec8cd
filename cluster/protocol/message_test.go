package protocol

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"runtime"
	"slices"
	"testing"

	"github.com/ovis-storage/ovis/cluster/object"
	"pgregory.net/rapid"
)

func genRequest(t *rapid.T) *Request {
	r := &Request{
		Op:      Op(rapid.Uint8().Draw(t, "op")),
		Flags:   Flags(rapid.Uint16Range(0, uint16(flagPayload-1)).Draw(t, "flags")),
		Handle:  rapid.Uint64().Draw(t, "handle"),
		Epoch:   rapid.Uint64().Draw(t, "epoch"),
		Token:   rapid.Uint64().Draw(t, "token"),
		Object:  object.ID(rapid.Uint64().Draw(t, "object")),
		Offset:  rapid.Uint64().Draw(t, "offset"),
		Version: rapid.Uint64().Draw(t, "version"),
	}
	if r.Flags&FlagGated != 0 {
		// A gated request carries its gate in the version field.
		r.Version, r.Gate = 0, rapid.Uint64().Draw(t, "gate")
	}
	if rapid.Bool().Draw(t, "hasPayload") {
		r.Payload = rapid.SliceOfN(rapid.Byte(), 0, 5000).Draw(t, "payload")
		if r.Payload == nil {
			r.Payload = []byte{}
		}
		r.Length = uint32(len(r.Payload))
	} else {
		r.Length = rapid.Uint32().Draw(t, "length")
	}
	return r
}

func genResponse(t *rapid.T) *Response {
	return &Response{
		Status:  Status(rapid.Uint16().Draw(t, "status")),
		Handle:  rapid.Uint64().Draw(t, "handle"),
		Epoch:   rapid.Uint64().Draw(t, "epoch"),
		Version: rapid.Uint64().Draw(t, "version"),
		Payload: rapid.SliceOfN(rapid.Byte(), 0, 5000).Draw(t, "payload"),
	}
}

func reqEqual(a, b *Request) bool {
	return a.Op == b.Op && a.Flags == b.Flags && a.Handle == b.Handle && a.Epoch == b.Epoch &&
		a.Token == b.Token && a.Object == b.Object && a.Offset == b.Offset && a.Length == b.Length &&
		a.Version == b.Version && a.Gate == b.Gate && (a.Payload == nil) == (b.Payload == nil) && bytes.Equal(a.Payload, b.Payload)
}

// TestRequestRoundTrip: any request encodes and decodes to itself, with
// a reused buffer or without, and several in a row on one stream.
func TestRequestRoundTrip(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		reqs := rapid.SliceOfN(rapid.Custom(genRequest), 1, 5).Draw(t, "reqs")
		var w bytes.Buffer
		for _, r := range reqs {
			if err := WriteRequest(&w, r); err != nil {
				t.Fatalf("write %+v: %v", r, err)
			}
		}
		var got Request
		if rapid.Bool().Draw(t, "reuse") {
			got.Payload = make([]byte, 0, 6000)
		}
		for i, want := range reqs {
			if err := ReadRequest(&w, &got); err != nil {
				t.Fatalf("read %d: %v", i, err)
			}
			if !reqEqual(&got, want) {
				t.Fatalf("request %d: got %+v, want %+v", i, got, *want)
			}
		}
		if err := ReadRequest(&w, &got); err != io.EOF {
			t.Fatalf("read at the end: %v, want io.EOF", err)
		}
	})
}

func TestResponseRoundTrip(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		resps := rapid.SliceOfN(rapid.Custom(genResponse), 1, 5).Draw(t, "resps")
		var w bytes.Buffer
		for _, r := range resps {
			if err := WriteResponse(&w, r); err != nil {
				t.Fatalf("write: %v", err)
			}
		}
		var got Response
		for i, want := range resps {
			if err := ReadResponse(&w, &got); err != nil {
				t.Fatalf("read %d: %v", i, err)
			}
			if got.Status != want.Status || got.Handle != want.Handle || got.Epoch != want.Epoch ||
				got.Version != want.Version || !bytes.Equal(got.Payload, want.Payload) {
				t.Fatalf("response %d: got %+v, want %+v", i, got, *want)
			}
		}
	})
}

// TestHeaderLayout pins the wire layout: every field at its offset.
func TestHeaderLayout(t *testing.T) {
	r := &Request{Op: OpWrite, Flags: FlagSync, Handle: 0x0102030405060708, Epoch: 0x1112131415161718,
		Token: 0x2122232425262728, Object: 0x3132333435363738, Offset: 0x4142434445464748,
		Version: 0x5152535455565758, Payload: []byte("abc")}
	var w bytes.Buffer
	if err := WriteRequest(&w, r); err != nil {
		t.Fatal(err)
	}
	want := []byte{
		'o', 'v', 'i', 's', 1, 3, 0x80, 0x01,
		1, 2, 3, 4, 5, 6, 7, 8,
		0x11, 0x12, 0x13, 0x14, 0x15, 0x16, 0x17, 0x18,
		0x21, 0x22, 0x23, 0x24, 0x25, 0x26, 0x27, 0x28,
		0x31, 0x32, 0x33, 0x34, 0x35, 0x36, 0x37, 0x38,
		0x41, 0x42, 0x43, 0x44, 0x45, 0x46, 0x47, 0x48,
		0x51, 0x52, 0x53, 0x54, 0x55, 0x56, 0x57, 0x58,
		0, 0, 0, 3,
	}
	crc := Checksum([]byte("abc"))
	want = append(want, byte(crc>>24), byte(crc>>16), byte(crc>>8), byte(crc))
	want = append(want, "abc"...)
	if !bytes.Equal(w.Bytes(), want) {
		t.Fatalf("request bytes\n got %x\nwant %x", w.Bytes(), want)
	}
	// CRC32C check value from RFC 3720 B.4: 32 bytes of zeroes.
	if got := Checksum(make([]byte, 32)); got != 0x8a9136aa {
		t.Fatalf("crc32c of 32 zero bytes = %#x, want 0x8a9136aa", got)
	}

	w.Reset()
	if err := WriteResponse(&w, &Response{Status: StatusNoEnt, Handle: 0x0102030405060708, Epoch: 9, Version: 10}); err != nil {
		t.Fatal(err)
	}
	wantResp := []byte{'o', 'v', 'i', 's', 0, 4, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8,
		0, 0, 0, 0, 0, 0, 0, 9, 0, 0, 0, 0, 0, 0, 0, 10, 0, 0, 0, 0, 0, 0, 0, 0}
	if !bytes.Equal(w.Bytes(), wantResp) {
		t.Fatalf("response bytes\n got %x\nwant %x", w.Bytes(), wantResp)
	}
}

// header returns an encoded request header with fields patched by f.
func header(f func(b []byte)) []byte {
	var b [RequestHeaderLen]byte
	putRequestHeader(b[:], &Request{Op: OpRead, Length: 4096}, 1, false, 4096, 0)
	if f != nil {
		f(b[:])
	}
	return b[:]
}

func TestReadRequestHostile(t *testing.T) {
	tests := []struct {
		name  string
		input []byte
		want  error
	}{
		{"empty", nil, io.EOF},
		{"short header", header(nil)[:30], io.ErrUnexpectedEOF},
		{"bad magic", header(func(b []byte) { b[0] = 'x' }), ErrBadMagic},
		{"bad version", header(func(b []byte) { b[4] = 2 }), ErrBadVersion},
		{"too big", header(func(b []byte) { b[6] = 0x80; b[56] = 0x10 }), ErrTooBig},
		{"crc without payload", header(func(b []byte) { b[63] = 1 }), ErrMalformed},
		{"short payload", append(header(func(b []byte) { b[6] = 0x80 }), 1, 2, 3), io.ErrUnexpectedEOF},
		{"bad crc", append(header(func(b []byte) { b[6] = 0x80; b[56], b[57], b[58], b[59] = 0, 0, 0, 1 }), 7), ErrChecksum},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var r Request
			err := ReadRequest(bytes.NewReader(tt.input), &r)
			if !errors.Is(err, tt.want) {
				t.Fatalf("err %v, want %v", err, tt.want)
			}
		})
	}
}

func TestWriteRequestRefuses(t *testing.T) {
	tests := []struct {
		name string
		r    Request
	}{
		{"reserved flag", Request{Op: OpRead, Flags: flagPayload}},
		{"length mismatch", Request{Op: OpWrite, Length: 5, Payload: []byte("abc")}},
	}
	for _, tt := range tests {
		var w bytes.Buffer
		if err := WriteRequest(&w, &tt.r); err == nil || w.Len() != 0 {
			t.Errorf("%s: err %v, %d bytes written; want an error and nothing", tt.name, err, w.Len())
		}
	}
	big := &Response{Payload: make([]byte, MaxPayload+1)}
	if err := WriteResponse(io.Discard, big); !errors.Is(err, ErrTooBig) {
		t.Errorf("response over MaxPayload: %v", err)
	}
}

// TestPayloadAllocationFollowsBytes: a header claiming MaxPayload with a
// few bytes behind it costs far less than MaxPayload.
func TestPayloadAllocationFollowsBytes(t *testing.T) {
	in := append(header(func(b []byte) {
		b[6] = 0x80
		binary.BigEndian.PutUint32(b[56:], MaxPayload)
	}), make([]byte, 100)...)
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	for range 10 {
		var r Request
		if err := ReadRequest(bytes.NewReader(in), &r); !errors.Is(err, io.ErrUnexpectedEOF) {
			t.Fatalf("err %v", err)
		}
	}
	runtime.ReadMemStats(&after)
	if got := after.TotalAlloc - before.TotalAlloc; got > 10*2*growStart+64<<10 {
		t.Fatalf("10 truncated %d-byte payloads allocated %d bytes", MaxPayload, got)
	}
}

func TestStringers(t *testing.T) {
	for op := Op(0); op <= maxOp+1; op++ {
		s := op.String()
		if op.Known() == (s == "" || s[0] == 'o' && s[1] == 'p' && s[2] == '(') {
			t.Errorf("op %d: %q", op, s)
		}
	}
	for st := Status(0); st <= StatusSuspect; st++ {
		if s := st.String(); s == "" || s[0] == 's' && len(s) > 6 && s[:7] == "status(" {
			t.Errorf("status %d has no name: %q", st, s)
		}
	}
	if s := (FlagSync | FlagNoUnmap | FlagGated | 0x40).String(); s != "sync|no-unmap|gated|0x40" {
		t.Errorf("flags: %q", s)
	}
}

// TestGateField: a gated request's gate travels in the version field,
// and the encoder refuses a request that would lose one of the two.
func TestGateField(t *testing.T) {
	var b bytes.Buffer
	in := &Request{Op: OpWrite, Flags: FlagGated | FlagSync, Gate: 0xabcdef0123456789, Object: 5, Payload: []byte("x")}
	if err := WriteRequest(&b, in); err != nil {
		t.Fatal(err)
	}
	if got := binary.BigEndian.Uint64(b.Bytes()[48:]); got != in.Gate {
		t.Fatalf("version field %#x, want the gate %#x", got, in.Gate)
	}
	var out Request
	if err := ReadRequest(&b, &out); err != nil || out.Gate != in.Gate || out.Version != 0 || out.Flags != in.Flags {
		t.Fatalf("decoded %+v, %v", out, err)
	}
	for _, bad := range []*Request{
		{Op: OpWrite, Flags: FlagGated, Gate: 1, Version: 2, Payload: []byte{}},
		{Op: OpWrite, Gate: 1, Payload: []byte{}},
	} {
		if err := WriteRequest(io.Discard, bad); err == nil {
			t.Errorf("%+v encoded", bad)
		}
	}
}

func TestSettleIDs(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		ids := rapid.SliceOfN(rapid.Uint64(), 1, 100).Draw(t, "ids")
		got, err := ParseSettleIDs(nil, AppendSettleIDs(nil, ids))
		if err != nil || !slices.Equal(got, ids) {
			t.Fatalf("%v, %v; want %v", got, err, ids)
		}
	})
	for _, p := range [][]byte{nil, {}, make([]byte, 7), make([]byte, MaxSettlePayload+8)} {
		if _, err := ParseSettleIDs(nil, p); !errors.Is(err, ErrPayload) {
			t.Errorf("%d bytes: %v", len(p), err)
		}
	}
}

func TestError(t *testing.T) {
	err := error(&Error{Status: StatusOldEpoch, Op: OpWrite, Object: object.Make(7, 3), Msg: "epoch 4 < 5"})
	if !errors.Is(err, &Error{Status: StatusOldEpoch}) || errors.Is(err, &Error{Status: StatusNewEpoch}) {
		t.Fatal("Is does not match on status")
	}
	if StatusOf(err) != StatusOldEpoch || StatusOf(nil) != StatusOK || StatusOf(io.EOF) != StatusEIO {
		t.Fatal("StatusOf")
	}
	if want := "protocol: write 0000000700000003: old epoch: epoch 4 < 5"; err.Error() != want {
		t.Fatalf("%q, want %q", err.Error(), want)
	}
}
