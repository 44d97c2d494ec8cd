package store

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ovis-storage/ovis/cluster/object"
)

// The crash test runs random operations in a child process (this test
// binary, re-executed), kills it with SIGKILL at a random moment, reopens
// the store and checks every object against a model replayed from the
// child's log of what it began and what was acknowledged.
//
// SIGKILL keeps the page cache, so this checks the journal protocol
// (what is suspect, what is not, versions, tokens, torn journal tails),
// not the device's write-back order; see docs/store.md.

const (
	crashEnvDir      = "OVIS_STORE_CRASH_DIR"
	crashEnvSeed     = "OVIS_STORE_CRASH_SEED"
	crashEnvParallel = "OVIS_STORE_CRASH_PARALLEL"
	crashEnvBreak    = "OVIS_STORE_CRASH_BREAK_JOURNAL"
	crashEnvOps      = "OVIS_STORE_CRASH_OPS" // stop after this many operations
	crashSpan        = 1 << 20                // objects are written within their first MiB
)

// crashOp is one operation of the child, as logged: a "begin" line
// before the call and an "ack" line after it returned.
type crashOp struct {
	kind    string // write, zero, remove, flush, put, fence
	id      object.ID
	vdi     object.VDI
	off, n  int64
	sync    bool
	alloc   bool
	seed    uint64 // data of write and put
	token   uint64
	version uint64 // put
	epoch   uint64 // the Stamp's epoch of write, zero and remove
}

func (op crashOp) String() string {
	return fmt.Sprintf("%s %d %d %d %d %t %t %d %d %d %d", op.kind, uint64(op.id), op.vdi, op.off, op.n, op.sync, op.alloc, op.seed, op.token, op.version, op.epoch)
}

func parseCrashOp(s string) (crashOp, error) {
	f := strings.Fields(s)
	if len(f) != 11 {
		return crashOp{}, fmt.Errorf("op %q", s)
	}
	u := func(i int) uint64 { v, _ := strconv.ParseUint(f[i], 10, 64); return v }
	return crashOp{
		kind: f[0], id: object.ID(u(1)), vdi: object.VDI(u(2)), off: int64(u(3)), n: int64(u(4)),
		sync: f[5] == "true", alloc: f[6] == "true", seed: u(7), token: u(8), version: u(9), epoch: u(10),
	}, nil
}

func crashData(seed uint64, n int64) []byte {
	r := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(r.Uint32())
	}
	return b
}

// crashChild runs operations until it is killed: in one worker over
// VDIs 1 and 2 (log "log"), or with parallel set, in one worker per VDI
// at once (logs "log-1" and "log-2"; no Flush(0), which would reach
// across the workers' logs).
func crashChild(dir string, seed uint64, parallel bool) error {
	s, err := Open(filepath.Join(dir, "store"), Options{MaxOpenFiles: 4})
	if err != nil {
		return err
	}
	if !parallel {
		return crashWorker(s, filepath.Join(dir, "log"), seed, []object.VDI{1, 2}, true)
	}
	errc := make(chan error, 2)
	for _, v := range []object.VDI{1, 2} {
		go func() {
			errc <- crashWorker(s, filepath.Join(dir, fmt.Sprintf("log-%d", v)), seed+uint64(v), []object.VDI{v}, false)
		}()
	}
	return <-errc // the first to fail; the kill ends the rest
}

