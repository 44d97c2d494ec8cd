package store

import (
	"bufio"
	"encoding/hex"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/ovis-storage/ovis/cluster/object"
)

// TestSyscallOrder checks the durability protocol's ordering where a
// SIGKILL cannot: it runs the crash child under strace and checks, on
// the system calls it made, that
//
//  1. no object file is written (pwrite, fallocate) unless a DIRTY (or
//     SUSPECT) record for it was made durable by a journal fdatasync
//     that ended before the write began;
//  2. no CLEAN record for an object is written unless, after its last
//     write ended, an fdatasync of its file began and ended, or the file
//     was unlinked or renamed over;
//  3. no CLEAN record for an object is written unless, after its file
//     was created (open with O_CREAT, or renamed into place), an fsync of
//     its directory began and ended, or the file was unlinked;
//  4. no file of dir/tmp is renamed over an object (Put, Remove's
//     tombstone) unless an fdatasync of it began after its last write
//     (pwrite, ftruncate) and ended before the rename.
//
// These are the orderings a power loss would punish.
func TestSyscallOrder(t *testing.T) {
	strace, err := exec.LookPath("strace")
	if err != nil {
		t.Fatal("strace is not installed; run scripts/test.sh, which installs it")
	}
	bin, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	trace := filepath.Join(dir, "trace")
	if d := os.Getenv("OVIS_STORE_TRACE_DIR"); d != "" { // check a trace kept from an earlier run
		dir, trace = d, filepath.Join(d, "trace")
	}
	cmd := exec.CommandContext(ctx, strace, "-f", "-qq", "-y", "-xx", "-s", "8192", "-o", trace,
		"-e", "trace=openat,pwrite64,fallocate,ftruncate,truncate,fdatasync,fsync,rename,renameat,unlink,unlinkat",
		bin, "-test.run=^TestCrashChild$")
	ops := "250"
	if raceEnabled {
		ops = "40"
	}
	cmd.Env = append(os.Environ(), crashEnvDir+"="+dir, crashEnvSeed+"=7", crashEnvOps+"="+ops)
	if os.Getenv("OVIS_STORE_TRACE_DIR") == "" {
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("child under strace: %v\n%s", err, out)
		}
	}
	calls, err := parseTrace(trace)
	if err != nil {
		t.Fatal(err)
	}
	n, errs := checkOrder(calls, filepath.Join(dir, "store"))
	for i, e := range errs {
		if i == 10 {
			t.Errorf("… and %d more", len(errs)-10)
			break
		}
		t.Error(e)
	}
	if n.objWrites == 0 || n.cleans == 0 || n.dirties == 0 || n.renames == 0 {
		t.Fatalf("trace too thin to prove anything: %+v", n)
	}
	t.Logf("%d system calls: %d object writes, %d dirty and %d clean records, %d renames over objects checked", len(calls), n.objWrites, n.dirties, n.cleans, n.renames)
}

// call is one traced system call: where it began and ended in the trace.
type call struct {
	name, path, path2 string
	creat             bool // openat with O_CREAT
	data              []byte
	entry, exit       int
	ok                bool
}

var (
	traceLine    = regexp.MustCompile(`^(\d+)\s+(.*)$`)
	traceCall    = regexp.MustCompile(`^(\w+)\((.*)$`)
	traceResumed = regexp.MustCompile(`^<\.\.\. (\w+) resumed>(.*)$`)
	traceFD      = regexp.MustCompile(`-?\d+<([^>]*)>`)
	traceStr     = regexp.MustCompile(`"((?:\\x[0-9a-f]{2})*)"`)
	traceResult  = regexp.MustCompile(`\)\s+=\s+(-?\d+)`)
	tracePath    = regexp.MustCompile(`"((?:\\x[0-9a-f]{2})*)"`)
)

func unhex(s string) []byte {
	b, _ := hex.DecodeString(strings.ReplaceAll(s, `\x`, ""))
	return b
}

