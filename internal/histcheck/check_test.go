package histcheck

import (
	"errors"
	"slices"
	"strings"
	"testing"
	"time"
)

// ms is a time of the hand-made histories.
func ms(n int) time.Duration { return time.Duration(n) * time.Millisecond }

// write is an acknowledged write of v to register reg over [start, end].
func write(reg int, v uint64, start, end int) Op {
	return Op{Kind: Write, Register: reg, Value: v, Start: ms(start), End: ms(end), Outcome: OK, Mode: "fua"}
}

// lostTrack is a write of v that failed: indeterminate.
func lostTrack(reg int, v uint64, start int, how Outcome) Op {
	return Op{Kind: Write, Register: reg, Value: v, Start: ms(start), Outcome: how, Err: "EIO"}
}

// read is a read of register reg through gateway gw over [start, end]
// that returned value v (0: zeros).
func read(reg int, v uint64, gw, start, end int) Op {
	data := make([]byte, BlockSize)
	if v != 0 {
		data = Encode(reg, v)
	}
	return Op{Kind: Read, Register: reg, Data: data, Gateway: gw, Start: ms(start), End: ms(end), Outcome: OK}
}

func mustCheck(t *testing.T, ops []Op) *Report {
	t.Helper()
	rep, err := Check(ops)
	if err != nil {
		t.Fatal(err)
	}
	return rep
}

// wantViolations checks that the report has exactly the kinds want, in
// order, and that each names the read that started at the given time.
func wantViolations(t *testing.T, rep *Report, want []ViolationKind, readStarts []int) {
	t.Helper()
	var got []ViolationKind
	for _, v := range rep.Violations {
		got = append(got, v.Kind)
	}
	if !slices.Equal(got, want) {
		t.Fatalf("violations %v, want %v\n%s", got, want, rep.Summary(20))
	}
	for i, v := range rep.Violations {
		if v.Read.Start != ms(readStarts[i]) {
			t.Errorf("violation %d names the read at %v, want the one at %v: %v", i, v.Read.Start, ms(readStarts[i]), v)
		}
		if s := v.String(); !strings.Contains(s, v.Kind.String()) || !strings.Contains(s, "block") {
			t.Errorf("violation %d reads %q", i, s)
		}
	}
}

func TestLostWriteReadsZeros(t *testing.T) {
	rep := mustCheck(t, []Op{
		write(3, 1, 0, 10),
		read(3, 1, 0, 11, 12),
		read(3, 0, 1, 20, 21), // the acknowledged write is gone: zeros
	})
	wantViolations(t, rep, []ViolationKind{LostWrite}, []int{20})
	v := rep.Violations[0]
	if v.Register != 3 || v.Newer.Value != 1 || v.Read.Value != 0 || v.Older.Mode != "initial zeros" {
		t.Errorf("evidence: %v", v)
	}
	if !strings.Contains(v.String(), "but write of value 1 by client 0 through gateway 0 [0.000s, 0.010s] ok (fua) was acknowledged") {
		t.Errorf("report does not say which write was lost: %v", v)
	}
}

func TestLostWriteReadsOlderValue(t *testing.T) {
	rep := mustCheck(t, []Op{
		write(0, 1, 0, 10),
		write(0, 2, 20, 30),
		read(0, 2, 0, 31, 32),
		read(0, 1, 2, 40, 41), // 1 came back
		read(0, 2, 1, 50, 51),
	})
	wantViolations(t, rep, []ViolationKind{LostWrite}, []int{40})
	v := rep.Violations[0]
	if v.Newer.Value != 2 || v.Older.Value != 1 || v.Later.Value != 2 || v.Older.End >= v.Later.Start {
		t.Errorf("evidence: %v", v)
	}
}

// The write is still in flight: reads may see either value, but once
// one returned the new value, no later read may return the old one.
func TestStaleReadSameGateway(t *testing.T) {
	rep := mustCheck(t, []Op{
		write(1, 1, 0, 10),
		write(1, 2, 20, 100),
		read(1, 2, 0, 30, 31),
		read(1, 1, 0, 40, 41),
	})
	wantViolations(t, rep, []ViolationKind{StaleRead}, []int{40})
	if v := rep.Violations[0]; v.Newer.Kind != Read || v.Newer.Start != ms(30) {
		t.Errorf("the stale read should be shown against the read at 30 ms: %v", v)
	}
}