func crashWorker(s *Store, logPath string, seed uint64, vdis []object.VDI, flushAll bool) error {
	logf, err := os.OpenFile(logPath, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o644)
	if err != nil {
		return err
	}
	r := rand.New(rand.NewPCG(seed, 1))
	tokens := map[object.VDI]uint64{1: 1, 2: 1}
	epoch := uint64(1)
	limit, _ := strconv.Atoi(os.Getenv(crashEnvOps))
	for i := 0; ; i++ {
		if limit > 0 && i == limit {
			return nil
		}
		vdi := vdis[r.IntN(len(vdis))]
		op := crashOp{vdi: vdi, id: object.Make(vdi, uint32(r.IntN(4))), token: tokens[vdi], seed: r.Uint64(), epoch: epoch}
		switch r.IntN(20) { // a new epoch, or a request of the one before
		case 0:
			epoch++
			op.epoch = epoch
		case 1:
			op.epoch--
		}
		op.off = r.Int64N(crashSpan)
		op.n = min(r.Int64N(64<<10), crashSpan-op.off)
		switch k := r.IntN(100); {
		case k < 35:
			op.kind = "write"
		case k < 60:
			op.kind, op.sync = "write", true
		case k < 72:
			op.kind, op.sync, op.alloc = "zero", r.IntN(2) == 0, r.IntN(2) == 0
		case k < 77:
			op.kind = "remove"
		case k < 90:
			op.kind = "flush"
			if flushAll && r.IntN(3) == 0 {
				op.vdi = 0
			}
		case k < 95:
			// Around the current epoch, so that some Puts are not newer.
			op.kind, op.version, op.n = "put", Version(epoch+r.Uint64N(3)-1, uint32(r.IntN(8))), r.Int64N(crashSpan)
		default:
			op.kind = "fence"
			op.token++
			tokens[vdi] = op.token
		}
		fmt.Fprintf(logf, "begin %s\n", op)
		st := Stamp{Token: op.token, Epoch: op.epoch}
		switch op.kind {
		case "write":
			_, err = s.WriteAt(op.id, st, crashData(op.seed, op.n), op.off, op.sync)
		case "zero":
			_, err = s.WriteZeroes(op.id, st, op.off, op.n, op.alloc, op.sync)
		case "remove":
			err = s.Remove(op.id, st)
		case "flush":
			err = s.Flush(op.vdi)
		case "put":
			err = s.Put(op.id, op.version, crashData(op.seed, op.n))
		case "fence":
			err = s.Fence(op.vdi, op.token)
		}
		if op.kind == "put" && errors.Is(err, ErrNotNewer) {
			fmt.Fprintf(logf, "notnewer\n") // the parent's model must agree
			continue
		}
		if err != nil {
			return fmt.Errorf("op %d %s: %w", i, op, err)
		}
		fmt.Fprintf(logf, "ack\n")
	}
}

func TestCrashChild(t *testing.T) {
	dir := os.Getenv(crashEnvDir)
	if dir == "" {
		t.Skip("run by TestCrash")
	}
	seed, _ := strconv.ParseUint(os.Getenv(crashEnvSeed), 10, 64)
	testBreakJournal = os.Getenv(crashEnvBreak) != ""
	if err := crashChild(dir, seed, os.Getenv(crashEnvParallel) != ""); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(3)
	}
}

// crashObj is the model of one object for the crash check.
type crashObj struct {
	m       mobj // m.version survives a Remove, in the tombstone
	exists  bool // live data
	tomb    bool // removed: a tombstone at m.version
	dirty   bool // an acknowledged unsynced mutation no Flush covered
	touched bool // journaled: mutated since the last Flush, Remove or Put
}

type crashModel struct {
	objs   map[object.ID]*crashObj
	tokens map[object.VDI]uint64
}

func (cm *crashModel) obj(id object.ID) *crashObj {
	o := cm.objs[id]
	if o == nil {
		o = &crashObj{m: mobj{pages: map[int64][]byte{}}}
		cm.objs[id] = o
	}
	return o
}

func (cm *crashModel) clone() *crashModel {
	c := &crashModel{objs: map[object.ID]*crashObj{}, tokens: map[object.VDI]uint64{}}
	for id, o := range cm.objs {
		n := *o
		n.m.pages = map[int64][]byte{}
		for i, pg := range o.m.pages {
			n.m.pages[i] = bytes.Clone(pg)
		}
		c.objs[id] = &n
	}
	for v, t := range cm.tokens {
		c.tokens[v] = t
	}
	return c
}

// putApplies says whether the model's copy of op.id is older than a Put
// of op.version (no copy in the child's session is ever suspect).
func (cm *crashModel) putApplies(op crashOp) bool {
	o := cm.objs[op.id]
	return o == nil || (!o.exists && !o.tomb) || o.m.version < op.version
}

