package main

import (
	"encoding/binary"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/ovis-storage/ovis/internal/testutil"
	"github.com/ovis-storage/ovis/internal/twin"
)

// checkVariant is an image, clean or damaged, named a.qcow2, built as
// QEMU's iotests build them: qemu-img and qemu-io, then patched bytes.
type checkVariant struct {
	name  string
	build func(t *testing.T, dir string)
	// damaged: qemu-img check must find something wrong with it.
	damaged bool
	// cleanAfterAll: qemu-img check -r all leaves it clean (QEMU 7.2
	// cannot repair a misaligned data cluster).
	cleanAfterAll bool
	// unrepairable: qemu-img check -r all repairs nothing.
	unrepairable bool
	// qemuAllFails says why qemu-img check -r all fails on the image
	// where ovis rebuilds it: a deliberate difference. ovis must then
	// leave a clean image that reads as the damaged one did.
	qemuAllFails string
	// noRepairAll says why -r all is not compared at all.
	noRepairAll string
}

func checkVariants() []checkVariant {
	data := func(opts string) func(t *testing.T, dir string) {
		return func(t *testing.T, dir string) {
			t.Helper()
			args := []string{"create", "-q", "-f", "qcow2"}
			if opts != "" {
				args = append(args, "-o", opts)
			}
			testutil.QemuImg(t, append(args, filepath.Join(dir, "a.qcow2"), "64M")...)
			testutil.QemuIO(t, filepath.Join(dir, "a.qcow2"), "qcow2",
				"write -P 1 0 256k", "write -z 1M 1M", "write -c -P 2 4M 64k", "write -P 3 10000000 1000")
		}
	}
	patched := func(f func(p *qcow2Patch)) func(t *testing.T, dir string) {
		return func(t *testing.T, dir string) {
			t.Helper()
			data("")(t, dir)
			f(patchQcow2(t, filepath.Join(dir, "a.qcow2")))
		}
	}
	const offMask = 0x00fffffffffffe00
	host := func(p *qcow2Patch, guest uint64) uint64 { return p.u64(p.l2Entry(guest)) & offMask }
	vs := []checkVariant{
		{name: "clean", build: data(""), cleanAfterAll: true},
		{name: "clean 4k clusters v2", build: data("cluster_size=4k,compat=0.10"), cleanAfterAll: true},
		{name: "clean extended l2", build: data("extended_l2=on"), cleanAfterAll: true},
		{"COPIED flag cleared on data", patched(func(p *qcow2Patch) {
			e := p.l2Entry(1)
			p.put64(e, p.u64(e)&^(1<<63))
		}), true, true, false, "", ""},
		{"COPIED flag cleared on L2 table", patched(func(p *qcow2Patch) {
			p.put64(p.l1Offset, p.u64(p.l1Offset)&^(1<<63))
		}), true, true, false, "", ""},
		{"COPIED flag kept on a shared cluster", patched(func(p *qcow2Patch) {
			p.setRefcount(host(p, 1)>>p.clusterBits, 2)
		}), true, true, false, "", ""},
		{"refcount 0 under live data", patched(func(p *qcow2Patch) {
			p.setRefcount(host(p, 2)>>p.clusterBits, 0)
		}), true, true, false, "", ""},
		{"refcount 2 under live data", patched(func(p *qcow2Patch) {
			p.setRefcount(host(p, 0)>>p.clusterBits, 2)
		}), true, true, false, "", ""},
		{"L2 entry into the L1 table", patched(func(p *qcow2Patch) {
			p.put64(p.l2Entry(1), p.l1Offset|1<<63)
		}), true, true, false, "", ""},
		{"misaligned data cluster", patched(func(p *qcow2Patch) {
			e := p.l2Entry(1)
			p.put64(e, p.u64(e)+0x200)
		}), true, false, false, "", ""},
		{"misaligned preallocated zero cluster", patched(func(p *qcow2Patch) {
			e := p.l2Entry(1)
			p.put64(e, (p.u64(e)+0x200)|1)
		}), true, true, false, "", ""},
		// Damage to the refcount table that only a rebuild repairs.
		{"refcount block shared with data", patched(func(p *qcow2Patch) {
			p.put64(p.rtTable+8, host(p, 0))
		}), true, true, false, "", ""},
		{"refcount block outside the image", patched(func(p *qcow2Patch) {
			p.put64(p.rtTable+8, 1<<30)
		}), true, true, false, "", ""},
		// A writer killed between allocating clusters and linking them
		// leaves them counted but unused; qemu-io's sigraise cannot be
		// timed into that window, so the leak is made by hand: clusters
		// past the end of the data, counted once.
		{"leaked clusters", patched(func(p *qcow2Patch) {
			c := p.grow(3)
			for i := range uint64(3) {
				p.setRefcount(c+i, 1)
			}
		}), true, true, false, "", ""},
		{"leaks, a refcount too high and a COPIED flag", patched(func(p *qcow2Patch) {
			p.setRefcount(p.grow(2), 1)
			p.setRefcount(host(p, 0)>>p.clusterBits, 2)
			e := p.l2Entry(1)
			p.put64(e, p.u64(e)&^(1<<63))
		}), true, true, false, "", ""},
		{"dirty after a killed lazy-refcounts writer", func(t *testing.T, dir string) {
			data("lazy_refcounts=on")(t, dir)
			testutil.QemuIOExit(t, filepath.Join(dir, "a.qcow2"), "qcow2", "write -P 4 20M 1M", "sigraise 9")
		}, true, true, false, "", ""},
		// Damage ovis refuses on a normal open but opens for check, as
		// QEMU does. QEMU 7.2's rebuild fails on the first two: it signals
		// the misaligned block as a fatal corruption (and stops writing),
		// or its overlap check still sees the old block in the old table.
		{name: "refcount table entry with reserved bits set", build: patched(func(p *qcow2Patch) {
			p.put64(p.rtTable, p.u64(p.rtTable)|1)
		}), damaged: true, qemuAllFails: "overlaps with refcount block"},
		{name: "refcount table entry misaligned", build: patched(func(p *qcow2Patch) {
			p.put64(p.rtTable, p.u64(p.rtTable)+0x200)
		}), damaged: true, qemuAllFails: "ERROR writing refblock"},
		{name: "first refcount block past the end of the file", build: patched(func(p *qcow2Patch) {
			p.put64(p.rtTable, 1<<30)
		}), damaged: true, cleanAfterAll: true},
		// QEMU 7.2 repairs neither L1 entry; it frees what they leak.
		{name: "L1 entry misaligned", build: patched(func(p *qcow2Patch) {
			p.put64(p.l1Offset, p.u64(p.l1Offset)+0x200)
		}), damaged: true},
		{name: "L1 entry past the end of the file", build: patched(func(p *qcow2Patch) {
			p.put64(p.l1Offset, 1<<63|1<<30)
		}), damaged: true},
		{name: "snapshot in an image with a data file", build: dataFileSnapshot, damaged: true, unrepairable: true},
	}
	// Snapshot table damage (qcow2_check_read_snapshot_table), on v3
	// images and on v2 ones, whose entries need no extra data.
	vs = append(vs, snapshotVariants("")...)
	return append(vs, snapshotVariants(" v2")...)
}

