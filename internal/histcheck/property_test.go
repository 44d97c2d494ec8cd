package histcheck

import (
	"bytes"
	"math"
	"slices"
	"sort"
	"testing"
	"time"

	"github.com/anishathalye/porcupine"
	"pgregory.net/rapid"
)

// TestPropertyLinearizableHistoriesPass: histories made by a register
// that applies each operation at a point inside its interval (some writes
// indeterminate, taking effect or not; some reads failed) have no
// violation.
func TestPropertyLinearizableHistoriesPass(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		ops := genLinearizable(t)
		rep, err := Check(ops)
		if err != nil {
			t.Fatal(err)
		}
		if len(rep.Violations) != 0 {
			t.Fatalf("a linearizable history is reported:\n%s", rep.Summary(5))
		}
	})
}

// genLinearizable draws a linearizable history over 1 to 3 registers.
func genLinearizable(t *rapid.T) []Op {
	regs := rapid.IntRange(1, 3).Draw(t, "registers")
	n := rapid.IntRange(1, 60).Draw(t, "ops")
	type planned struct {
		op      Op
		lin     time.Duration
		applies bool
	}
	var plan []planned
	next := uint64(1)
	for i := range n {
		start := rapid.IntRange(0, 300).Draw(t, "start")
		lin := start + rapid.IntRange(0, 40).Draw(t, "lin")
		end := lin + rapid.IntRange(0, 40).Draw(t, "end")
		// Distinct linearization points, strictly ordered as the
		// intervals are: start ≤ lin ≤ end in every case.
		p := planned{
			op: Op{Register: rapid.IntRange(0, regs-1).Draw(t, "register"), Gateway: rapid.IntRange(0, 3).Draw(t, "gateway"),
				Start: time.Duration(start * 1000), End: time.Duration(end*1000 + 999), Outcome: OK},
			lin:     time.Duration(lin*1000 + i),
			applies: true,
		}
		switch rapid.IntRange(0, 9).Draw(t, "outcome") {
		case 0:
			p.op.Outcome = Failed
		case 1:
			p.op.Outcome = TimedOut
		}
		if rapid.Bool().Draw(t, "write") {
			p.op.Kind, p.op.Value = Write, next
			next++
			if p.op.Outcome != OK {
				p.applies = rapid.Bool().Draw(t, "applies")
			}
		} else {
			p.op.Kind = Read
		}
		plan = append(plan, p)
	}
	sort.Slice(plan, func(i, j int) bool { return plan[i].lin < plan[j].lin })
	state := map[int]uint64{}
	var ops []Op
	for _, p := range plan {
		switch {
		case p.op.Kind == Write && p.applies:
			state[p.op.Register] = p.op.Value
		case p.op.Kind == Read && p.op.Outcome == OK:
			p.op.Data = make([]byte, BlockSize)
			if v := state[p.op.Register]; v != 0 {
				p.op.Data = Encode(p.op.Register, v)
			}
		}
		ops = append(ops, p.op)
	}
	return ops
}

// registerModel is the register as porcupine's sequential model.
var registerModel = porcupine.Model{
	Init: func() interface{} { return uint64(0) },
	Step: func(state, input, output interface{}) (bool, interface{}) {
		in := input.(portIn)
		if in.write {
			return true, in.value
		}
		return output.(uint64) == state.(uint64), state
	},
}

type portIn struct {
	write bool
	value uint64
}

