package histcheck

import (
	"errors"
	"fmt"
	"slices"
	"sort"
	"strings"
)

// ViolationKind names the rule a read broke (see the package doc).
type ViolationKind uint8

const (
	// LostWrite: the read returned a value older than one whose write was
	// acknowledged before the read started.
	LostWrite ViolationKind = iota + 1
	// StaleRead: the read returned a value older than one an earlier read
	// through the same gateway returned.
	StaleRead
	// InvertedRead: as StaleRead, the earlier read through another gateway.
	InvertedRead
	// TornRead: the block was a mix of several values' sectors (or of a
	// value and zeros).
	TornRead
	// NeverWritten: bytes no write to this block produced, or a value
	// whose write had not started when the read ended.
	NeverWritten
)

// Kinds is every ViolationKind, in the order reports list them.
var Kinds = []ViolationKind{LostWrite, StaleRead, InvertedRead, TornRead, NeverWritten}

func (k ViolationKind) String() string {
	switch k {
	case LostWrite:
		return "lost write"
	case StaleRead:
		return "stale read"
	case InvertedRead:
		return "inverted read"
	case TornRead:
		return "torn read"
	case NeverWritten:
		return "never-written value"
	}
	return fmt.Sprintf("violation(%d)", k)
}

// Violation is one read that broke a rule.
type Violation struct {
	Kind     ViolationKind
	Register int
	// Read is the offending read; Read.Value is what it returned (0:
	// zeros) when that was one whole value.
	Read Op
	// Newer is, for LostWrite, StaleRead and InvertedRead, an operation of
	// a value newer than the one read that ended before Read started: the
	// acknowledged write, or the earlier read.
	Newer Op
	// Older and Later show why Newer's value is newer than Read's: Older,
	// an operation of the value read (its write, a read of it, or the
	// initial zeros), ended before Later, an operation of Newer's value,
	// started; so Newer's value was written after the value read.
	Older, Later Op
	// Detail says what the bytes were, for TornRead and NeverWritten.
	Detail string
}

func (v Violation) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "%s: block %d: %s", v.Kind, v.Register, v.Read)
	switch v.Kind {
	case LostWrite:
		fmt.Fprintf(&b, "; but %s was acknowledged before it started", v.Newer)
	case StaleRead, InvertedRead:
		fmt.Fprintf(&b, "; but %s had returned a newer value before it started", v.Newer)
	default:
		fmt.Fprintf(&b, ": %s", v.Detail)
	}
	if v.Kind <= InvertedRead {
		fmt.Fprintf(&b, " (%s is newer than %s: %s ended before %s started)", fmtValue(v.Newer.Value), fmtValue(v.Read.Value), v.Older, v.Later)
	}
	return b.String()
}

// Counts sums up a history.
type Counts struct {
	Registers int // registers with at least one operation
	Writes    int
	// WritesOK are the acknowledged writes; WritesFailed and
	// WritesTimedOut are indeterminate.
	WritesOK, WritesFailed, WritesTimedOut int
	Reads                                  int
	// ReadsOK returned bytes; ReadsFailed and ReadsTimedOut tell nothing.
	ReadsOK, ReadsFailed, ReadsTimedOut int
	// ReadsZeros are the OK reads that returned the initial zeros.
	ReadsZeros int
}

// Indeterminate is the number of writes that may or may not have taken
// effect.
func (c Counts) Indeterminate() int { return c.WritesFailed + c.WritesTimedOut }

// Report is what Check found.
type Report struct {
	Counts Counts
	// Violations are every offending read, by register, then by the
	// read's start.
	Violations []Violation
}

// ByKind counts the violations of each kind.
func (r *Report) ByKind() map[ViolationKind]int {
	m := map[ViolationKind]int{}
	for _, v := range r.Violations {
		m[v.Kind]++
	}
	return m
}

// RegistersWith returns the registers with at least one violation of kind
// k, ascending.
func (r *Report) RegistersWith(k ViolationKind) []int {
	var regs []int
	for _, v := range r.Violations {
		if v.Kind == k && !slices.Contains(regs, v.Register) {
			regs = append(regs, v.Register)
		}
	}
	slices.Sort(regs)
	return regs
}

