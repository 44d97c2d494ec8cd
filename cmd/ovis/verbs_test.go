package main

import (
	"encoding/binary"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/ovis-storage/ovis/internal/testutil"
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
	copyDir(t, qdir, odir)
	return qdir, odir
}

// copyDir copies the regular files of from into to, byte for byte, holes
// kept.
func copyDir(t *testing.T, from, to string) {
	t.Helper()
	ents, err := os.ReadDir(from)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		if !e.Type().IsRegular() {
			continue
		}
		o, e2, c := testutil.RunIn(t, "", "/bin/cp", "--sparse=always", filepath.Join(from, e.Name()), filepath.Join(to, e.Name()))
		if c != 0 {
			t.Fatalf("cp %s: %s%s", e.Name(), o, e2)
		}
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
func sameImages(t *testing.T, qdir, odir string, names ...string) {
	t.Helper()
	for _, n := range names {
		// Each image is read from its own folder, where QEMU looks for
		// external data files.
		raws := [2]string{filepath.Join(t.TempDir(), "q.raw"), filepath.Join(t.TempDir(), "o.raw")}
		for i, d := range []string{qdir, odir} {
			if r := qemuImg(t, d, "convert", "-U", "-O", "raw", n, raws[i]); r.code != 0 {
				t.Fatalf("qemu-img convert %s: %s", n, r.stderr)
			}
		}
		if r := qemuImg(t, "", "compare", "-f", "raw", "-F", "raw", raws[0], raws[1]); r.code != 0 {
			t.Errorf("qemu-img compare of %s as qemu-img and ovis left it: exit %d\n%s%s", n, r.code, r.stdout, r.stderr)
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
	}
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