// snapshotVariants are the snapshot table damage cases; suffix " v2"
// builds them on compat=0.10 images.
func snapshotVariants(suffix string) []checkVariant {
	compat := "1.1"
	if suffix == " v2" {
		compat = "0.10"
	}
	sn := func(f func(p *qcow2Patch, entry uint64)) func(t *testing.T, dir string) {
		return snappedCompat(compat, f)
	}
	vs := []checkVariant{
		{name: "snapshot L1 table misaligned", build: sn(func(p *qcow2Patch, e uint64) {
			p.put64(e, p.u64(e)+0x200)
		}), damaged: true},
		{name: "snapshot L1 table too large", build: sn(func(p *qcow2Patch, e uint64) {
			p.put32(e+8, 32<<20/8+1)
		}), damaged: true},
		{name: "snapshot with too much extra data", build: sn(func(p *qcow2Patch, e uint64) {
			p.put32(e+36, 1025)
		}), damaged: true, cleanAfterAll: true},
		{name: "snapshot count past the table", build: sn(func(p *qcow2Patch, e uint64) {
			p.put32(60, 2)
		}), damaged: true, cleanAfterAll: true},
		{name: "snapshot table past the end of the file", build: sn(func(p *qcow2Patch, e uint64) {
			p.put64(64, 1<<30)
		}), damaged: true, cleanAfterAll: true},
		{name: "snapshot table misaligned", build: sn(func(p *qcow2Patch, e uint64) {
			p.put64(64, e+0x200)
		}), damaged: true, unrepairable: true},
		{name: "too many snapshots", build: sn(func(p *qcow2Patch, e uint64) {
			p.put32(60, 65537)
		}), damaged: true, noRepairAll: "qemu-img -r all reads 65536 entries past the table, " +
			"reports each as incomplete and then fails its overlap check writing the table"},
	}
	for i := range vs {
		v := &vs[i]
		if suffix == " v2" {
			switch v.name {
			case "snapshot count past the table":
				// The zeros past the table read as a complete v2 entry.
				v.damaged, v.cleanAfterAll = false, true
			case "snapshot table past the end of the file":
				// Nothing makes QEMU rewrite the table: no v2 entry is
				// incomplete. Only its refcount is reported.
				v.cleanAfterAll, v.unrepairable = false, true
			}
		}
		v.name += suffix
	}
	return vs
}