// TestPropertyAgreesWithPorcupine: on small random histories of one
// register (any read values, indeterminate writes, failed reads), Check
// finds a violation exactly when porcupine finds the history not
// linearizable.
func TestPropertyAgreesWithPorcupine(t *testing.T) {
	verdicts := map[bool]int{}
	rapid.Check(t, func(t *rapid.T) {
		n := rapid.IntRange(1, 9).Draw(t, "ops")
		var ops []Op
		var pops []porcupine.Operation
		writes := uint64(0)
		for i := range n {
			start := time.Duration(rapid.IntRange(0, 20).Draw(t, "start"))
			op := Op{Start: start, End: start + time.Duration(rapid.IntRange(0, 8).Draw(t, "len")), Outcome: OK, Client: i, Gateway: i % 2}
			if rapid.IntRange(0, 4).Draw(t, "outcome") == 0 {
				op.Outcome = rapid.SampledFrom([]Outcome{Failed, TimedOut}).Draw(t, "bad")
			}
			if rapid.Bool().Draw(t, "write") {
				writes++
				op.Kind, op.Value = Write, writes
				ret := int64(op.End)
				if op.Outcome != OK {
					ret = math.MaxInt64
				}
				pops = append(pops, porcupine.Operation{ClientId: i, Input: portIn{true, op.Value}, Call: int64(op.Start), Return: ret})
			} else {
				op.Kind = Read
				// Any value up to 6: some never written, some written
				// later in the history.
				v := uint64(rapid.IntRange(0, 6).Draw(t, "value"))
				op.Data = make([]byte, BlockSize)
				if v != 0 {
					op.Data = Encode(0, v)
				}
				if op.Outcome == OK {
					pops = append(pops, porcupine.Operation{ClientId: i, Input: portIn{}, Call: int64(op.Start), Output: v, Return: int64(op.End)})
				} else {
					op.Data = nil
				}
			}
			ops = append(ops, op)
		}
		rep, err := Check(ops)
		if err != nil {
			t.Fatal(err)
		}
		linearizable := porcupine.CheckOperations(registerModel, pops)
		verdicts[linearizable]++
		if linearizable != (len(rep.Violations) == 0) {
			t.Fatalf("porcupine says linearizable=%v; Check:\n%s\nhistory:\n%s", linearizable, rep.Summary(10), dump(ops))
		}
	})
	// Both verdicts must come up, or the comparison shows nothing.
	if verdicts[true] < 10 || verdicts[false] < 10 {
		t.Errorf("verdicts %v: the generator makes too few histories of one kind", verdicts)
	}
}

func dump(ops []Op) string {
	var b bytes.Buffer
	for _, op := range ops {
		if op.Kind == Read && op.Outcome == OK {
			op.Value = Decode(op.Register, op.Data).Value
		}
		b.WriteString(op.String() + "\n")
	}
	return b.String()
}

// TestPropertyDecode: a value decodes as itself, any changed byte makes
// garbage, and sectors of two values make a torn block naming both.
func TestPropertyDecode(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		reg := rapid.IntRange(0, 1<<20).Draw(t, "register")
		v := rapid.Uint64Range(1, 1<<62).Draw(t, "value")
		b := Encode(reg, v)
		if c := Decode(reg, b); c.Kind != Whole || c.Value != v {
			t.Fatalf("Encode(%d, %d) decodes as %+v", reg, v, c)
		}
		if c := Decode(reg+1, b); c.Kind != Foreign {
			t.Fatalf("another register's block decodes as %+v", c)
		}
		i := rapid.IntRange(0, BlockSize-1).Draw(t, "byte")
		flipped := slices.Clone(b)
		flipped[i] ^= byte(rapid.IntRange(1, 255).Draw(t, "xor"))
		if c := Decode(reg, flipped); c.Kind != Garbage {
			t.Fatalf("byte %d changed: decodes as %+v", i, c)
		}
		u := v + 1 + rapid.Uint64Range(0, 1000).Draw(t, "other")
		mixed := slices.Clone(b)
		s := rapid.IntRange(0, sectors-1).Draw(t, "sector")
		copy(mixed[s*SectorSize:(s+1)*SectorSize], Encode(reg, u)[s*SectorSize:])
		c := Decode(reg, mixed)
		if c.Kind != Torn || c.Sectors[s] != u || !slices.Contains(c.Sectors, v) {
			t.Fatalf("sector %d of value %d in value %d: decodes as %+v", s, u, v, c)
		}
	})
}

func TestDecodeZeros(t *testing.T) {
	if c := Decode(0, make([]byte, BlockSize)); c.Kind != Zeros || c.Value != 0 {
		t.Errorf("zeros decode as %+v", c)
	}
	if c := Decode(0, make([]byte, 512)); c.Kind != Garbage {
		t.Errorf("a short block decodes as %+v", c)
	}
}
