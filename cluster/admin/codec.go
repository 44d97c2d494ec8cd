package admin

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"fmt"
)

// header is the part of a request's JSON that Serve reads first.
type header struct {
	Cmd Verb `json:"cmd"`
}

// rawCarrier is a request or reply whose raw bytes follow its JSON
// (VDIWriteRequest, VDIReadReply).
type rawCarrier interface{ rawData() []byte }

// rawReceiver takes the raw bytes that followed its JSON.
type rawReceiver interface{ setRawData([]byte) }

// rawOf returns v's raw bytes, nil for a type that carries none.
func rawOf(v any) []byte {
	if c, ok := v.(rawCarrier); ok {
		return c.rawData()
	}
	return nil
}

// frame is the plane's framing: a 4-byte big-endian length, JSON of
// that length, then raw bytes.
func frame(j, raw []byte) []byte {
	out := binary.BigEndian.AppendUint32(make([]byte, 0, 4+len(j)+len(raw)), uint32(len(j)))
	out = append(out, j...)
	return append(out, raw...)
}

// unframe splits a payload into its JSON and its raw bytes, which alias
// p.
func unframe(p []byte) (j, raw []byte, err error) {
	if len(p) < 4 {
		return nil, nil, fmt.Errorf("admin payload of %d bytes: too short for its length word", len(p))
	}
	n := binary.BigEndian.Uint32(p)
	if uint64(n) > uint64(len(p)-4) {
		return nil, nil, fmt.Errorf("admin payload: JSON of %d bytes in a payload of %d", n, len(p))
	}
	return p[4 : 4+n], p[4+n:], nil
}

// encodeRequest frames req as verb's request: req's JSON object with
// "cmd" added first, then req's raw bytes.
func encodeRequest(verb Verb, req any) ([]byte, error) {
	body, err := json.Marshal(req)
	if err != nil {
		return nil, fmt.Errorf("admin: %s: encoding the request: %w", verb, err)
	}
	if len(body) < 2 || body[0] != '{' {
		return nil, fmt.Errorf("admin: %s: request %T is not a JSON object", verb, req)
	}
	cmd, err := json.Marshal(header{Cmd: verb})
	if err != nil {
		return nil, fmt.Errorf("admin: %s: %w", verb, err)
	}
	j := cmd
	if rest := bytes.TrimSpace(body[1:]); !bytes.Equal(rest, []byte("}")) {
		// {"cmd":"…"} + , + the request's fields and closing brace.
		j = append(append(cmd[:len(cmd)-1:len(cmd)-1], ','), rest...)
	}
	return frame(j, rawOf(req)), nil
}

// decodeBody decodes a request's JSON (which holds "cmd" as well) and
// raw bytes into req, a pointer to the verb's request type.
func decodeBody(verb Verb, body, raw []byte, req any) error {
	if err := json.Unmarshal(body, req); err != nil {
		return fmt.Errorf("admin: %s: decoding the request: %w", verb, err)
	}
	if r, ok := req.(rawReceiver); ok {
		r.setRawData(raw)
	} else if len(raw) > 0 {
		return fmt.Errorf("admin: %s: %d raw bytes after a request that carries none", verb, len(raw))
	}
	return nil
}

// encodeReply frames a reply: its JSON, then its raw bytes.
func encodeReply(verb Verb, rep any, raw []byte) ([]byte, error) {
	j, err := json.Marshal(rep)
	if err != nil {
		return nil, fmt.Errorf("admin: %s: encoding the reply: %w", verb, err)
	}
	return frame(j, raw), nil
}

// decodeReply decodes a reply's payload into rep, a pointer to the
// verb's reply type.
func decodeReply(verb Verb, p []byte, rep any) error {
	j, raw, err := unframe(p)
	if err != nil {
		return fmt.Errorf("admin: %s: reply: %w", verb, err)
	}
	if err := json.Unmarshal(j, rep); err != nil {
		return fmt.Errorf("admin: %s: decoding the reply: %w", verb, err)
	}
	if r, ok := rep.(rawReceiver); ok {
		r.setRawData(raw)
	}
	return nil
}
