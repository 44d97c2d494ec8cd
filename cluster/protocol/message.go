package protocol

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"

	"github.com/ovis-storage/ovis/cluster/object"
)

// Request is one request, decoded.
type Request struct {
	Op    Op
	Flags Flags
	// Handle is set by the sender and echoed in the response; Client
	// assigns its own and ignores this field.
	Handle uint64
	// Epoch is the sender's membership epoch.
	Epoch uint64
	// Token is the fencing token of the VDI's writer; 0 for reads.
	Token uint64
	// Object is the object the op is on. For OpFlush, OpFence and OpList,
	// object.Make(vdi, 0) names the VDI.
	Object object.ID
	// Offset is the byte offset within the object.
	Offset uint64
	// Length is the byte count to read, zero, discard, checksum or map.
	// With a payload it is len(Payload).
	Length uint32
	// Version is the object version recovery puts; 0 otherwise.
	Version uint64
	// Gate is a gated write's gate id (FlagGated): unique per writer,
	// chosen by the gateway, released by an OpSettle naming it. On the
	// wire it takes the version field, which a gated write leaves 0; it
	// is 0 on every request without FlagGated.
	Gate uint64
	// Payload is the write data (and OpHello's name). nil means no
	// payload follows the header; the header carries its CRC32C.
	Payload []byte
}

// Response is one response, decoded.
type Response struct {
	Status Status
	// Handle is the request's handle, echoed.
	Handle uint64
	// Epoch is the responder's membership epoch.
	Epoch uint64
	// Version is the object's version after the op.
	Version uint64
	// Payload is the read data, an encoded stat, list, extents or
	// checksum reply, or for an error status a UTF-8 message of at most
	// MaxErrorMsg bytes.
	Payload []byte
}

// SetError sets the response to status s with msg as its message, cut
// to MaxErrorMsg bytes. It drops any payload set before, writing the
// message into its array.
func (r *Response) SetError(s Status, msg string) {
	r.Status = s
	if len(msg) > MaxErrorMsg {
		msg = msg[:MaxErrorMsg]
	}
	r.Payload = append(r.Payload[:0], msg...)
}

// Framing errors. Every one of them means the stream can no longer be
// trusted and the connection must end, except ErrChecksum.
var (
	// ErrBadMagic: a header did not start with Magic.
	ErrBadMagic = errors.New("protocol: bad magic")
	// ErrBadVersion: a request header carried a version other than
	// Version.
	ErrBadVersion = errors.New("protocol: unsupported version")
	// ErrTooBig: a header announced a payload over MaxPayload.
	ErrTooBig = errors.New("protocol: payload too big")
	// ErrMalformed: a header field is invalid (a reserved field not 0).
	ErrMalformed = errors.New("protocol: malformed header")
	// ErrChecksum: a payload did not match the CRC32C in its header. The
	// message was read whole, so the stream is still in sync.
	ErrChecksum = errors.New("protocol: payload checksum mismatch")
)

// putRequestHeader encodes r's header into b, with the payload length
// and checksum given.
func putRequestHeader(b []byte, r *Request, handle uint64, payload bool, n int, crc uint32) {
	_ = b[RequestHeaderLen-1]
	flags := r.Flags
	if payload {
		flags |= flagPayload
	}
	binary.BigEndian.PutUint32(b[0:], Magic)
	b[4] = Version
	b[5] = byte(r.Op)
	binary.BigEndian.PutUint16(b[6:], uint16(flags))
	binary.BigEndian.PutUint64(b[8:], handle)
	binary.BigEndian.PutUint64(b[16:], r.Epoch)
	binary.BigEndian.PutUint64(b[24:], r.Token)
	binary.BigEndian.PutUint64(b[32:], uint64(r.Object))
	binary.BigEndian.PutUint64(b[40:], r.Offset)
	if r.Flags&FlagGated != 0 {
		binary.BigEndian.PutUint64(b[48:], r.Gate)
	} else {
		binary.BigEndian.PutUint64(b[48:], r.Version)
	}
	binary.BigEndian.PutUint32(b[56:], uint32(n))
	binary.BigEndian.PutUint32(b[60:], crc)
}

