package main

import (
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/ovis-storage/ovis/internal/testutil"
)

// checkVariants are images with and without damage, each named a.qcow2
// (or a.raw), built as QEMU's iotests build them: qemu-img and qemu-io,
// then patched bytes.
func checkVariants() []struct {
	name  string
	build func(t *testing.T, dir string)
	// leaksOnly: the damage is leaked clusters alone, which ovis repairs
	// with -r leaks as QEMU does (same counters and summary).
	leaksOnly bool
	// fragDiffers: the engine counts one more fragmented cluster than
	// QEMU (it carries the contiguity test across L2 tables, where
	// QEMU's check_refcounts_l2 starts afresh with each table).
	fragDiffers bool
} {
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
	patched := func(opts string, f func(p *qcow2Patch)) func(t *testing.T, dir string) {
		return func(t *testing.T, dir string) {
			t.Helper()
			data(opts)(t, dir)
			f(patchQcow2(t, filepath.Join(dir, "a.qcow2")))
		}
	}
	return []struct {
		name        string
		build       func(t *testing.T, dir string)
		leaksOnly   bool
		fragDiffers bool
	}{
		{"clean", data(""), false, false},
		{"clean 4k clusters v2", data("cluster_size=4k,compat=0.10"), false, true},
		{"clean extended l2", data("extended_l2=on"), false, false},
		{"COPIED flag cleared on data", patched("", func(p *qcow2Patch) {
			e := p.l2Entry(1)
			p.put64(e, p.u64(e)&^(1<<63))
		}), false, false},
		{"COPIED flag cleared on L2 table", patched("", func(p *qcow2Patch) {
			p.put64(p.l1Offset, p.u64(p.l1Offset)&^(1<<63))
		}), false, false},
		{"refcount 0 under live data", patched("", func(p *qcow2Patch) {
			host := p.u64(p.l2Entry(2)) & 0x00fffffffffffe00
			p.setRefcount(host>>p.clusterBits, 0)
		}), false, false},
		{"refcount 2 under live data", patched("", func(p *qcow2Patch) {
			host := p.u64(p.l2Entry(0)) & 0x00fffffffffffe00
			p.setRefcount(host>>p.clusterBits, 2)
		}), false, false},
		{"L2 entry into the L1 table", patched("", func(p *qcow2Patch) {
			p.put64(p.l2Entry(1), p.l1Offset|1<<63)
		}), false, false},
		// A writer killed between allocating clusters and linking them
		// leaves them counted but unused; qemu-io's sigraise cannot be
		// timed into that window, so the leak is made by hand: clusters
		// past the end of the data, counted once.
		{"leaked clusters", patched("", func(p *qcow2Patch) {
			c := p.grow(3)
			for i := range uint64(3) {
				p.setRefcount(c+i, 1)
			}
		}), true, false},
		{"dirty after a killed lazy-refcounts writer", func(t *testing.T, dir string) {
			data("lazy_refcounts=on")(t, dir)
			testutil.QemuIOExit(t, filepath.Join(dir, "a.qcow2"), "qcow2", "write -P 4 20M 1M", "sigraise 9")
		}, false, false},
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
				if v.fragDiffers {
					q.stdout = fragRE.ReplaceAllString(q.stdout, "$1")
					o.stdout = fragRE.ReplaceAllString(o.stdout, "$1")
				}
				sameResult(t, strings.Join(args, " "), q, o)
			}
		})
	}
}

// fragRE matches the fragmentation figures, for the variants where the
// engine counts differently (see fragDiffers).
var fragRE = regexp.MustCompile(`(, )[0-9.]+% fragmented|("fragmented-clusters": )[0-9]+`)

// TestCheckRepair repairs each variant with ovis (-r leaks, -r all) and
// with qemu-img on a twin copy. After -r all qemu-img check must find the
// image clean; after -r leaks no leak may remain. Where the damage is
// leaks alone, ovis must report as qemu-img does.
func TestCheckRepair(t *testing.T) {
	for _, v := range checkVariants() {
		for _, mode := range []string{"leaks", "all"} {
			t.Run(v.name+"/"+mode, func(t *testing.T) {
				t.Parallel()
				qdir, odir := twinDirs(t, func(t *testing.T, dir string) { v.build(t, dir) })
				args := []string{"check", "-r", mode, "a.qcow2"}
				q := qemuImg(t, qdir, args...)
				o := ovisImg(t, odir, args...)
				if v.leaksOnly && mode == "leaks" {
					if q.stdout != o.stdout || q.code != o.code {
						t.Errorf("check -r %s: ovis exits %d, qemu-img %d\n    ovis: %s\nqemu-img: %s", mode, o.code, q.code, o.stdout, q.stdout)
					}
				}
				after := qemuImg(t, odir, "check", "a.qcow2")
				switch {
				case mode == "all" && after.code != 0:
					t.Errorf("qemu-img check after ovis check -r all: exit %d\n%s%s", after.code, after.stdout, after.stderr)
				case mode == "leaks" && strings.Contains(after.stdout+after.stderr, "eaked"):
					t.Errorf("qemu-img check after ovis check -r leaks still finds leaks:\n%s%s", after.stdout, after.stderr)
				}
				if c := testutil.QemuImg(t, "compare", filepath.Join(qdir, "a.qcow2"), filepath.Join(odir, "a.qcow2")); !strings.Contains(c, "identical") {
					t.Errorf("repaired images differ: %s", c)
				}
			})
		}
	}
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