func parseTrace(path string) ([]*call, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var calls []*call
	pending := map[string]*call{}
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<26)
	for i := 0; sc.Scan(); i++ {
		m := traceLine.FindStringSubmatch(sc.Text())
		if m == nil {
			continue
		}
		pid, rest := m[1], m[2]
		if r := traceResumed.FindStringSubmatch(rest); r != nil {
			c := pending[pid]
			delete(pending, pid)
			if c == nil {
				continue
			}
			c.exit = i
			if res := traceResult.FindStringSubmatch(r[2]); res != nil {
				c.ok = !strings.HasPrefix(res[1], "-")
			}
			continue
		}
		cm := traceCall.FindStringSubmatch(rest)
		if cm == nil {
			continue
		}
		c := &call{name: cm[1], entry: i, exit: i}
		args := cm[2]
		if fds := traceFD.FindAllStringSubmatch(args, -1); len(fds) > 0 {
			c.path = string(unhex(fds[0][1])) // -xx writes paths in hex too
			if len(fds) > 1 {
				c.path2 = string(unhex(fds[1][1]))
			}
		}
		strs := traceStr.FindAllStringSubmatch(args, -1)
		switch c.name {
		case "pwrite64":
			if len(strs) > 0 {
				c.data = unhex(strs[0][1])
			}
		case "openat":
			if ps := tracePath.FindAllStringSubmatch(args, -1); len(ps) > 0 {
				c.path = string(unhex(ps[0][1]))
			}
			c.creat = strings.Contains(args, "O_CREAT")
		case "rename", "renameat", "unlink", "unlinkat", "truncate":
			// Paths are strings, relative to a dir fd or absolute.
			var ps []string
			for _, s := range tracePath.FindAllStringSubmatch(args, -1) {
				ps = append(ps, string(unhex(s[1])))
			}
			if len(ps) > 0 {
				c.path = ps[0]
			}
			if len(ps) > 1 {
				c.path2 = ps[1]
			}
		}
		calls = append(calls, c)
		if strings.Contains(args, "<unfinished ...>") {
			pending[pid] = c
			continue
		}
		if res := traceResult.FindStringSubmatch(args); res != nil {
			c.ok = !strings.HasPrefix(res[1], "-")
		}
	}
	return calls, sc.Err()
}

func objectPath(root string, id object.ID) string {
	return filepath.Join(root, "objects", fmt.Sprintf("%08x", uint32(id.VDI())), fmt.Sprintf("%08x", id.Index()))
}

type orderCounts struct{ objWrites, dirties, cleans, renames int }

// objectOf names the object a path under root/objects is, if it is one.
func objectOf(root, path string) (object.ID, bool) {
	rel, err := filepath.Rel(filepath.Join(root, "objects"), path)
	if err != nil {
		return 0, false
	}
	parts := strings.Split(rel, "/")
	if len(parts) != 2 || len(parts[0]) != 8 || len(parts[1]) != 8 {
		return 0, false
	}
	v, err1 := strconv.ParseUint(parts[0], 16, 32)
	x, err2 := strconv.ParseUint(parts[1], 16, 32)
	if err1 != nil || err2 != nil {
		return 0, false
	}
	return object.Make(object.VDI(v), uint32(x)), true
}