// checkRequest checks what an encoder refuses to send and returns the
// wire length.
func checkRequest(r *Request) (uint32, error) {
	if r.Flags&flagPayload != 0 {
		return 0, fmt.Errorf("protocol: %s request: flag %#x is reserved", r.Op, uint16(flagPayload))
	}
	if r.Flags&FlagGated != 0 && r.Version != 0 {
		return 0, fmt.Errorf("protocol: %s request: gated with version %d: a gated request's version field carries its gate", r.Op, r.Version)
	}
	if r.Flags&FlagGated == 0 && r.Gate != 0 {
		return 0, fmt.Errorf("protocol: %s request: gate %#x without FlagGated", r.Op, r.Gate)
	}
	if r.Payload == nil {
		return r.Length, nil
	}
	if len(r.Payload) > MaxPayload {
		return 0, fmt.Errorf("protocol: %s request: payload of %d bytes: %w (max %d)", r.Op, len(r.Payload), ErrTooBig, MaxPayload)
	}
	if r.Length != 0 && int(r.Length) != len(r.Payload) {
		return 0, fmt.Errorf("protocol: %s request: length %d with a payload of %d bytes", r.Op, r.Length, len(r.Payload))
	}
	return uint32(len(r.Payload)), nil
}

// WriteRequest writes r to w: the 64-byte header, with the CRC32C of
// r.Payload, then the payload. r.Handle is sent as it is. It fails
// without writing anything when r cannot be encoded: a payload over
// MaxPayload, a Length that differs from len(Payload), a reserved flag,
// a Version on a gated request or a Gate on one that is not.
func WriteRequest(w io.Writer, r *Request) error {
	n, err := checkRequest(r)
	if err != nil {
		return err
	}
	var b [RequestHeaderLen]byte
	putRequestHeader(b[:], r, r.Handle, r.Payload != nil, int(n), Checksum(r.Payload))
	if _, err := w.Write(b[:]); err != nil {
		return fmt.Errorf("protocol: writing %s request header: %w", r.Op, err)
	}
	if len(r.Payload) > 0 {
		if _, err := w.Write(r.Payload); err != nil {
			return fmt.Errorf("protocol: writing %s request payload: %w", r.Op, err)
		}
	}
	return nil
}

// requestHeader is a decoded request header and what follows it.
type requestHeader struct {
	payload bool   // Length bytes of payload follow
	crc     uint32 // the payload's CRC32C
}

// parseRequestHeader decodes b into r (all fields but Payload) and says
// whether a payload follows. Errors wrap ErrBadMagic, ErrBadVersion,
// ErrTooBig or ErrMalformed and name the field and its value.
func parseRequestHeader(b []byte, r *Request) (requestHeader, error) {
	_ = b[RequestHeaderLen-1]
	if m := binary.BigEndian.Uint32(b[0:]); m != Magic {
		return requestHeader{}, fmt.Errorf("%w: request magic %#08x, want %#08x", ErrBadMagic, m, Magic)
	}
	if v := b[4]; v != Version {
		return requestHeader{}, fmt.Errorf("%w: request version %d, want %d", ErrBadVersion, v, Version)
	}
	flags := Flags(binary.BigEndian.Uint16(b[6:]))
	*r = Request{
		Op:      Op(b[5]),
		Flags:   flags &^ flagPayload,
		Handle:  binary.BigEndian.Uint64(b[8:]),
		Epoch:   binary.BigEndian.Uint64(b[16:]),
		Token:   binary.BigEndian.Uint64(b[24:]),
		Object:  object.ID(binary.BigEndian.Uint64(b[32:])),
		Offset:  binary.BigEndian.Uint64(b[40:]),
		Version: binary.BigEndian.Uint64(b[48:]),
		Length:  binary.BigEndian.Uint32(b[56:]),
	}
	if flags&FlagGated != 0 {
		r.Gate, r.Version = r.Version, 0
	}
	h := requestHeader{payload: flags&flagPayload != 0, crc: binary.BigEndian.Uint32(b[60:])}
	if !h.payload && h.crc != 0 {
		return h, fmt.Errorf("%w: %s request without payload has crc32c %#08x, want 0", ErrMalformed, r.Op, h.crc)
	}
	if h.payload && r.Length > MaxPayload {
		return h, fmt.Errorf("%w: %s request length %d, max %d", ErrTooBig, r.Op, r.Length, MaxPayload)
	}
	return h, nil
}

