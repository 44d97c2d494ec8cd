package histcheck

import (
	"fmt"
	"math"
	"sync"
	"time"
)

// Kind is what an operation does.
type Kind uint8

const (
	// Write writes one value to one register.
	Write Kind = iota + 1
	// Read reads one register.
	Read
)

func (k Kind) String() string {
	switch k {
	case Write:
		return "write"
	case Read:
		return "read"
	}
	return fmt.Sprintf("kind(%d)", k)
}

// Outcome is how an operation ended.
type Outcome uint8

const (
	// OK: a write acknowledged (with FUA, or followed by a successful
	// flush), a read that returned bytes.
	OK Outcome = iota + 1
	// Failed: the device answered with an error, or the connection broke.
	// A failed write is indeterminate.
	Failed
	// TimedOut: no answer before the client's deadline. A write that timed
	// out is indeterminate.
	TimedOut
)

func (o Outcome) String() string {
	switch o {
	case OK:
		return "ok"
	case Failed:
		return "failed"
	case TimedOut:
		return "timed out"
	}
	return fmt.Sprintf("outcome(%d)", o)
}

// Never is the End of an operation that has none: an indeterminate write
// may take effect at any time after its Start.
const Never = time.Duration(math.MaxInt64)

// Op is one operation of a history.
type Op struct {
	Kind     Kind
	Register int // the block
	// Value is, for a write, the value written (unique in the history,
	// never 0). For a read it is set by Check from Data.
	Value uint64
	// Data is what a successful read returned (one block); nil otherwise.
	// The history owns it once recorded.
	Data []byte
	// Content is what Data holds, when already decoded (the Recorder
	// decodes every read and keeps Data only when it is not one whole
	// value or zeros, to bound a long run's memory). Check decodes Data
	// when Content.Kind is 0.
	Content Content
	// Client and Gateway name who did it and through which node; reports
	// show them, and reads through the same gateway make a stale read,
	// through different ones an inverted read.
	Client, Gateway int
	// Start and End are times on the driver's monotonic clock (time since
	// the run's start): just before the request was sent and just after
	// its reply (for a write with flush: the flush's reply). Check uses
	// End only for OK operations.
	Start, End time.Duration
	Outcome    Outcome
	// Mode says how a write was made durable: "fua" or "flush"; free text
	// for reports.
	Mode string
	// Err is the error of a failed or timed-out operation, for reports.
	Err string
}

// end is the time after which op is known to have taken effect: End for
// an OK op, Never otherwise.
func (op *Op) end() time.Duration {
	if op.Outcome == OK {
		return op.End
	}
	return Never
}

func (op Op) String() string {
	if op.Start == -Never {
		return "the initial zeros"
	}
	end := "never"
	if op.Outcome == OK {
		end = fmtTime(op.End)
	}
	what := fmtValue(op.Value)
	switch {
	case op.Kind == Read && op.Outcome != OK:
		what = "block " + fmt.Sprint(op.Register)
	case op.Kind == Read && op.Content.Kind == Torn:
		what = fmt.Sprintf("a torn block %v", op.Content.Sectors)
	case op.Kind == Read && (op.Content.Kind == Foreign || op.Content.Kind == Garbage):
		what = fmt.Sprintf("%s bytes", op.Content.Kind)
	case op.Kind == Read && op.Content.Kind != 0:
		what = fmtValue(op.Content.Value)
	}
	s := fmt.Sprintf("%s of %s by client %d through gateway %d [%s, %s] %s", op.Kind, what, op.Client, op.Gateway, fmtTime(op.Start), end, op.Outcome)
	if op.Mode != "" {
		s += " (" + op.Mode + ")"
	}
	if op.Err != "" {
		s += ": " + op.Err
	}
	return s
}

func fmtTime(d time.Duration) string {
	switch d {
	case Never:
		return "never"
	case -Never:
		return "the start"
	}
	return fmt.Sprintf("%.3fs", d.Seconds())
}

func fmtValue(v uint64) string {
	if v == 0 {
		return "zeros"
	}
	return fmt.Sprintf("value %d", v)
}

// Recorder collects the operations of a history from many clients.
//
// Safe for concurrent use.
type Recorder struct {
	mu struct {
		sync.Mutex
		ops []Op // in the order they were added
	}
}

// Add records op. The recorder owns op.Data from now on; for a read it
// decodes Data into Content and drops Data unless it is torn, foreign or
// garbage.
func (r *Recorder) Add(op Op) {
	if op.Kind == Read && op.Outcome == OK && op.Data != nil && op.Content.Kind == 0 {
		op.Content = Decode(op.Register, op.Data)
		if op.Content.Kind == Whole || op.Content.Kind == Zeros {
			op.Data = nil
		}
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.mu.ops = append(r.mu.ops, op)
}

// Ops returns a copy of the operations recorded so far; the Data slices
// are shared and must not be changed.
func (r *Recorder) Ops() []Op {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]Op(nil), r.mu.ops...)
}