func checkOrder(calls []*call, root string) (orderCounts, []string) {
	journal := filepath.Join(root, "journal")
	tmpDir := filepath.Join(root, "tmp")
	type event struct {
		at   int
		exit bool
		c    *call
	}
	var evs []event
	for _, c := range calls {
		if !c.ok {
			continue
		}
		evs = append(evs, event{at: c.entry, c: c}, event{at: c.exit, exit: true, c: c})
	}
	// Entries before exits on one line (an uninterrupted call).
	sortEvents := func(a, b event) bool {
		if a.at != b.at {
			return a.at < b.at
		}
		return !a.exit && b.exit
	}
	for i := 1; i < len(evs); i++ { // insertion sort: evs is nearly sorted
		for j := i; j > 0 && sortEvents(evs[j], evs[j-1]); j-- {
			evs[j], evs[j-1] = evs[j-1], evs[j]
		}
	}
	var (
		n        orderCounts
		errs     []string
		durable  = map[object.ID]uint32{}
		written  []record              // journal records whose pwrite ended, not yet covered by a sync
		syncable []record              // those whose pwrite ended before the current sync began
		lastW    = map[object.ID]int{} // exit of the last write
		syncedAt = map[object.ID]int{} // exit of an fdatasync that began after lastW
		gone     = map[object.ID]int{} // unlink or rename over, after lastW
		created  = map[object.ID]int{} // exit of the file's creation
		dirSync  = map[string]int{}    // dir → entry of the last fsync that ended
		unlinked = map[object.ID]int{} // exit of its unlink
		syncFrom = map[*call]int{}     // for object syncs: lastW when they began
		jsync    = map[*call][]record{}
		tmpW     = map[string]int{} // tmp file → exit of its last write
		tmpSync  = map[string]int{} // tmp file → exit of an fdatasync that began after tmpW
	)
	isWrite := func(name string) bool {
		return name == "pwrite64" || name == "fallocate" || name == "ftruncate" || name == "truncate"
	}
	for _, e := range evs {
		c := e.c
		id, isObj := objectOf(root, c.path)
		isTmp := filepath.Dir(c.path) == tmpDir
		switch {
		case isWrite(c.name) && isTmp && e.exit:
			tmpW[c.path] = e.at
		case c.name == "fdatasync" && isTmp && !e.exit:
			syncFrom[c] = tmpW[c.path]
		case c.name == "fdatasync" && isTmp && e.exit:
			if syncFrom[c] == tmpW[c.path] {
				tmpSync[c.path] = e.at + 1
			}
		case strings.HasPrefix(c.name, "rename") && isTmp && !e.exit:
			if tid, ok := objectOf(root, c.path2); ok {
				n.renames++
				if w, ok := tmpW[c.path]; ok && tmpSync[c.path] <= w {
					errs = append(errs, fmt.Sprintf("line %d: %s renamed over %s, but its write ending at line %d was never synced", c.entry, c.path, tid, w))
				}
				delete(tmpW, c.path) // the name is used again
				delete(tmpSync, c.path)
			}
		case c.name == "pwrite64" && c.path == journal && !e.exit:
			for off := 0; off+recSize <= len(c.data); off += recSize {
				r, ok := decodeRecord(c.data[off : off+recSize])
				if !ok {
					continue
				}
				switch r.op {
				case recDirty:
					n.dirties++
				case recClean:
					n.cleans++
					oid := object.ID(r.key)
					w, wrote := lastW[oid]
					if wrote && syncedAt[oid] <= w && gone[oid] <= w {
						errs = append(errs, fmt.Sprintf("line %d: CLEAN for %s written, but its write ending at line %d was never synced", c.entry, oid, w))
					}
					dir := filepath.Dir(objectPath(root, oid))
					if cr, ok := created[oid]; ok && dirSync[dir] <= cr && unlinked[oid] <= cr {
						errs = append(errs, fmt.Sprintf("line %d: CLEAN for %s written, but its directory entry made at line %d was never synced", c.entry, oid, cr))
					}
				}
			}
		case c.name == "pwrite64" && c.path == journal && e.exit:
			for off := 0; off+recSize <= len(c.data); off += recSize {
				if r, ok := decodeRecord(c.data[off : off+recSize]); ok {
					written = append(written, r)
				}
			}
		case c.name == "fdatasync" && c.path == journal && !e.exit:
			syncable = append(syncable, written...)
			written = nil
			jsync[c] = syncable
			syncable = nil
		case c.name == "fdatasync" && c.path == journal && e.exit:
			for _, r := range jsync[c] {
				switch r.op {
				case recDirty, recSuspect:
					durable[object.ID(r.key)] = r.op
				case recClean:
					delete(durable, object.ID(r.key))
				}
			}
		case isWrite(c.name) && isObj && !e.exit:
			n.objWrites++
			if durable[id] == 0 {
				errs = append(errs, fmt.Sprintf("line %d: %s of %s before a durable DIRTY record", c.entry, c.name, id))
			}
		case isWrite(c.name) && isObj && e.exit:
			lastW[id] = e.at
		case (c.name == "fdatasync" || c.name == "fsync") && isObj && !e.exit:
			syncFrom[c] = lastW[id]
		case (c.name == "fdatasync" || c.name == "fsync") && isObj && e.exit:
			if syncFrom[c] == lastW[id] { // nothing written meanwhile
				syncedAt[id] = e.at + 1
			}
		case c.name == "openat" && c.creat && isObj && e.exit:
			created[id] = e.at
		case c.name == "fsync" && !isObj && !e.exit:
			syncFrom[c] = e.at
		case c.name == "fsync" && !isObj && e.exit:
			dirSync[c.path] = syncFrom[c]
		case c.name == "unlink" || c.name == "unlinkat" || c.name == "rename" || c.name == "renameat":
			target := c.path
			if strings.HasPrefix(c.name, "rename") {
				target = c.path2
			}
			if tid, ok := objectOf(root, target); ok && e.exit {
				gone[tid] = e.at + 1
				if strings.HasPrefix(c.name, "rename") {
					created[tid] = e.at
				} else {
					unlinked[tid] = e.at + 1
				}
			}
		}
	}
	return n, errs
}

