package store

import (
	"errors"
	"fmt"
	"path/filepath"
	"strconv"
	"testing"

	"golang.org/x/sys/unix"
	"pgregory.net/rapid"

	"github.com/ovis-storage/ovis/cluster/object"
	"github.com/ovis-storage/ovis/cluster/store/vfs/errorfs"
)

// TestFaultModel runs random operations, some with a fault armed under
// them (a failed or lost fdatasync, ENOSPC, a torn write, a crash), and
// reopens the store now and then as a crash would leave it. It checks
// against the crash test's model (crashModel) that a copy the store
// serves as good holds exactly what was acknowledged: an acknowledged
// write or Flush is readable after every reopen, or its copy is suspect.
// After a failed call, each copy is suspect or holds the state before
// or after the call, never a mix.
func TestFaultModel(t *testing.T) {
	var total faultCounts
	defer func() {
		t.Logf("%d operations acknowledged, %d failed over %d faults injected, %d reopens, %d copies found suspect",
			total.acked, total.failed, total.faults, total.reopens, total.suspects)
	}()
	rapid.Check(t, func(t *rapid.T) {
		dir, err := osMkdirTemp()
		if err != nil {
			t.Fatal(err)
		}
		defer osRemoveAll(dir)
		fm := &faultModel{
			dir: dir, total: &total, epoch: 1,
			cm:      &crashModel{objs: map[object.ID]*crashObj{}, tokens: map[object.VDI]uint64{}},
			suspect: map[object.ID]uint64{}, lost: map[object.ID]bool{},
			tokens: map[object.VDI]uint64{1: 1, 2: 1},
		}
		fm.open(t)
		defer func() { fm.s.Close() }()
		t.Repeat(map[string]func(*rapid.T){
			"op":  fm.step,
			"op2": fm.step,
			"reopen": func(t *rapid.T) {
				if rapid.IntRange(0, 3).Draw(t, "reopen") == 0 {
					fm.reopen(t, rapid.Bool().Draw(t, "crash"), 0, nil)
				}
			},
			"read": func(t *rapid.T) {
				id := faultID(t)
				fm.check(t, id, nil, "read")
			},
		})
		fm.reopen(t, true, 0, nil)
	})
}

// faultSpan covers every byte the operations write: page 16, skewed,
// plus 12 KiB.
const faultSpan = 96 << 10

// faultModel is the state of one run.
type faultModel struct {
	dir     string
	fs      *errorfs.FS
	s       *Store
	cm      *crashModel
	suspect map[object.ID]uint64 // copies the store said were suspect: their version
	// lost holds the objects with acknowledged unflushed writes an
	// fdatasync failed on: no Flush of their VDI may succeed until the
	// copy is replaced.
	lost   map[object.ID]bool
	tokens map[object.VDI]uint64
	epoch  uint64
	seeds  uint64 // errorfs seeds used, one per open
	total  *faultCounts
}

type faultCounts struct{ acked, failed, faults, reopens, suspects int }

func faultID(t *rapid.T) object.ID {
	return object.Make(object.VDI(rapid.IntRange(1, 2).Draw(t, "vdi")), uint32(rapid.IntRange(0, 2).Draw(t, "index")))
}

func (fm *faultModel) ids() []object.ID {
	var ids []object.ID
	for v := object.VDI(1); v <= 2; v++ {
		for i := range 3 {
			ids = append(ids, object.Make(v, uint32(i)))
		}
	}
	return ids
}

func (fm *faultModel) open(t *rapid.T) {
	fm.seeds++
	fm.fs = errorfs.New(nil, fm.seeds)
	s, err := Open(fm.dir, Options{FS: fm.fs, MaxOpenFiles: 2})
	if err != nil {
		t.Fatalf("open: %v", err)
	}
	fm.s = s
}