// snapped builds the data image with one internal snapshot, then damages
// it; f gets the offset of the snapshot's table entry.
func snapped(f func(p *qcow2Patch, entry uint64)) func(t *testing.T, dir string) {
	return snappedCompat("1.1", f)
}

// snappedCompat is snapped on an image of the given compat level.
func snappedCompat(compat string, f func(p *qcow2Patch, entry uint64)) func(t *testing.T, dir string) {
	return func(t *testing.T, dir string) {
		t.Helper()
		a := filepath.Join(dir, "a.qcow2")
		testutil.QemuImg(t, "create", "-q", "-f", "qcow2", "-o", "compat="+compat, a, "64M")
		testutil.QemuIO(t, a, "qcow2", "write -P 1 0 256k", "write -c -P 2 4M 64k")
		testutil.QemuImg(t, "snapshot", "-c", "s1", a)
		p := patchAnyQcow2(t, a)
		f(p, p.u64(64))
	}
}

// patchAnyQcow2 is patchQcow2 for v3 images and v2 ones, whose header
// has no refcount order (it is always 4).
func patchAnyQcow2(t *testing.T, path string) *qcow2Patch {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if binary.BigEndian.Uint32(b[4:]) != 2 {
		return patchQcow2(t, path)
	}
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	be := binary.BigEndian
	return &qcow2Patch{t: t, f: f, clusterBits: uint(be.Uint32(b[20:])), l1Offset: be.Uint64(b[40:]), rtTable: be.Uint64(b[48:])}
}

// dataFileSnapshot builds an image with an external data file and one
// internal snapshot. qemu-img refuses to take snapshots of such an image,
// so the snapshot is added by hand: an empty L1 table and a one-entry
// snapshot table in two new clusters, each counted once. The data file is
// named by its absolute path, as QEMU resolves a relative one from its
// working directory; a twin copy of a.qcow2 names the same data file,
// which check never writes.
func dataFileSnapshot(t *testing.T, dir string) {
	t.Helper()
	a := filepath.Join(dir, "a.qcow2")
	testutil.QemuImg(t, "create", "-q", "-f", "qcow2", "-o", "data_file="+filepath.Join(dir, "d.raw"), a, "64M")
	testutil.QemuIO(t, a, "qcow2", "write -P 1 0 256k")
	p := patchQcow2(t, a)
	c := p.grow(2)
	p.setRefcount(c, 1)
	p.setRefcount(c+1, 1)
	cs := uint64(1) << p.clusterBits
	l1, tbl := c*cs, (c+1)*cs
	// QCowSnapshotHeader, 24 bytes of extra data (VM state size, disk
	// size, icount), then the ID "1" and the name "s1".
	e := make([]byte, 40+24+3)
	binary.BigEndian.PutUint64(e[0:], l1)
	binary.BigEndian.PutUint32(e[8:], uint32(p.u64(32)))
	binary.BigEndian.PutUint16(e[12:], 1)
	binary.BigEndian.PutUint16(e[14:], 2)
	binary.BigEndian.PutUint32(e[36:], 24)
	binary.BigEndian.PutUint64(e[48:], 64<<20)
	copy(e[64:], "1s1")
	if _, err := p.f.WriteAt(e, int64(tbl)); err != nil {
		t.Fatal(err)
	}
	p.put32(60, 1)
	p.put64(64, tbl)
}