// Summary is the counts and violations by kind in a few lines, then the
// first violation of each kind on each register, at most max of them.
func (r *Report) Summary(max int) string {
	c := r.Counts
	var b strings.Builder
	fmt.Fprintf(&b, "ops %d: writes %d (acknowledged %d, indeterminate %d: %d failed, %d timed out), reads %d (ok %d of which zeros %d, errors %d, timeouts %d), registers %d\n",
		c.Writes+c.Reads, c.Writes, c.WritesOK, c.Indeterminate(), c.WritesFailed, c.WritesTimedOut,
		c.Reads, c.ReadsOK, c.ReadsZeros, c.ReadsFailed, c.ReadsTimedOut, c.Registers)
	by := r.ByKind()
	fmt.Fprintf(&b, "violations %d:", len(r.Violations))
	for _, k := range Kinds {
		fmt.Fprintf(&b, " %s %d (blocks %d);", k, by[k], len(r.RegistersWith(k)))
	}
	b.WriteString("\n")
	type key struct {
		reg  int
		kind ViolationKind
	}
	shown := map[key]bool{}
	for _, v := range r.Violations {
		k := key{v.Register, v.Kind}
		if shown[k] {
			continue
		}
		if len(shown) == max {
			b.WriteString("... (only the first violation of each kind per block is shown)\n")
			break
		}
		shown[k] = true
		b.WriteString(v.String() + "\n")
	}
	return b.String()
}

// ErrHistory is returned by Check for a history no driver can have
// recorded: a write of value 0, one value written twice, an operation of
// an unknown kind or outcome.
var ErrHistory = errors.New("histcheck: malformed history")

// Check verifies a history (in any order) against the register model and
// returns what it found. It decodes each OK read's Data (setting Value
// in the reports' copies); ops is not changed. It returns ErrHistory,
// wrapped with the offending operation, for a malformed history.
//
// Time: O(n·V) per register of n operations and V values.
func Check(ops []Op) (*Report, error) {
	rep := &Report{}
	byReg := map[int][]Op{}
	values := map[uint64]Op{}
	for _, op := range ops {
		if err := validate(op, values); err != nil {
			return nil, err
		}
		byReg[op.Register] = append(byReg[op.Register], op)
		count(&rep.Counts, op)
	}
	regs := make([]int, 0, len(byReg))
	for r := range byReg {
		regs = append(regs, r)
	}
	slices.Sort(regs)
	rep.Counts.Registers = len(regs)
	for _, r := range regs {
		checkRegister(r, byReg[r], rep)
	}
	sort.SliceStable(rep.Violations, func(i, j int) bool {
		a, b := rep.Violations[i], rep.Violations[j]
		if a.Register != b.Register {
			return a.Register < b.Register
		}
		return a.Read.Start < b.Read.Start
	})
	return rep, nil
}

func validate(op Op, values map[uint64]Op) error {
	if op.Outcome < OK || op.Outcome > TimedOut {
		return fmt.Errorf("%w: %v", ErrHistory, op)
	}
	switch op.Kind {
	case Write:
		if op.Value == 0 {
			return fmt.Errorf("%w: a write of value 0: %v", ErrHistory, op)
		}
		if prev, ok := values[op.Value]; ok {
			return fmt.Errorf("%w: value %d written twice: %v and %v", ErrHistory, op.Value, prev, op)
		}
		values[op.Value] = op
	case Read:
		if op.Outcome == OK && op.Data == nil && op.Content.Kind == 0 {
			return fmt.Errorf("%w: an OK read without data: %v", ErrHistory, op)
		}
	default:
		return fmt.Errorf("%w: %v", ErrHistory, op)
	}
	if op.Outcome == OK && op.End < op.Start {
		return fmt.Errorf("%w: ends before it starts: %v", ErrHistory, op)
	}
	return nil
}

func count(c *Counts, op Op) {
	switch {
	case op.Kind == Write:
		c.Writes++
		switch op.Outcome {
		case OK:
			c.WritesOK++
		case Failed:
			c.WritesFailed++
		case TimedOut:
			c.WritesTimedOut++
		}
	default:
		c.Reads++
		switch op.Outcome {
		case OK:
			c.ReadsOK++
		case Failed:
			c.ReadsFailed++
		case TimedOut:
			c.ReadsTimedOut++
		}
	}
}

// cluster is what is known so far of one value: its write and the reads
// of it judged so far that broke no rule.
type cluster struct {
	value uint64
	// first is the operation that ended first (its end is minEnd), last
	// the one that started last (maxStart); nil until the value's first
	// operation has been taken in.
	first, last *Op
	write       *Op // nil for the initial zeros
}

// add takes op, an operation of c's value, into what is known of it.
func (c *cluster) add(op *Op) {
	if c.first == nil || op.end() < c.first.end() {
		c.first = op
	}
	if c.last == nil || op.Start > c.last.Start {
		c.last = op
	}
}

var initial = Op{Kind: Write, Value: 0, Start: -Never, End: -Never, Outcome: OK, Mode: "initial zeros"}