// reopen closes the store, or with crash kills it (the page cache
// survives, nothing more reaches the files), opens it again and checks
// every copy. A call the crash cut short may have left its object
// (inflight) as other says.
func (fm *faultModel) reopen(t *rapid.T, crash bool, inflight object.ID, other *crashObj) {
	if crash {
		fm.fs.Crash()
	}
	fm.fs.Clear()
	broken := fm.s.Err() != nil
	t.Logf("reopen, crash %v, journal failed %v", crash, broken)
	fm.s.Close() // fails after a crash, or when a fault made a Flush fail
	fm.total.reopens++
	fm.open(t)
	clear(fm.lost) // the process that acknowledged the writes is gone
	for _, o := range fm.cm.objs {
		o.dirty = false // dirty copies are suspect now, or hold their writes
	}
	for _, id := range fm.ids() {
		info, err := fm.s.Stat(id)
		if err == nil && info.Suspect {
			fm.suspect[id] = info.Version
			fm.total.suspects++
			continue
		}
		_, was := fm.suspect[id]
		switch {
		case id == inflight && other != nil && matchesSpan(fm.s, id, other, faultSpan):
			fm.cm.objs[id] = other
		case was && broken:
			// Its suspect record never reached the failed journal: the
			// file holds the state a failed call left whole (a Put's,
			// renamed in place). The model takes it as it is.
			fm.cm.objs[id] = adopt(t, fm.s, id)
		case !matchesSpan(fm.s, id, fm.cm.objs[id], faultSpan):
			t.Fatalf("after a reopen (crash %v), object %s (suspect before: %v) is served but does not hold what was acknowledged: %+v, %v", crash, id, was, info, err)
		}
		delete(fm.suspect, id)
	}
}

// check compares id's copy with the model: suspect, or as acknowledged,
// or (other not nil, after a failed call) as other says. It returns the
// state matched: the model's, other, or nil for suspect.
func (fm *faultModel) check(t *rapid.T, id object.ID, other *crashObj, after string) *crashObj {
	info, err := fm.s.Stat(id)
	if err == nil && info.Suspect {
		fm.suspect[id] = info.Version
		if _, err := fm.s.ReadAt(id, make([]byte, 1), 0); !errors.Is(err, ErrSuspect) {
			t.Fatalf("read of suspect %s: %v", id, err)
		}
		return nil
	}
	// A suspect copy comes back only as the failed call's after state (a
	// Remove or Put whose journal record failed, its file in place).
	_, was := fm.suspect[id]
	if !was && matchesSpan(fm.s, id, fm.cm.objs[id], faultSpan) {
		return fm.cm.objs[id]
	}
	if other != nil && matchesSpan(fm.s, id, other, faultSpan) {
		return other
	}
	t.Fatalf("after %s, object %s (suspect before: %v) is served but holds neither the state before nor after: %+v, %v", after, id, was, info, err)
	return nil
}

// faultRule draws the fault, if any, armed under the next operation.
func faultRule(t *rapid.T) *errorfs.Rule {
	r := &errorfs.Rule{Times: 1, After: rapid.IntRange(0, 3).Draw(t, "after")}
	switch rapid.IntRange(0, 11).Draw(t, "fault") {
	case 0: // an fdatasync fails, and loses the writes it was to make durable
		r.Kinds = []errorfs.Kind{errorfs.Sync}
		r.Lose = rapid.Bool().Draw(t, "lose")
	case 1: // a pwrite fails, or tears, out of space or with EIO
		r.Kinds = []errorfs.Kind{errorfs.Write}
		r.Tear = rapid.Bool().Draw(t, "tear")
		r.Err = rapid.SampledFrom([]error{unix.EIO, unix.ENOSPC}).Draw(t, "errno")
	case 2: // a pwrite tears and the process dies
		r.Kinds = []errorfs.Kind{errorfs.Write}
		r.Tear, r.Crash = true, true
	case 3: // anything else the store does to a file
		r.Kinds = []errorfs.Kind{rapid.SampledFrom([]errorfs.Kind{
			errorfs.Open, errorfs.Read, errorfs.Allocate, errorfs.Truncate, errorfs.Stat, errorfs.Rename, errorfs.Mkdir, errorfs.Remove,
		}).Draw(t, "kind")}
		r.Err = rapid.SampledFrom([]error{unix.EIO, unix.ENOSPC}).Draw(t, "errno")
	default:
		return nil
	}
	if rapid.IntRange(0, 3).Draw(t, "journal") == 0 {
		r.Path = errorfs.Contains("/journal")
	}
	return r
}