func (p *qcow2Patch) put32(off, v uint64) {
	var b [4]byte
	binary.BigEndian.PutUint32(b[:], uint32(v))
	if _, err := p.f.WriteAt(b[:], int64(off)); err != nil {
		p.t.Fatal(err)
	}
}

// TestCheckMatchesQemu checks damaged and clean images with both tools
// and requires the same report (stdout, every message on stderr) and
// exit code, in human, JSON and quiet form.
func TestCheckMatchesQemu(t *testing.T) {
	for _, v := range checkVariants() {
		t.Run(v.name, func(t *testing.T) {
			t.Parallel()
			dir := t.TempDir()
			v.build(t, dir)
			for _, extra := range [][]string{nil, {"--output=json"}, {"-q"}, {"-f", "qcow2", "-U"}} {
				args := append(append([]string{"check"}, extra...), "a.qcow2")
				q := qemuImg(t, dir, args...)
				o := ovisImg(t, dir, args...)
				sameResult(t, strings.Join(args, " "), q, o)
				if extra == nil && (q.code != 0) != v.damaged {
					t.Errorf("qemu-img check exits %d; the variant is meant to be damaged=%v", q.code, v.damaged)
				}
			}
		})
	}
}

// checkJSON is qemu-img check's JSON; pointers tell absent from 0.
type checkJSON struct {
	Filename           string `json:"filename"`
	Format             string `json:"format"`
	CheckErrors        *int64 `json:"check-errors"`
	ImageEndOffset     *int64 `json:"image-end-offset"`
	Corruptions        *int64 `json:"corruptions"`
	Leaks              *int64 `json:"leaks"`
	CorruptionsFixed   *int64 `json:"corruptions-fixed"`
	LeaksFixed         *int64 `json:"leaks-fixed"`
	TotalClusters      *int64 `json:"total-clusters"`
	AllocatedClusters  *int64 `json:"allocated-clusters"`
	FragmentedClusters *int64 `json:"fragmented-clusters"`
	CompressedClusters *int64 `json:"compressed-clusters"`
}

func (c checkJSON) String() string {
	b, _ := json.Marshal(c)
	return string(b)
}

