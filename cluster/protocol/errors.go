package protocol

import (
	"errors"
	"fmt"
	"strings"
	"syscall"

	"github.com/ovis-storage/ovis/cluster/object"
)

// Error is a response with a status other than StatusOK, as Client.Call
// returns it.
type Error struct {
	Status Status
	Op     Op
	Object object.ID
	// Msg is the responder's message, valid UTF-8 of at most MaxErrorMsg
	// bytes; it may be empty.
	Msg string
}

// Error names the op, the object, the status and the message.
func (e *Error) Error() string {
	s := fmt.Sprintf("protocol: %s %s: %s", e.Op, e.Object, e.Status)
	if e.Msg != "" {
		s += ": " + e.Msg
	}
	return s
}

// Is reports whether target is an *Error of the same status, so that
// errors.Is(err, &Error{Status: StatusOldEpoch}) tests for a status
// whatever the op and object.
//
// A StatusENOSPC error is also syscall.ENOSPC, so that a full replica's
// refusal reaches an NBD client as ENOSPC, not EIO.
func (e *Error) Is(target error) bool {
	if t, ok := target.(*Error); ok {
		return t.Status == e.Status
	}
	return e.Status == StatusENOSPC && target == syscall.ENOSPC
}

// newError builds the Error of a response to req, cleaning the message.
func newError(req *Request, resp *Response) *Error {
	msg := resp.Payload
	if len(msg) > MaxErrorMsg {
		msg = msg[:MaxErrorMsg]
	}
	return &Error{Status: resp.Status, Op: req.Op, Object: req.Object, Msg: strings.ToValidUTF8(string(msg), "\uFFFD")}
}

// StatusOf returns the status err carries: StatusOK for nil, the Status
// of an *Error in its chain, and StatusEIO for any other error (a lost
// connection, a cancelled context).
func StatusOf(err error) Status {
	if err == nil {
		return StatusOK
	}
	var e *Error
	if errors.As(err, &e) {
		return e.Status
	}
	return StatusEIO
}

var (
	// ErrConnection is wrapped by every error of a call whose connection
	// failed: the peer closed it, a read or write failed or timed out,
	// or the peer broke the framing. Unless ErrNotSent is also in the
	// chain, the request may or may not have been applied.
	ErrConnection = errors.New("protocol: connection failed")
	// ErrNotSent is wrapped, with ErrConnection, when the connection had
	// failed before any byte of the request was written: the request
	// was not applied and may be retried on a new connection.
	ErrNotSent = errors.New("protocol: request not sent")
	// ErrClosed is returned by calls on a closed Client, Pool or Server.
	ErrClosed = errors.New("protocol: closed")
	// ErrServerClosed is returned by Server.Serve after Shutdown.
	ErrServerClosed = errors.New("protocol: server closed")
)

// connError is the error of a failed connection: the peer and the
// cause, wrapping ErrConnection (and ErrNotSent when it applies).
type connError struct {
	peer    string
	cause   error
	notSent bool
}

func (e *connError) Error() string {
	s := fmt.Sprintf("protocol: connection to %s failed: %v", e.peer, e.cause)
	if e.notSent {
		s += " (request not sent)"
	}
	return s
}

func (e *connError) Unwrap() []error {
	if e.notSent {
		return []error{ErrConnection, ErrNotSent, e.cause}
	}
	return []error{ErrConnection, e.cause}
}