// step runs one random operation, maybe over a fault.
func (fm *faultModel) step(t *rapid.T) {
	id := faultID(t)
	vdi := id.VDI()
	op := crashOp{vdi: vdi, id: id, token: fm.tokens[vdi], seed: rapid.Uint64().Draw(t, "seed"), epoch: fm.epoch}
	if rapid.IntRange(0, 9).Draw(t, "newepoch") == 0 {
		fm.epoch++
		op.epoch = fm.epoch
	}
	op.off = int64(rapid.IntRange(0, 16).Draw(t, "page"))*4096 + int64(rapid.IntRange(0, 2).Draw(t, "skew"))*700
	op.n = int64(rapid.IntRange(0, 3*4096).Draw(t, "n"))
	switch k := rapid.IntRange(0, 99).Draw(t, "kind"); {
	case k < 30:
		op.kind = "write"
	case k < 55:
		op.kind, op.sync = "write", true
	case k < 65:
		op.kind, op.sync, op.alloc = "zero", rapid.Bool().Draw(t, "zsync"), rapid.Bool().Draw(t, "alloc")
	case k < 72:
		op.kind = "remove"
	case k < 87:
		op.kind = "flush"
		if rapid.IntRange(0, 2).Draw(t, "all") == 0 {
			op.vdi = 0
		}
	case k < 95:
		op.kind, op.version, op.n = "put", Version(fm.epoch+uint64(rapid.IntRange(0, 2).Draw(t, "vepoch")), 1), int64(rapid.IntRange(0, 5*4096).Draw(t, "putn"))
	default:
		op.kind = "fence"
		op.token++
		fm.tokens[vdi] = op.token
	}
	rule := faultRule(t)
	if rule != nil {
		fm.fs.Add(rule)
	}
	err := fm.do(op)
	fm.fs.Clear()
	t.Logf("%s (fault %+v): %v; injected %v", op, rule, err, fm.fs.Events())
	_, suspect := fm.suspect[id]
	putApplies := op.kind == "put" && (suspect || fm.cm.putApplies(op))
	if fm.fs.Crashed() {
		if err == nil {
			t.Fatalf("%s acknowledged though the process died in it", op)
		}
		fm.total.faults++
		after := fm.cm.clone()
		fm.apply(after, op, putApplies)
		fm.reopen(t, true, id, after.objs[id])
		return
	}
	fired := len(fm.fs.Events()) > 0
	if fired {
		fm.total.faults++
	}
	for _, ev := range fm.fs.Events() {
		if o := fm.cm.objs[objOf(ev.Op.Path)]; ev.Op.Kind == errorfs.Sync && o != nil && o.dirty {
			fm.lost[objOf(ev.Op.Path)] = true
		}
	}
	switch {
	case err == nil && op.kind == "flush":
		for lid := range fm.lost {
			if op.vdi == 0 || lid.VDI() == op.vdi {
				t.Fatalf("%s acknowledged, but an fdatasync of %s failed since its last acknowledged write", op, lid)
			}
		}
	case err == nil && (op.kind == "remove" || putApplies):
		delete(fm.lost, id)
	}
	switch {
	case err == nil:
		fm.total.acked++
		if suspect && (op.kind == "write" || op.kind == "zero") {
			t.Fatalf("%s acknowledged on suspect %s", op, id)
		}
		if op.kind == "put" && !putApplies {
			t.Fatalf("%s acknowledged over a newer copy", op)
		}
		fm.apply(fm.cm, op, putApplies)
		if op.kind == "remove" || putApplies {
			delete(fm.suspect, id)
		}
	case op.kind == "put" && !putApplies && errors.Is(err, ErrNotNewer):
	case suspect && (op.kind == "write" || op.kind == "zero") && errors.Is(err, ErrSuspect):
	case !fired && fm.s.Err() == nil && !errors.Is(err, ErrSuspect):
		t.Fatalf("%s failed with no fault injected: %v", op, err)
	default:
		// Failed: each copy is suspect, or as before, or (the call's
		// own) as after it.
		fm.total.failed++
		after := fm.cm.clone()
		fm.apply(after, op, putApplies)
		for _, o := range fm.ids() {
			var other *crashObj
			if o == id && op.kind != "flush" && op.kind != "fence" {
				other = after.objs[id]
			}
			got := fm.check(t, o, other, fmt.Sprintf("%s failed with %v", op, err))
			if got != nil && got == other {
				fm.cm.objs[id] = other
				delete(fm.suspect, id)
			}
		}
	}
}