// TestCheckRepairMatchesQemu repairs each variant with qemu-img check -r
// and ovis img check -r on twin copies, for -r leaks and -r all in human,
// JSON and quiet output, and requires the same stdout (the "Repairing"
// lines, the summary of repairs, the double check), stderr, exit code and
// JSON fields. The repaired files must then be byte for byte alike (ovis
// repairs in place where QEMU does), check alike with qemu-img check
// (clean after -r all where QEMU gets it clean) and read alike.
func TestCheckRepairMatchesQemu(t *testing.T) {
	for vi, v := range checkVariants() {
		for mi, mode := range []string{"leaks", "all"} {
			for oi, out := range []string{"human", "json", "quiet"} {
				// Every variant and mode in human output; the other
				// two outputs for a third of them each.
				if oi > 0 && !sampled(3, vi, mi, oi) {
					continue
				}
				t.Run(v.name+"/"+mode+"/"+out, func(t *testing.T) {
					if mode == "all" && v.noRepairAll != "" {
						t.Skip(v.noRepairAll)
					}
					t.Parallel()
					qdir, odir := twinFixture(t, "check-"+v.name, v.build)
					if mode == "all" && v.qemuAllFails != "" {
						checkOvisRebuild(t, v, qdir, odir, out)
						return
					}
					args := repairArgs(mode, out)
					q := qemuImg(t, qdir, args...)
					o := ovisImg(t, odir, args...)
					sameResult(t, strings.Join(args, " "), q, o)
					if v.damaged && !v.unrepairable && mode == "all" && !strings.Contains(q.stderr, "Repairing") && !strings.Contains(q.stderr, "Rebuilding") && !strings.Contains(q.stderr, "Discarding") {
						t.Errorf("qemu-img repaired nothing; the variant is meant to be damaged:\n%s", q.stderr)
					}
					if out == "json" && q.stdout != "" {
						var qj, oj checkJSON
						if err := json.Unmarshal([]byte(q.stdout), &qj); err != nil {
							t.Fatalf("qemu-img's JSON: %v\n%s", err, q.stdout)
						}
						if err := json.Unmarshal([]byte(o.stdout), &oj); err != nil {
							t.Fatalf("ovis's JSON: %v\n%s", err, o.stdout)
						}
						if qj.String() != oj.String() {
							t.Errorf("JSON fields differ\nqemu-img: %s\n    ovis: %s", qj, oj)
						}
					}
					qa, oa := qemuImg(t, qdir, "check", "a.qcow2"), qemuImg(t, odir, "check", "a.qcow2")
					if qa.code != oa.code || qa.stdout != oa.stdout {
						t.Errorf("qemu-img check after the repair: exit %d as ovis left it, %d as qemu-img did\n%s%s", oa.code, qa.code, oa.stdout, oa.stderr)
					}
					if mode == "all" && v.cleanAfterAll && oa.code != 0 {
						t.Errorf("qemu-img check after ovis img check -r all: exit %d\n%s%s", oa.code, oa.stdout, oa.stderr)
					}
					if qn, on, at := twin.FirstFileDiff(t, filepath.Join(qdir, "a.qcow2"), filepath.Join(odir, "a.qcow2")); at >= 0 {
						t.Errorf("repaired files differ (%d bytes as qemu-img left it, %d as ovis did) from byte %d", qn, on, at)
					}
					// A misaligned data cluster stays unreadable for QEMU.
					if self := qemuImg(t, qdir, "compare", "a.qcow2", "a.qcow2"); self.code == 0 {
						if c := qemuImg(t, "", "compare", filepath.Join(qdir, "a.qcow2"), filepath.Join(odir, "a.qcow2")); c.code != 0 {
							t.Errorf("qemu-img compare of the repaired images: exit %d\n%s%s", c.code, c.stdout, c.stderr)
						}
					}
				})
			}
		}
	}
}

// repairArgs is `check -r MODE` on a.qcow2 with the output form out
// (human, json or quiet).
func repairArgs(mode, out string) []string {
	args := []string{"check", "-r", mode}
	switch out {
	case "json":
		args = append(args, "--output=json")
	case "quiet":
		args = append(args, "-q")
	}
	return append(args, "a.qcow2")
}