// The order checker itself: a write without a durable DIRTY record and a
// CLEAN record before a sync are both reported; the right order is not.
func TestCheckOrderCatches(t *testing.T) {
	root := "/s"
	a := object.Make(1, 1)
	pa, pb := root+"/objects/00000001/00000001", root+"/objects/00000001/00000002"
	rec := func(id object.ID, op uint32) []byte {
		var r [recSize]byte
		record{key: uint64(id), op: op}.encode(r[:])
		return r[:]
	}
	line := 0
	c := func(name, path string, data []byte) *call {
		line++
		return &call{name: name, path: path, data: data, entry: line, exit: line, ok: true}
	}
	tmp := root + "/tmp/0000000100000001"
	rename := func(from, to string) *call {
		line++
		return &call{name: "rename", path: from, path2: to, entry: line, exit: line, ok: true}
	}
	calls := []*call{
		{name: "openat", path: pa, creat: true, ok: true},
		c("pwrite64", root+"/journal", rec(a, recDirty)),
		c("fdatasync", root+"/journal", nil),
		c("pwrite64", pa, []byte("x")),                   // fine
		c("pwrite64", pb, []byte("x")),                   // no DIRTY for b
		c("pwrite64", root+"/journal", rec(a, recClean)), // a never synced
		c("fdatasync", pa, nil),
		c("pwrite64", root+"/journal", rec(a, recClean)), // directory never synced
		c("fsync", root+"/objects/00000001", nil),
		c("pwrite64", root+"/journal", rec(a, recClean)), // fine now
		c("pwrite64", tmp, []byte("x")),
		rename(tmp, pa), // tmp never synced
		c("pwrite64", tmp, []byte("x")),
		c("fdatasync", tmp, nil),
		rename(tmp, pa), // fine
	}
	_, errs := checkOrder(calls, root)
	if len(errs) != 5 || !strings.Contains(errs[0], "before a durable DIRTY") || !strings.Contains(errs[1], "was never synced") ||
		!strings.Contains(errs[3], "directory entry") || !strings.Contains(errs[4], "renamed over") {
		t.Fatalf("checker found %q, want the planted faults", errs)
	}
}