// checkRegister checks one register's operations and appends what it
// finds to rep.
//
// The operations are taken in order of their start. A read R of value v
// starting at s is judged against what is known at s: it breaks rule 3
// when some other value u has an operation X that ended before s (u was
// acknowledged or seen) and v is known older than u by operations taken
// in already (an operation of v ended before one of u started, which
// started no later than s). A read that broke a rule is not taken in:
// its value would otherwise make the good reads after it look stale.
// Every read it reports does break linearizability, and a history that
// is not linearizable gets at least one report: the earliest read that
// the rule flags with all operations taken in has all its evidence
// started before it, so nothing flagged before it hides that evidence.
func checkRegister(reg int, ops []Op, rep *Report) {
	init := initial
	init.Register = reg
	zeros := &cluster{value: 0}
	zeros.add(&init)
	clusters := map[uint64]*cluster{0: zeros}
	var order []*Op
	for i := range ops {
		if op := &ops[i]; op.Kind == Write {
			clusters[op.Value] = &cluster{value: op.Value, write: op}
		}
	}
	for i := range ops {
		op := &ops[i]
		switch {
		case op.Kind == Write:
		case op.Outcome == OK:
			c := op.Content
			if c.Kind == 0 {
				c = Decode(reg, op.Data)
			}
			op.Value = c.Value
			if c.Kind == Zeros {
				rep.Counts.ReadsZeros++
			}
			if v, bad := wholeViolation(reg, op, c, clusters); bad {
				rep.Violations = append(rep.Violations, v)
				continue
			}
		default:
			continue // a failed read tells nothing
		}
		order = append(order, op)
	}
	sort.SliceStable(order, func(i, j int) bool {
		a, b := order[i], order[j]
		if a.Start != b.Start {
			return a.Start < b.Start
		}
		return a.Kind == Write && b.Kind == Read
	})
	// Values with at least one operation taken in, in a fixed order.
	known := []*cluster{zeros}
	for _, op := range order {
		cl := clusters[op.Value]
		if op.Kind == Read {
			if v, bad := judge(reg, op, cl, known); bad {
				rep.Violations = append(rep.Violations, v)
				continue
			}
		}
		if cl.first == nil {
			known = append(known, cl)
		}
		cl.add(op)
	}
}

// judge applies rule 3 to read r of cl's value against the values known.
// It prefers to show an acknowledged write the read missed (LostWrite);
// among several, the one acknowledged last.
func judge(reg int, r *Op, cl *cluster, known []*cluster) (Violation, bool) {
	if cl.first == nil {
		// The first operation of the value: its write starts at the same
		// time or later (not before the read ends), so nothing is known
		// older than the value yet.
		return Violation{}, false
	}
	var lost, stale *cluster
	for _, u := range known {
		if u == cl || !(cl.first.end() < u.last.Start) {
			continue // u is not known newer than the value read
		}
		if w := u.write; w != nil && w.Outcome == OK && w.End < r.Start && (lost == nil || w.End > lost.write.End) {
			lost = u
		}
		if u.first.end() < r.Start && (stale == nil || u.first.End > stale.first.End) {
			stale = u
		}
	}
	v := Violation{Register: reg, Read: *r, Older: *cl.first}
	switch {
	case lost != nil:
		v.Kind, v.Newer, v.Later = LostWrite, *lost.write, *lost.last
	case stale != nil:
		v.Kind, v.Newer, v.Later = InvertedRead, *stale.first, *stale.last
		if stale.first.Gateway == r.Gateway {
			v.Kind = StaleRead
		}
	default:
		return v, false
	}
	if v.Newer.Value != v.Later.Value || v.Older.Value != v.Read.Value || v.Older.end() >= v.Later.Start || v.Newer.end() >= v.Read.Start || v.Later.Start > v.Read.Start {
		panic(fmt.Sprintf("histcheck: violation without evidence: %+v", v))
	}
	return v, true
}

// wholeViolation checks rules 1 and 2 on one OK read of content c.
func wholeViolation(reg int, op *Op, c Content, clusters map[uint64]*cluster) (Violation, bool) {
	v := Violation{Register: reg, Read: *op, Detail: c.Detail}
	switch c.Kind {
	case Torn:
		v.Kind = TornRead
		v.Detail = fmt.Sprintf("sectors of %v", c.Sectors)
		return v, true
	case Foreign, Garbage:
		v.Kind = NeverWritten
		return v, true
	}
	cl, ok := clusters[c.Value]
	switch {
	case !ok:
		v.Kind, v.Detail = NeverWritten, fmt.Sprintf("value %d was never written to block %d", c.Value, reg)
		return v, true
	case cl.write != nil && op.End < cl.write.Start:
		v.Kind, v.Detail = NeverWritten, fmt.Sprintf("the read ended before the write of value %d started: %v", c.Value, cl.write)
		return v, true
	}
	return v, false
}