// apply applies op to cm; a Put over a suspect copy applies whatever
// its version.
func (fm *faultModel) apply(cm *crashModel, op crashOp, putApplies bool) {
	ver, suspect := fm.suspect[op.id]
	switch {
	case op.kind == "put" && !putApplies:
		return
	case op.kind == "put":
		delete(cm.objs, op.id)
	case op.kind == "remove" && suspect:
		cm.obj(op.id).m.version = ver // the version the store holds goes on
	}
	cm.apply(op)
	if o := cm.objs[op.id]; o != nil && op.sync && op.kind != "flush" {
		o.dirty = false // its fdatasync covered the writes before it
	}
}

func (fm *faultModel) do(op crashOp) error {
	st := Stamp{Token: op.token, Epoch: op.epoch}
	var err error
	switch op.kind {
	case "write":
		_, err = fm.s.WriteAt(op.id, st, crashData(op.seed, op.n), op.off, op.sync)
	case "zero":
		_, err = fm.s.WriteZeroes(op.id, st, op.off, op.n, op.alloc, op.sync)
	case "remove":
		err = fm.s.Remove(op.id, st)
	case "flush":
		err = fm.s.Flush(op.vdi)
	case "put":
		err = fm.s.Put(op.id, op.version, crashData(op.seed, op.n))
	case "fence":
		err = fm.s.Fence(op.vdi, op.token)
	}
	return err
}

// objOf returns the object whose file is at path, 0 for another file.
func objOf(path string) object.ID {
	idx, err1 := strconv.ParseUint(filepath.Base(path), 16, 32)
	vdi, err2 := strconv.ParseUint(filepath.Base(filepath.Dir(path)), 16, 32)
	if err1 != nil || err2 != nil || filepath.Base(filepath.Dir(filepath.Dir(path))) != "objects" {
		return 0
	}
	return object.Make(object.VDI(vdi), uint32(idx))
}

// adopt returns id's copy as the model would hold it.
func adopt(t *rapid.T, s *Store, id object.ID) *crashObj {
	o := &crashObj{m: mobj{pages: map[int64][]byte{}}}
	info, err := s.Stat(id)
	if errors.Is(err, ErrNotFound) {
		return o
	}
	if err != nil {
		t.Fatalf("stat %s: %v", id, err)
	}
	o.m.version = info.Version
	if info.Tombstone {
		o.tomb = true
		return o
	}
	o.exists = true
	p := make([]byte, faultSpan)
	if _, err := s.ReadAt(id, p, 0); err != nil {
		t.Fatalf("read %s: %v", id, err)
	}
	mm := model{objs: map[object.ID]*mobj{id: &o.m}}
	mm.write(id, p, 0)
	return o
}