func TestInvertedReadAcrossGateways(t *testing.T) {
	rep := mustCheck(t, []Op{
		write(1, 1, 0, 10),
		write(1, 2, 20, 100),
		read(1, 2, 0, 30, 31),
		read(1, 1, 3, 40, 41),
	})
	wantViolations(t, rep, []ViolationKind{InvertedRead}, []int{40})
}

// A read of an indeterminate write shows it took effect; an older value
// after that is stale.
func TestStaleAfterIndeterminateWriteSeen(t *testing.T) {
	rep := mustCheck(t, []Op{
		write(0, 1, 0, 10),
		lostTrack(0, 2, 20, TimedOut),
		read(0, 2, 0, 30, 31),
		read(0, 1, 1, 40, 41),
	})
	wantViolations(t, rep, []ViolationKind{InvertedRead}, []int{40})
}

func TestTornRead(t *testing.T) {
	data := Encode(5, 1)
	copy(data[2048:], Encode(5, 2)[2048:])
	rep := mustCheck(t, []Op{
		write(5, 1, 0, 10),
		write(5, 2, 0, 10),
		{Kind: Read, Register: 5, Data: data, Start: ms(5), End: ms(6), Outcome: OK},
	})
	wantViolations(t, rep, []ViolationKind{TornRead}, []int{5})
	if d := rep.Violations[0].Detail; d != "sectors of [1 1 1 1 2 2 2 2]" {
		t.Errorf("detail %q", d)
	}
	// Half a value and half zeros is torn too.
	data = Encode(5, 1)
	clear(data[:512])
	rep = mustCheck(t, []Op{write(5, 1, 0, 10), {Kind: Read, Register: 5, Data: data, Start: ms(20), End: ms(21), Outcome: OK}})
	wantViolations(t, rep, []ViolationKind{TornRead}, []int{20})
}

func TestNeverWritten(t *testing.T) {
	garbage := Encode(2, 1)
	garbage[100] ^= 1
	shifted := Encode(2, 1)
	copy(shifted[512:1024], Encode(2, 1)[:512])
	rep := mustCheck(t, []Op{
		write(2, 1, 0, 10),
		write(3, 9, 0, 10),
		read(2, 7, 0, 20, 21), // a well-formed value nobody wrote
		{Kind: Read, Register: 2, Data: garbage, Start: ms(30), End: ms(31), Outcome: OK},
		{Kind: Read, Register: 2, Data: Encode(3, 9), Start: ms(40), End: ms(41), Outcome: OK}, // register 3's block
		{Kind: Read, Register: 2, Data: shifted, Start: ms(50), End: ms(51), Outcome: OK},
		write(2, 8, 70, 80),
		read(2, 8, 0, 60, 61), // from the future
	})
	wantViolations(t, rep, []ViolationKind{NeverWritten, NeverWritten, NeverWritten, NeverWritten, NeverWritten}, []int{20, 30, 40, 50, 60})
	for i, want := range []string{"never written to block 2", "not its bytes", "of register 3", "sector 0 of value 1", "before the write of value 8 started"} {
		if d := rep.Violations[i].Detail; !strings.Contains(d, want) {
			t.Errorf("violation %d: detail %q lacks %q", i, d, want)
		}
	}
}