// checkOvisRebuild is -r all on a variant where qemu-img fails
// (qemuAllFails): qemu-img must still fail, and ovis must leave a clean
// image that reads as the damaged one.
func checkOvisRebuild(t *testing.T, v checkVariant, qdir, odir, out string) {
	t.Helper()
	args := repairArgs("all", out)
	q := qemuImg(t, qdir, args...)
	if q.code != 1 || !strings.Contains(q.stderr, v.qemuAllFails) {
		t.Errorf("qemu-img %s: exit %d, want 1 and %q (the documented difference is gone?)\n%s", strings.Join(args, " "), q.code, v.qemuAllFails, q.stderr)
	}
	orig := filepath.Join(t.TempDir(), "orig.qcow2")
	copyFile(t, filepath.Join(odir, "a.qcow2"), orig)
	o := ovisImg(t, odir, args...)
	if o.code != 0 || !strings.Contains(o.stderr, "Rebuilding refcount structure") {
		t.Errorf("ovis img %s: exit %d, want 0 after a rebuild\n%s%s", strings.Join(args, " "), o.code, o.stdout, o.stderr)
	}
	if out == "json" {
		var oj checkJSON
		if err := json.Unmarshal([]byte(o.stdout), &oj); err != nil || oj.CorruptionsFixed == nil || oj.Corruptions != nil {
			t.Errorf("ovis's JSON after the rebuild: %v\n%s", err, o.stdout)
		}
	}
	if a := qemuImg(t, odir, "check", "a.qcow2"); a.code != 0 {
		t.Errorf("qemu-img check after ovis img check -r all: exit %d\n%s%s", a.code, a.stdout, a.stderr)
	}
	if c := qemuImg(t, "", "compare", "-U", orig, filepath.Join(odir, "a.qcow2")); c.code != 0 {
		t.Errorf("qemu-img compare of the damaged and the rebuilt image: exit %d\n%s%s", c.code, c.stdout, c.stderr)
	}
}

func copyFile(t *testing.T, from, to string) {
	t.Helper()
	testutil.CopyFile(t, from, to)
}

// TestCheckErrorsMatchQemu compares the refusals: raw images (exit 63),
// bad arguments, missing files and backing files.
func TestCheckErrorsMatchQemu(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	testutil.QemuImg(t, "create", "-q", "-f", "raw", filepath.Join(dir, "r.raw"), "1M")
	testutil.QemuImg(t, "create", "-q", "-f", "qcow2", "-u", "-b", "missing.qcow2", "-F", "qcow2", filepath.Join(dir, "m.qcow2"), "1M")
	testutil.QemuImg(t, "create", "-q", "-f", "qcow2", filepath.Join(dir, "e.qcow2"), "1M")
	for _, a := range []string{
		"check r.raw", "check -f raw r.raw", "check --output=json r.raw", "check -f raw e.qcow2",
		"check m.qcow2", "check nonexist", "check", "check e.qcow2 r.raw",
		"check -r foo e.qcow2", "check --output=xml e.qcow2", "check -r all r.raw",
	} {
		args := strings.Fields(a)
		sameResult(t, a, qemuImg(t, dir, args...), ovisImg(t, dir, args...))
	}
}

// TestOpenRefusesCheckOnlyDamage: damage that check (and info, as
// qemu-img info does) opens past (ForCheck) is still refused, with what is
// wrong, by an open for I/O.
func TestOpenRefusesCheckOnlyDamage(t *testing.T) {
	want := map[string]string{
		"refcount table entry misaligned":         "refcount table entry 0: block offset 0x20200 is not cluster aligned",
		"L1 entry misaligned":                     "L1 entry 0: L2 table offset 0x40200 is not cluster aligned",
		"L1 entry past the end of the file":       "L1 entry 0: L2 table offset 0x40000000 is beyond the end of the file",
		"snapshot L1 table misaligned":            "is not cluster aligned",
		"snapshot table misaligned":               "snapshot table offset",
		"too many snapshots":                      "65537 snapshots exceed 65536",
		"snapshot with too much extra data":       "1025 bytes of extra data exceed 1024",
		"snapshot table past the end of the file": "beyond the end of the file",
	}
	for _, v := range checkVariants() {
		msg, ok := want[v.name]
		if !ok {
			continue
		}
		t.Run(v.name, func(t *testing.T) {
			t.Parallel()
			dir := t.TempDir()
			v.build(t, dir)
			for _, args := range [][]string{{"convert", "-O", "raw", "a.qcow2", "b.raw"}} {
				o := ovisImg(t, dir, args...)
				if o.code != 1 || !strings.Contains(o.stderr, "corrupt image") || !strings.Contains(o.stderr, msg) {
					t.Errorf("ovis img %s: exit %d, want 1 and %q\n%s", strings.Join(args, " "), o.code, msg, o.stderr)
				}
			}
		})
	}
}
