package admin

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/ovis-storage/ovis/cluster/membership"
	"github.com/ovis-storage/ovis/cluster/protocol"
)

// UnknownVerbError is the refusal of a request whose verb no Call
// declares (a newer command line, a typo in a script).
type UnknownVerbError struct {
	Verb Verb
}

func (e *UnknownVerbError) Error() string {
	return fmt.Sprintf("unknown admin command %q", string(e.Verb))
}

// Serve decodes one OpAdmin payload, routes it by its verb to h and
// returns the reply's payload. Its error refuses the request: an
// *UnknownVerbError, a framing or decoding error, or the Handler's own
// error, which the node sends back as it is worded (Status gives its
// status). Safe for concurrent use when h is.
func Serve(ctx context.Context, h Handler, payload []byte) ([]byte, error) {
	body, raw, err := unframe(payload)
	if err != nil {
		return nil, err
	}
	var hd header
	if err := json.Unmarshal(body, &hd); err != nil {
		return nil, fmt.Errorf("admin payload: %w", err)
	}
	r, ok := routes[hd.Cmd]
	if !ok {
		return nil, &UnknownVerbError{Verb: hd.Cmd}
	}
	rep, repRaw, err := r(ctx, h, body, raw)
	if err != nil {
		return nil, err
	}
	return encodeReply(hd.Cmd, rep, repRaw)
}

// Status is the protocol status that refuses a request with err: NoEnt
// for a VDI that does not exist, EINVAL for the rest (the text says
// why).
func Status(err error) protocol.Status {
	if errors.Is(err, membership.ErrNoVDI) {
		return protocol.StatusNoEnt
	}
	return protocol.StatusEINVAL
}