func (cm *crashModel) apply(op crashOp) {
	if op.token > cm.tokens[op.vdi] && op.kind != "flush" && op.kind != "put" {
		cm.tokens[op.vdi] = op.token
	}
	switch op.kind {
	case "write", "zero":
		o := cm.obj(op.id)
		if !o.exists {
			o.m = mobj{version: o.m.version, pages: map[int64][]byte{}} // a tombstone's version goes on
		}
		o.exists, o.tomb = true, false
		data := make([]byte, op.n)
		if op.kind == "write" {
			data = crashData(op.seed, op.n)
		}
		o.m.version = modelNext(o.m.version, op.epoch)
		mm := model{objs: map[object.ID]*mobj{op.id: &o.m}}
		mm.write(op.id, data, op.off)
		o.touched = true
		if !op.sync {
			o.dirty = true
		}
	case "remove":
		o := cm.obj(op.id)
		*o = crashObj{m: mobj{version: modelNext(o.m.version, op.epoch), pages: map[int64][]byte{}}, tomb: true}
	case "put":
		if !cm.putApplies(op) {
			return
		}
		o := cm.obj(op.id)
		*o = crashObj{m: mobj{pages: map[int64][]byte{}}, exists: true}
		mm := model{objs: map[object.ID]*mobj{op.id: &o.m}}
		mm.write(op.id, crashData(op.seed, op.n), 0)
		o.m.version = op.version
	case "flush":
		for id, o := range cm.objs {
			if op.vdi == 0 || id.VDI() == op.vdi {
				o.dirty, o.touched = false, false
			}
		}
	}
}

func TestCrash(t *testing.T) {
	rounds := 6
	if testing.Short() {
		rounds = 2
	}
	if n, err := strconv.Atoi(os.Getenv("OVIS_STORE_CRASH_ROUNDS")); err == nil {
		rounds = n
	}
	runCrash(t, rounds, false, t.Errorf)
}

// The harness proves itself: with the dirty record skipped on purpose,
// it must report objects with unflushed writes that are not suspect.
func TestCrashHarnessCatchesBrokenJournal(t *testing.T) {
	var found []string
	for range 4 {
		runCrash(t, 2, true, func(format string, args ...any) {
			found = append(found, fmt.Sprintf(format, args...))
		})
		if len(found) > 0 {
			t.Logf("caught: %s", found[0])
			return
		}
	}
	t.Fatal("the crash harness did not notice writes made without a dirty record")
}

func runCrash(t *testing.T, rounds int, breakJournal bool, errorf func(string, ...any)) {
	bin, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	var suspects, clean, inflight, tombs int
	for round := range rounds {
		dir := t.TempDir()
		seed := uint64(time.Now().UnixNano()) + uint64(round)
		cmd := exec.CommandContext(ctx, bin, "-test.run=^TestCrashChild$")
		parallel := round%2 == 1
		cmd.Env = append(os.Environ(), crashEnvDir+"="+dir, crashEnvSeed+"="+strconv.FormatUint(seed, 10))
		if parallel {
			cmd.Env = append(cmd.Env, crashEnvParallel+"=1")
		}
		if breakJournal {
			cmd.Env = append(cmd.Env, crashEnvBreak+"=1")
		}
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		logs := []string{"log"}
		if parallel {
			logs = []string{"log-1", "log-2"}
		}
		// The kill's moment counts from the first acknowledged operation
		// of every worker, so that a slow start on a loaded machine does
		// not leave a worker with no log at all.
		for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
			acked := 0
			for _, l := range logs {
				if b, err := os.ReadFile(filepath.Join(dir, l)); err == nil && bytes.Contains(b, []byte("\nack\n")) {
					acked++
				}
			}
			if acked == len(logs) {
				break
			}
		}
		time.Sleep(time.Duration(200+rand.IntN(600)) * time.Millisecond)
		cmd.Process.Signal(syscall.SIGKILL)
		err := cmd.Wait()
		var ee *exec.ExitError
		if !errors.As(err, &ee) || ee.ExitCode() != -1 {
			t.Fatalf("round %d (seed %d): child did not die of SIGKILL: %v\n%s", round, seed, err, stderr.String())
		}
		st, err := Open(filepath.Join(dir, "store"), Options{})
		if err != nil {
			t.Fatalf("seed %d: reopen: %v", seed, err)
		}
		for _, l := range logs {
			s, c, i, tb := checkCrash(t, st, filepath.Join(dir, l), seed, errorf)
			suspects += s
			inflight += i
			clean += c
			tombs += tb
		}
		if err := st.Close(); err != nil {
			t.Fatal(err)
		}
	}
	t.Logf("%d rounds: %d objects suspect, %d checked exactly (%d of them tombstones), %d in flight at the kill", rounds, suspects, clean, tombs, inflight)
}

