package main

import (
	"bytes"
	"encoding/binary"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"

	"github.com/ovis-storage/ovis/internal/twin"
)

// Helpers for the tests of the verbs beyond create, info and convert:
// twin folders where qemu-img and ovis each get the same files, and a
// patcher that damages qcow2 images as QEMU's own tests do.

func init() {
	// A binary built with -race sleeps a second before it exits, so that
	// racing goroutines get to report; the tests run the ovis binary
	// about a thousand times, and races are reported without the sleep.
	if _, ok := os.LookupEnv("GORACE"); !ok {
		os.Setenv("GORACE", "atexit_sleep_ms=0")
	}
}

// twinDirs returns two folders prepared by setup alike: the first for
// qemu-img, the second for ovis.
func twinDirs(t *testing.T, setup func(t *testing.T, dir string)) (qdir, odir string) {
	t.Helper()
	qdir, odir = t.TempDir(), t.TempDir()
	setup(t, qdir)
	twin.CopyDir(t, qdir, odir)
	return qdir, odir
}

// fixtures are folders of input files that many tests start from, built
// once per test binary under fixtureRoot (made by TestMain) and copied
// into each test's folders with copyDir.
var fixtures struct {
	mu   sync.Mutex
	dirs map[string]*fixture
}

type fixture struct {
	once sync.Once
	dir  string // "" when building it failed or it names itself
	// self: the fixture names its own folder (refersToItself).
	self bool
}

var fixtureRoot string

// sharedFixture returns a folder that build (which gets a test of its
// own, run by the first caller) filled once for every test of the
// binary; the caller must only read it. It fails the test when build
// failed, for this caller or an earlier one. A fixture whose files name
// its own folder by absolute path (a data file created by full path)
// cannot be copied: shared is then false, and the caller must build its
// own.
func sharedFixture(t *testing.T, name string, build func(t *testing.T, dir string)) (dir string, shared bool) {
	t.Helper()
	fixtures.mu.Lock()
	if fixtures.dirs == nil {
		fixtures.dirs = map[string]*fixture{}
	}
	f := fixtures.dirs[name]
	if f == nil {
		f = &fixture{}
		fixtures.dirs[name] = f
	}
	fixtures.mu.Unlock()
	f.once.Do(func() {
		dir := filepath.Join(fixtureRoot, name)
		if err := os.Mkdir(dir, 0o755); err != nil {
			t.Errorf("fixture %s: %v", name, err)
			return
		}
		build(t, dir)
		switch {
		case t.Failed():
		case refersToItself(t, dir):
			f.self = true
		default:
			f.dir = dir
		}
	})
	if f.self {
		return "", false
	}
	if f.dir == "" {
		t.Fatalf("fixture %s could not be built (see the first test that used it)", name)
	}
	return f.dir, true
}