// ReadRequest reads one request from rd into req. req.Payload's array is
// reused when it is large enough; otherwise a new one grows as the
// payload arrives, so that a header alone never costs an allocation of
// its length. A request without a payload leaves req.Payload nil.
//
// It returns io.EOF when rd ends before a header starts, an error
// wrapping io.ErrUnexpectedEOF inside one, and errors wrapping
// ErrBadMagic, ErrBadVersion, ErrTooBig or ErrMalformed (a checksum
// without a payload) for headers that end the stream. A payload that fails its checksum returns an error wrapping
// ErrChecksum with req filled, so that the receiver can reply.
func ReadRequest(rd io.Reader, req *Request) error {
	var b [RequestHeaderLen]byte
	if _, err := io.ReadFull(rd, b[:]); err != nil {
		if err == io.EOF {
			return io.EOF
		}
		return fmt.Errorf("protocol: reading request header: %w", err)
	}
	buf := req.Payload
	h, err := parseRequestHeader(b[:], req)
	if err != nil {
		return err
	}
	if !h.payload {
		return nil
	}
	p, err := readPayload(rd, buf, int(req.Length))
	if err != nil {
		return fmt.Errorf("protocol: reading %s request payload of %d bytes: %w", req.Op, req.Length, err)
	}
	if p == nil {
		p = []byte{} // a payload of no bytes is still a payload
	}
	req.Payload = p
	if c := Checksum(p); c != h.crc {
		return fmt.Errorf("%w: %s request handle %d: crc32c %#08x, header says %#08x", ErrChecksum, req.Op, req.Handle, c, h.crc)
	}
	return nil
}

// putResponseHeader encodes r's header into b.
func putResponseHeader(b []byte, r *Response, crc uint32) {
	_ = b[ResponseHeaderLen-1]
	binary.BigEndian.PutUint32(b[0:], Magic)
	binary.BigEndian.PutUint16(b[4:], uint16(r.Status))
	binary.BigEndian.PutUint16(b[6:], 0)
	binary.BigEndian.PutUint64(b[8:], r.Handle)
	binary.BigEndian.PutUint64(b[16:], r.Epoch)
	binary.BigEndian.PutUint64(b[24:], r.Version)
	binary.BigEndian.PutUint32(b[32:], uint32(len(r.Payload)))
	binary.BigEndian.PutUint32(b[36:], crc)
}

// WriteResponse writes r to w: the 40-byte header, with the CRC32C of
// r.Payload, then the payload. It fails without writing anything when
// the payload is over MaxPayload.
func WriteResponse(w io.Writer, r *Response) error {
	if len(r.Payload) > MaxPayload {
		return fmt.Errorf("protocol: response handle %d: payload of %d bytes: %w (max %d)", r.Handle, len(r.Payload), ErrTooBig, MaxPayload)
	}
	var b [ResponseHeaderLen]byte
	putResponseHeader(b[:], r, Checksum(r.Payload))
	if _, err := w.Write(b[:]); err != nil {
		return fmt.Errorf("protocol: writing response header: %w", err)
	}
	if len(r.Payload) > 0 {
		if _, err := w.Write(r.Payload); err != nil {
			return fmt.Errorf("protocol: writing response payload: %w", err)
		}
	}
	return nil
}

