package protocol

import (
	"bytes"
	"errors"
	"io"
	"testing"
)

// fuzzRequests are encoded requests the fuzzers start from.
func fuzzRequests() [][]byte {
	reqs := []*Request{
		{Op: OpRead, Handle: 1, Epoch: 3, Object: 0x100000002, Offset: 4096, Length: 4096},
		{Op: OpWrite, Flags: FlagSync, Handle: 2, Epoch: 3, Token: 9, Object: 0x100000002, Payload: []byte("hello, world")},
		{Op: OpHello, Handle: 3, Payload: []byte{}},
		{Op: OpWriteZeroes, Flags: FlagGated, Handle: 5, Epoch: 3, Token: 9, Object: 0x100000002, Offset: 8192, Length: 4096, Gate: 0x5eed000000000001},
		{Op: OpSettle, Handle: 6, Epoch: 3, Object: 0x100000000, Payload: AppendSettleIDs(nil, []uint64{0x5eed000000000001, 0x5eed000000000002})},
		{Op: 200, Handle: 4},
	}
	var out [][]byte
	for _, r := range reqs {
		var b bytes.Buffer
		WriteRequest(&b, r)
		out = append(out, b.Bytes())
	}
	return out
}

// FuzzReadRequest: any input gives requests or an error, never a panic,
// and whatever decodes re-encodes to the same bytes.
func FuzzReadRequest(f *testing.F) {
	for _, b := range fuzzRequests() {
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, in []byte) {
		rd := bytes.NewReader(in)
		var r Request
		for {
			start := len(in) - rd.Len()
			err := ReadRequest(rd, &r)
			if err != nil {
				known := []error{io.EOF, io.ErrUnexpectedEOF, ErrBadMagic, ErrBadVersion, ErrTooBig, ErrMalformed, ErrChecksum}
				for _, k := range known {
					if errors.Is(err, k) {
						return
					}
				}
				t.Fatalf("error of no known class: %v", err)
			}
			if r.Payload != nil && len(r.Payload) > MaxPayload {
				t.Fatalf("payload of %d bytes", len(r.Payload))
			}
			var w bytes.Buffer
			if err := WriteRequest(&w, &r); err != nil {
				t.Fatalf("re-encoding %+v: %v", r, err)
			}
			if end := len(in) - rd.Len(); !bytes.Equal(w.Bytes(), in[start:end]) {
				t.Fatalf("re-encoded\n %x\nfrom\n %x", w.Bytes(), in[start:end])
			}
		}
	})
}

func FuzzReadResponse(f *testing.F) {
	for _, r := range []*Response{
		{Status: StatusOK, Handle: 1, Epoch: 2, Version: 3, Payload: []byte("data")},
		{Status: StatusNoEnt, Handle: 2, Payload: []byte("no object 0000000100000002")},
		{Handle: 3},
	} {
		var b bytes.Buffer
		WriteResponse(&b, r)
		f.Add(b.Bytes())
	}
	f.Fuzz(func(t *testing.T, in []byte) {
		rd := bytes.NewReader(in)
		var r Response
		for {
			start := len(in) - rd.Len()
			if err := ReadResponse(rd, &r); err != nil {
				return
			}
			var w bytes.Buffer
			if err := WriteResponse(&w, &r); err != nil {
				t.Fatalf("re-encoding: %v", err)
			}
			if end := len(in) - rd.Len(); !bytes.Equal(w.Bytes(), in[start:end]) {
				t.Fatalf("re-encoded\n %x\nfrom\n %x", w.Bytes(), in[start:end])
			}
		}
	})
}

func FuzzParseObjectInfos(f *testing.F) {
	f.Add(AppendObjectInfos(nil, []ObjectInfo{{ID: 1, Version: 2, Allocated: 4096}, {ID: 5, Version: 1, Allocated: 0}}))
	f.Add(make([]byte, 24))
	f.Fuzz(func(t *testing.T, in []byte) {
		infos, err := ParseObjectInfos(nil, in)
		if err != nil {
			return
		}
		if cap(infos) > len(in)/ObjectInfoLen {
			t.Fatalf("%d entries allocated for %d bytes", cap(infos), len(in))
		}
		if out := AppendObjectInfos(nil, infos); !bytes.Equal(out, in) {
			t.Fatalf("re-encoded %x from %x", out, in)
		}
	})
}

func FuzzParseExtents(f *testing.F) {
	f.Add(AppendExtents(nil, []Extent{{0, 4096, false}, {4096, 1 << 20, true}}))
	f.Fuzz(func(t *testing.T, in []byte) {
		exts, err := ParseExtents(nil, in)
		if err != nil {
			return
		}
		if cap(exts) > len(in)/ExtentLen {
			t.Fatalf("%d entries allocated for %d bytes", cap(exts), len(in))
		}
		if out := AppendExtents(nil, exts); !bytes.Equal(out, in) {
			t.Fatalf("re-encoded %x from %x", out, in)
		}
	})
}

func FuzzParseSettleIDs(f *testing.F) {
	f.Add(AppendSettleIDs(nil, []uint64{1, 1 << 63}))
	f.Add(make([]byte, 9))
	f.Fuzz(func(t *testing.T, in []byte) {
		ids, err := ParseSettleIDs(nil, in)
		if err != nil {
			if !errors.Is(err, ErrPayload) {
				t.Fatalf("error of no known class: %v", err)
			}
			return
		}
		if out := AppendSettleIDs(nil, ids); !bytes.Equal(out, in) {
			t.Fatalf("re-encoded %x from %x", out, in)
		}
	})
}

func FuzzParseChecksumReply(f *testing.F) {
	f.Add(AppendChecksumReply(nil, 0x12345678, 9))
	f.Fuzz(func(t *testing.T, in []byte) {
		crc, v, err := ParseChecksumReply(in)
		if err != nil {
			return
		}
		if out := AppendChecksumReply(nil, crc, v); !bytes.Equal(out, in) {
			t.Fatalf("re-encoded %x from %x", out, in)
		}
	})
}