// checkCrash replays the child's log and checks the reopened store.
func checkCrash(t *testing.T, s *Store, logPath string, seed uint64, errorf func(string, ...any)) (suspects, exact, inflight, tombs int) {
	t.Helper()
	f, err := os.Open(logPath)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	// A token counts once a call carrying it was acknowledged: a Flush of
	// a VDI, acknowledged before any write to it, raised none.
	cm := &crashModel{objs: map[object.ID]*crashObj{}, tokens: map[object.VDI]uint64{}}
	var pending *crashOp
	seen := map[object.VDI]bool{}
	ops := 0
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := sc.Text()
		switch {
		case strings.HasPrefix(line, "begin "):
			op, err := parseCrashOp(strings.TrimPrefix(line, "begin "))
			if err != nil {
				t.Fatal(err)
			}
			pending = &op
			seen[op.id.VDI()] = true
		case line == "ack" || line == "notnewer":
			if pending.kind == "put" && cm.putApplies(*pending) != (line == "ack") {
				errorf("seed %d: %s answered %s, but the copy held was at v%d", seed, pending, line, cm.obj(pending.id).m.version)
			}
			cm.apply(*pending)
			pending = nil
			ops++
		default: // a line torn by the kill
		}
	}
	after := cm
	if pending != nil {
		after = cm.clone()
		after.apply(*pending)
	}
	for v, tok := range cm.tokens {
		if !seen[v] { // another worker's VDI
			continue
		}
		if got := s.Token(v); got < tok || got > after.tokens[v] {
			errorf("seed %d: vdi %d token %d, acknowledged %d", seed, v, got, tok)
		}
	}
	for id := range after.objs {
		o := cm.objs[id]
		if o == nil {
			o = &crashObj{}
		}
		inFlight := pending != nil && pending.id == id && pending.kind != "flush" && pending.kind != "fence"
		// A Flush in flight changes no content, only what may be suspect.
		flushing := pending != nil && pending.kind == "flush" && (pending.vdi == 0 || pending.vdi == id.VDI())
		info, err := s.Stat(id)
		if errors.Is(err, ErrNotFound) {
			info = Info{ID: id}
		} else if err != nil {
			t.Fatalf("seed %d: stat %s: %v", seed, id, err)
		}
		if info.Suspect {
			suspects++
			if !o.touched && !(inFlight && after.objs[id].touched) {
				errorf("seed %d: object %s suspect, but every write to it was flushed (in flight: %v)", seed, id, inFlight)
			}
			continue
		}
		if o.dirty && !inFlight && !flushing {
			errorf("seed %d: object %s has unflushed writes but is not suspect", seed, id)
			continue
		}
		if inFlight {
			inflight++
			if !matches(s, id, o) && !matches(s, id, after.objs[id]) {
				errorf("seed %d: object %s matches neither the state before nor after the op in flight, %s", seed, id, pending)
			}
			continue
		}
		exact++
		if o.tomb {
			// An acknowledged Remove: a tombstone at least as new as
			// the removed copy, never the old data.
			tombs++
			if !info.Tombstone || info.Version < o.m.version {
				errorf("seed %d: object %s was removed at v%d, but the copy is %+v", seed, id, o.m.version, info)
				continue
			}
		}
		if !matches(s, id, o) {
			errorf("seed %d: object %s: content or version differs from the acknowledged state (%+v, want v%d, exists %v, tombstone %v)", seed, id, info, o.m.version, o.exists, o.tomb)
		}
	}
	if ops == 0 {
		errorf("seed %d: the child acknowledged no operation", seed)
	}
	t.Logf("seed %d: %d operations acknowledged, then %v in flight", seed, ops, pending)
	return suspects, exact, inflight, tombs
}

func matches(s *Store, id object.ID, o *crashObj) bool {
	return matchesSpan(s, id, o, crashSpan)
}

// matchesSpan is matches over the first span bytes of the object.
func matchesSpan(s *Store, id object.ID, o *crashObj, span int64) bool {
	if o == nil {
		o = &crashObj{}
	}
	info, err := s.Stat(id)
	switch {
	case o.tomb:
		if err != nil || !info.Tombstone || info.Version != o.m.version {
			return false
		}
	case !o.exists:
		if !errors.Is(err, ErrNotFound) {
			return false
		}
	case err != nil || info.Tombstone:
		return false
	}
	p := make([]byte, span)
	v, err := s.ReadAt(id, p, 0)
	if !o.exists {
		return errors.Is(err, ErrNotFound)
	}
	if err != nil || v != o.m.version {
		return false
	}
	want := make([]byte, span)
	o.m.read(want, 0)
	return bytes.Equal(p, want)
}