// parseResponseHeader decodes b into r (all fields but Payload) and
// returns the payload length and checksum.
func parseResponseHeader(b []byte, r *Response) (n int, crc uint32, err error) {
	_ = b[ResponseHeaderLen-1]
	if m := binary.BigEndian.Uint32(b[0:]); m != Magic {
		return 0, 0, fmt.Errorf("%w: response magic %#08x, want %#08x", ErrBadMagic, m, Magic)
	}
	if res := binary.BigEndian.Uint16(b[6:]); res != 0 {
		return 0, 0, fmt.Errorf("%w: response reserved field %#04x, want 0", ErrMalformed, res)
	}
	*r = Response{
		Status:  Status(binary.BigEndian.Uint16(b[4:])),
		Handle:  binary.BigEndian.Uint64(b[8:]),
		Epoch:   binary.BigEndian.Uint64(b[16:]),
		Version: binary.BigEndian.Uint64(b[24:]),
	}
	l := binary.BigEndian.Uint32(b[32:])
	if l > MaxPayload {
		return 0, 0, fmt.Errorf("%w: response handle %d length %d, max %d", ErrTooBig, r.Handle, l, MaxPayload)
	}
	return int(l), binary.BigEndian.Uint32(b[36:]), nil
}

// ReadResponse reads one response from rd into resp, reusing
// resp.Payload's array as ReadRequest does. A response without a
// payload leaves resp.Payload empty but not nil when an array was
// given, nil otherwise.
//
// Its errors are those of ReadRequest; ErrChecksum comes with resp
// filled.
func ReadResponse(rd io.Reader, resp *Response) error {
	var b [ResponseHeaderLen]byte
	if _, err := io.ReadFull(rd, b[:]); err != nil {
		if err == io.EOF {
			return io.EOF
		}
		return fmt.Errorf("protocol: reading response header: %w", err)
	}
	buf := resp.Payload
	n, crc, err := parseResponseHeader(b[:], resp)
	if err != nil {
		return err
	}
	if n == 0 {
		resp.Payload = buf[:0]
		if crc != 0 {
			return fmt.Errorf("%w: response handle %d: crc32c 0 of no payload, header says %#08x", ErrChecksum, resp.Handle, crc)
		}
		return nil
	}
	p, err := readPayload(rd, buf, n)
	if err != nil {
		return fmt.Errorf("protocol: reading response handle %d payload of %d bytes: %w", resp.Handle, n, err)
	}
	resp.Payload = p
	if c := Checksum(p); c != crc {
		return fmt.Errorf("%w: response handle %d: crc32c %#08x, header says %#08x", ErrChecksum, resp.Handle, c, crc)
	}
	return nil
}

// growStart is the first allocation for a payload that does not fit the
// buffer given: a hostile header costs at most this before its bytes
// arrive.
const growStart = 64 << 10

// readPayload reads n bytes from rd into buf's array when it is large
// enough, else into a new array that at most doubles what has arrived,
// so that memory follows the bytes received and not the length claimed.
func readPayload(rd io.Reader, buf []byte, n int) ([]byte, error) {
	if cap(buf) >= n {
		buf = buf[:n]
		if _, err := io.ReadFull(rd, buf); err != nil {
			return nil, unexpected(err)
		}
		return buf, nil
	}
	buf = nil
	for len(buf) < n {
		if len(buf) == cap(buf) {
			c := min(max(2*cap(buf), growStart), n)
			nb := make([]byte, len(buf), c)
			copy(nb, buf)
			buf = nb
		}
		m, err := io.ReadFull(rd, buf[len(buf):cap(buf)])
		buf = buf[:len(buf)+m]
		if err != nil {
			return nil, unexpected(err)
		}
	}
	return buf, nil
}

// unexpected turns an EOF inside a message into io.ErrUnexpectedEOF.
func unexpected(err error) error {
	if err == io.EOF {
		return io.ErrUnexpectedEOF
	}
	return err
}