// refersToItself reports whether a file under dir holds dir's absolute
// path (a backing or data file named by it): copies of dir would then
// read, and write, the shared files.
func refersToItself(t *testing.T, dir string) bool {
	t.Helper()
	found := false
	err := filepath.WalkDir(dir, func(path string, d os.DirEntry, err error) error {
		if err != nil || !d.Type().IsRegular() {
			return err
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		found = found || bytes.Contains(b, []byte(dir))
		return nil
	})
	if err != nil {
		t.Fatalf("fixture %s: %v", dir, err)
	}
	return found
}

// twinFixture is twinDirs for a setup that makes the same files whenever
// it runs: it runs once per key for the whole test binary (fromFixture).
// A setup whose files name their own folder is run per test, as
// twinDirs does.
func twinFixture(t *testing.T, key string, setup func(t *testing.T, dir string)) (qdir, odir string) {
	t.Helper()
	src, shared := sharedFixture(t, key, setup)
	if !shared {
		return twinDirs(t, setup)
	}
	qdir, odir = t.TempDir(), t.TempDir()
	twin.CopyTree(t, src, qdir)
	twin.CopyTree(t, src, odir)
	return qdir, odir
}

// fromFixture fills each of the folders dirs with a copy of the fixture
// name (sharedFixture), built once by build: for the many tests that
// give qemu-img and ovis each the same files to start from.
func fromFixture(t *testing.T, name string, build func(t *testing.T, dir string), dirs ...string) {
	t.Helper()
	src, shared := sharedFixture(t, name, build)
	if !shared {
		t.Fatalf("fixture %s names its own folder by absolute path: its copies would share its files", name)
	}
	for _, d := range dirs {
		twin.CopyTree(t, src, d)
	}
}

// bothRun runs `qemu-img args` in qdir and `ovis img args` in odir and
// requires the same output and exit code (sameResult), after replacing
// what matches each of the hide patterns (timings, dates) in stdout by
// the pattern's first group and "#".
func bothRun(t *testing.T, qdir, odir string, args []string, hide ...*regexp.Regexp) (q, o result) {
	t.Helper()
	q = qemuImg(t, qdir, args...)
	o = ovisImg(t, odir, args...)
	for _, re := range hide {
		q.stdout = re.ReplaceAllString(q.stdout, "${1}#")
		o.stdout = re.ReplaceAllString(o.stdout, "${1}#")
	}
	sameResult(t, strings.Join(args, " "), q, o)
	return q, o
}

// sameImages requires the named images of the two folders to read alike
// (qemu-img compare), to be described alike by qemu-img info (but for
// the disk size and the time snapshots were taken), and to check alike.
//
// Folders that hold the same files byte for byte (both tools refused, or
// ovis wrote what qemu-img wrote) pass every one of those comparisons by
// construction: they are not run, which saves seven qemu-img runs an
// image.
func sameImages(t *testing.T, qdir, odir string, names ...string) {
	t.Helper()
	compareImages(t, qdir, odir, names)
}

// sameImagesClean is sameImages, and then checkClean of ovis's images:
// their qemu-img check, run by the comparison, must have exited 0 (no
// corruption, leak or check error), without running it twice.
func sameImagesClean(t *testing.T, qdir, odir string, names ...string) {
	t.Helper()
	checks := compareImages(t, qdir, odir, names)
	if checks == nil { // the folders are alike: nothing was run
		checkClean(t, odir, names...)
		return
	}
	for _, n := range names {
		if c := checks[n]; strings.HasSuffix(n, ".qcow2") && c.code != 0 {
			t.Errorf("qemu-img check %s as ovis left it: exit %d (1 check failed, 2 corrupt, 3 leaks)\n%s%s", n, c.code, c.stdout, c.stderr)
		}
	}
}

// compareImages is sameImages; it returns qemu-img check's result on
// each of ovis's images, or nil when the folders were alike and nothing
// ran.
func compareImages(t *testing.T, qdir, odir string, names []string) map[string]result {
	t.Helper()
	if sameFolders(t, qdir, odir) {
		return nil
	}
	checks := map[string]result{}
	for _, n := range names {
		// One qemu-img compare, or a convert of each image in its own
		// folder, where QEMU looks for external data files
		// (twin.GuestMismatch).
		if d := twin.GuestMismatch(t, qdir, odir, n); d != "" {
			t.Errorf("%s reads differently as qemu-img and ovis left it: %s", n, d)
		}
		qi, oi := qemuImg(t, qdir, "info", "-U", n), qemuImg(t, odir, "info", "-U", n)
		strip := func(s string) string {
			return snapshotRowRE.ReplaceAllString(diskSizeRE.ReplaceAllString(s, ""), "#")
		}
		if strip(qi.stdout) != strip(oi.stdout) || qi.code != oi.code {
			t.Errorf("qemu-img info of %s differs\nqemu-img's: %s%s\n    ovis's: %s%s", n, qi.stdout, qi.stderr, oi.stdout, oi.stderr)
		}
		qc, oc := qemuImg(t, qdir, "check", "-U", n), qemuImg(t, odir, "check", "-U", n)
		if qc.code != oc.code {
			t.Errorf("qemu-img check of %s: exit %d as ovis left it, %d as qemu-img did\n%s%s", n, oc.code, qc.code, oc.stdout, oc.stderr)
		}
		checks[n] = oc
	}
	return checks
}

// sameFolders reports whether the folders a and b hold the same names,
// and the same bytes in each file, recursively.
func sameFolders(t *testing.T, a, b string) bool {
	t.Helper()
	ae, err := os.ReadDir(a)
	if err != nil {
		t.Fatal(err)
	}
	be, err := os.ReadDir(b)
	if err != nil {
		t.Fatal(err)
	}
	if len(ae) != len(be) {
		return false
	}
	for i, e := range ae {
		pa, pb := filepath.Join(a, e.Name()), filepath.Join(b, be[i].Name())
		switch {
		case e.Name() != be[i].Name() || e.Type() != be[i].Type():
			return false
		case e.IsDir():
			if !sameFolders(t, pa, pb) {
				return false
			}
		case e.Type().IsRegular():
			if an, bn, at := twin.FirstFileDiff(t, pa, pb); at >= 0 || an != bn {
				return false
			}
		default: // sockets, links: not compared, so not known alike
			return false
		}
	}
	return true
}

var diskSizeRE = regexp.MustCompile(`(?m)^disk size: .*\n`)

// qcow2Patch edits the metadata of a qcow2 image with 16-bit refcounts
// in place, to damage it.
type qcow2Patch struct {
	t                 *testing.T
	f                 *os.File
	clusterBits       uint
	l1Offset, rtTable uint64
}

func patchQcow2(t *testing.T, path string) *qcow2Patch {
	t.Helper()
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	p := &qcow2Patch{t: t, f: f}
	p.clusterBits = uint(binary.BigEndian.Uint32(p.read(20, 4)))
	p.l1Offset = p.u64(40)
	p.rtTable = p.u64(48)
	if order := binary.BigEndian.Uint32(p.read(96, 4)); order != 4 {
		t.Fatalf("patchQcow2 %s: refcount order %d, want 4", path, order)
	}
	return p
}

func (p *qcow2Patch) read(off int64, n int) []byte {
	b := make([]byte, n)
	if _, err := p.f.ReadAt(b, off); err != nil {
		p.t.Fatal(err)
	}
	return b
}

func (p *qcow2Patch) u64(off uint64) uint64 {
	return binary.BigEndian.Uint64(p.read(int64(off), 8))
}

func (p *qcow2Patch) put64(off, v uint64) {
	var b [8]byte
	binary.BigEndian.PutUint64(b[:], v)
	if _, err := p.f.WriteAt(b[:], int64(off)); err != nil {
		p.t.Fatal(err)
	}
}

// l2Entry returns the file offset of guest cluster i's L2 entry.
func (p *qcow2Patch) l2Entry(i uint64) uint64 {
	per := uint64(1) << p.clusterBits / 8
	l2 := p.u64(p.l1Offset+8*(i/per)) & 0x00fffffffffffe00
	if l2 == 0 {
		p.t.Fatalf("guest cluster %d has no L2 table", i)
	}
	return l2 + 8*(i%per)
}

// setRefcount sets host cluster c's refcount.
func (p *qcow2Patch) setRefcount(c, v uint64) {
	per := uint64(1) << p.clusterBits * 8 / 16
	blk := p.u64(p.rtTable + 8*(c/per))
	var b [2]byte
	binary.BigEndian.PutUint16(b[:], uint16(v))
	if _, err := p.f.WriteAt(b[:], int64(blk+2*(c%per))); err != nil {
		p.t.Fatal(err)
	}
}

// grow appends n empty clusters to the file and returns the index of the
// first.
func (p *qcow2Patch) grow(n int64) uint64 {
	st, err := p.f.Stat()
	if err != nil {
		p.t.Fatal(err)
	}
	cs := int64(1) << p.clusterBits
	end := (st.Size() + cs - 1) / cs * cs
	if err := p.f.Truncate(end + n*cs); err != nil {
		p.t.Fatal(err)
	}
	return uint64(end / cs)
}