// Valid histories: concurrent writes read in either order, indeterminate
// writes that took effect or never did, failed reads.
func TestValidHistories(t *testing.T) {
	ops := []Op{
		read(0, 0, 0, 0, 1),
		write(0, 1, 0, 10),
		read(0, 1, 1, 5, 6), // during the write
		read(0, 1, 0, 11, 12),
		lostTrack(0, 2, 20, Failed), // never read: may never have happened
		read(0, 1, 2, 30, 31),
		lostTrack(0, 3, 40, TimedOut),
		read(0, 1, 0, 50, 51), // 3 not yet taken effect
		read(0, 3, 1, 60, 61), // now it has
		read(0, 3, 2, 70, 71),
		{Kind: Read, Register: 0, Start: ms(72), Outcome: Failed, Err: "EIO"},
		{Kind: Read, Register: 0, Start: ms(73), Outcome: TimedOut},
		// Two concurrent writes; reads settle on 5 after both.
		write(0, 4, 80, 90),
		write(0, 5, 80, 90),
		read(0, 5, 0, 85, 86),
		read(0, 5, 1, 91, 92),
		// Another register, untouched but read.
		read(1, 0, 0, 0, 100),
	}
	rep := mustCheck(t, ops)
	if len(rep.Violations) != 0 {
		t.Fatalf("valid history reported:\n%s", rep.Summary(10))
	}
	c := rep.Counts
	want := Counts{Registers: 2, Writes: 5, WritesOK: 3, WritesFailed: 1, WritesTimedOut: 1, Reads: 12, ReadsOK: 10, ReadsFailed: 1, ReadsTimedOut: 1, ReadsZeros: 2}
	if c != want {
		t.Errorf("counts %+v, want %+v", c, want)
	}
	if c.Indeterminate() != 2 {
		t.Errorf("indeterminate %d", c.Indeterminate())
	}
	if s := rep.Summary(5); !strings.Contains(s, "violations 0") || !strings.Contains(s, "indeterminate 2") {
		t.Errorf("summary: %s", s)
	}
}

// Operations that touch (one's end equals the other's start) are
// concurrent, as in porcupine: no order is implied.
func TestTouchingIntervalsAreConcurrent(t *testing.T) {
	rep := mustCheck(t, []Op{write(0, 1, 0, 10), read(0, 0, 0, 10, 11)})
	if len(rep.Violations) != 0 {
		t.Fatalf("%s", rep.Summary(5))
	}
}

func TestMalformedHistories(t *testing.T) {
	for name, ops := range map[string][]Op{
		"value twice":  {write(0, 1, 0, 1), write(1, 1, 2, 3)},
		"value 0":      {{Kind: Write, Register: 0, Value: 0, Outcome: OK}},
		"no outcome":   {{Kind: Read, Register: 0}},
		"read no data": {{Kind: Read, Register: 0, Outcome: OK}},
		"backwards":    {write(0, 1, 5, 4)},
	} {
		if _, err := Check(ops); !errors.Is(err, ErrHistory) {
			t.Errorf("%s: %v, want ErrHistory", name, err)
		}
	}
}

func TestRecorder(t *testing.T) {
	var r Recorder
	done := make(chan struct{})
	for g := range 4 {
		go func() {
			defer func() { done <- struct{}{} }()
			for i := range 100 {
				r.Add(write(g, uint64(g*1000+i+1), i, i+1))
			}
		}()
	}
	for range 4 {
		<-done
	}
	ops := r.Ops()
	if len(ops) != 400 {
		t.Fatalf("%d ops recorded, want 400", len(ops))
	}
	rep := mustCheck(t, ops)
	if rep.Counts.WritesOK != 400 || rep.Counts.Registers != 4 {
		t.Errorf("counts %+v", rep.Counts)
	}
}

// The Recorder keeps a read's bytes only when they are not one whole
// value or zeros, and Check gives the same verdicts either way.
func TestRecorderDropsWholeData(t *testing.T) {
	torn := Encode(0, 1)
	clear(torn[:512])
	ops := []Op{
		write(0, 1, 0, 10),
		read(0, 1, 0, 11, 12),
		read(0, 0, 1, 20, 21), // lost
		{Kind: Read, Register: 0, Data: torn, Start: ms(30), End: ms(31), Outcome: OK},
	}
	var r Recorder
	for _, op := range ops {
		r.Add(op)
	}
	rec := r.Ops()
	if rec[1].Data != nil || rec[2].Data != nil || rec[3].Data == nil {
		t.Errorf("data kept: %v %v %v", rec[1].Data != nil, rec[2].Data != nil, rec[3].Data != nil)
	}
	if rec[1].Content.Kind != Whole || rec[1].Content.Value != 1 || rec[2].Content.Kind != Zeros || rec[3].Content.Kind != Torn {
		t.Errorf("contents %+v %+v %+v", rec[1].Content, rec[2].Content, rec[3].Content)
	}
	wantViolations(t, mustCheck(t, rec), []ViolationKind{LostWrite, TornRead}, []int{20, 30})
	wantViolations(t, mustCheck(t, ops), []ViolationKind{LostWrite, TornRead}, []int{20, 30})
}
