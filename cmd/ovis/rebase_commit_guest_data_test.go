package main

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/ovis-storage/ovis/internal/testutil"
)

// Rebase and commit across chains whose layers differ in size (issue 14,
// cases 1 and 6): both tools run on twin copies, and every image must
// read the same guest data afterwards.

// layerSpec is one image of a chain built bottom up, each the backing
// file of the next.
type layerSpec struct {
	name string // its extension is its format: .qcow2 or .raw
	size int64  // a raw file's size need not be a multiple of 512
	opts string // qcow2 -o options
}

func (l layerSpec) format() string { return strings.TrimPrefix(filepath.Ext(l.name), ".") }

// buildChain creates the layers in dir, each backed by the one before,
// and fills each with its own data (fillLayer).
func buildChain(t *testing.T, dir string, layers ...layerSpec) {
	t.Helper()
	for i, l := range layers {
		if l.format() == "raw" {
			if i != 0 {
				t.Fatalf("raw layer %s must be the bottom of its chain", l.name)
			}
			writeRawLayer(t, filepath.Join(dir, l.name), l.size, i)
			continue
		}
		args := []string{"create", "-q", "-f", "qcow2"}
		if l.opts != "" {
			args = append(args, "-o", l.opts)
		}
		if i > 0 {
			args = append(args, "-b", layers[i-1].name, "-F", layers[i-1].format())
		}
		run("qemu-img", append(args, l.name, fmt.Sprint(l.size))...)(t, dir)
		var cmds []string
		for _, w := range layerRuns(l.size, i) {
			if w.zero {
				cmds = append(cmds, "-c", fmt.Sprintf("write -q -z %d %d", w.off, w.n))
			} else {
				cmds = append(cmds, "-c", fmt.Sprintf("write -q -P %d %d %d", w.pattern, w.off, w.n))
			}
		}
		run("qemu-io", append(append([]string{"-f", "qcow2"}, cmds...), l.name)...)(t, dir)
	}
}

// layerRun is one write of fillLayer.
type layerRun struct {
	off, n  int64
	pattern byte
	zero    bool
}

// layerRuns is what layer i of a chain holds: its pattern at the start
// and from the middle to its end, explicit zeros after the start, and a
// hole between, placed differently in each layer so that the layers
// below show through in different places (and not on cluster
// boundaries).
func layerRuns(size int64, i int) []layerRun {
	p := byte(0x11 * (i + 1))
	a := size / 4 &^ 511
	z := size / 8 &^ 511
	h := min(size/2+int64(i)*4096, size-512) &^ 511
	return []layerRun{
		{off: 0, n: a, pattern: p},
		{off: a, n: z, zero: true},
		{off: h, n: (size &^ 511) - h, pattern: p},
	}
}

// writeRawLayer writes a raw bottom layer with layerRuns' layout; the
// partial last sector of an odd size is pattern too.
func writeRawLayer(t *testing.T, path string, size int64, i int) {
	t.Helper()
	buf := make([]byte, size)
	runs := layerRuns(size, i)
	for j, r := range runs {
		end := r.off + r.n
		if j == len(runs)-1 {
			end = size
		}
		if !r.zero {
			for k := r.off; k < end; k++ {
				buf[k] = r.pattern
			}
		}
	}
	if err := os.WriteFile(path, buf, 0o644); err != nil {
		t.Fatal(err)
	}
}

// snapshotRaw converts what name reads (through its backing chain) in
// dir to a raw file elsewhere and returns its path.
func snapshotRaw(t *testing.T, dir, name string) string {
	t.Helper()
	out := filepath.Join(t.TempDir(), strings.TrimSuffix(name, filepath.Ext(name))+".raw")
	if r := qemuImg(t, dir, "convert", "-U", "-O", "raw", name, out); r.code != 0 {
		t.Fatalf("qemu-img convert %s: %s", name, r.stderr)
	}
	return out
}

// readsAsBefore requires name in dir to read what the raw file before
// holds.
func readsAsBefore(t *testing.T, dir, name, before string) {
	t.Helper()
	if r := qemuImg(t, "", "compare", "-U", "-f", "raw", "-F", "raw", before, snapshotRaw(t, dir, name)); r.code != 0 {
		t.Errorf("%s no longer reads what it read before: exit %d\n%s%s", name, r.code, r.stdout, r.stderr)
	}
}

// checkClean runs qemu-img check on each qcow2 image of dir among names.
func checkClean(t *testing.T, dir string, names ...string) {
	t.Helper()
	for _, n := range names {
		if strings.HasSuffix(n, ".qcow2") {
			testutil.CheckImage(t, filepath.Join(dir, n))
		}
	}
}

// rebaseCase is one safe rebase of top.qcow2.
type rebaseCase struct {
	name  string
	chain []layerSpec // bottom up; the last is top.qcow2
	other []layerSpec // an unrelated chain holding the new backing file
	args  []string    // after "rebase"
	// qemuWrong says why qemu-img's result is not the reference: then
	// only the output and what the overlay read before are compared.
	qemuWrong string
}

// rebaseCases covers the sizes of the old and the new backing file
// against the overlay's, for a new backing file down the chain, an
// unrelated one, none (-b ""), and no old one, with the given qcow2
// options on every image.
func rebaseCases(opts string) []rebaseCase {
	const k = 1024
	sizes := []struct{ top, old, new int64 }{
		{320 * k, 256 * k, 320 * k}, // old shorter (issue 14 case 1)
		{320 * k, 300 * k, 320 * k}, // old shorter, ending inside a cluster
		{320 * k, 320 * k, 256 * k}, // new shorter
		{320 * k, 320 * k, 300 * k},
		{320 * k, 256 * k, 300 * k}, // both shorter
		{320 * k, 300 * k, 256 * k},
		{256 * k, 320 * k, 320 * k}, // overlay shorter
		{300 * k, 320 * k, 256 * k},
		{300 * k, 256 * k, 320 * k},
		{320 * k, 320 * k, 320 * k},
	}
	q := func(name string, size int64) layerSpec { return layerSpec{name, size, opts} }
	var out []rebaseCase
	seen := map[string]bool{}
	add := func(c rebaseCase) {
		if !seen[c.name] {
			seen[c.name] = true
			out = append(out, c)
		}
	}
	onto := []string{"-b", "new.qcow2", "-F", "qcow2", "top.qcow2"}
	for _, s := range sizes {
		sz := fmt.Sprintf("top %d old %d new %d", s.top/k, s.old/k, s.new/k)
		add(rebaseCase{name: "down the chain/" + sz,
			chain: []layerSpec{q("new.qcow2", s.new), q("old.qcow2", s.old), q("top.qcow2", s.top)}, args: onto})
		// Two layers above the new backing file, the lower one short.
		add(rebaseCase{name: "two down/" + sz,
			chain: []layerSpec{q("new.qcow2", s.new), q("mid.qcow2", s.old), q("old.qcow2", s.top), q("top.qcow2", s.top)}, args: onto})
		add(rebaseCase{name: "unrelated/" + sz,
			chain: []layerSpec{q("old.qcow2", s.old), q("top.qcow2", s.top)}, other: []layerSpec{q("new.qcow2", s.new)}, args: onto})
		add(rebaseCase{name: fmt.Sprintf("no new/top %d old %d", s.top/k, s.old/k),
			chain: []layerSpec{q("old.qcow2", s.old), q("top.qcow2", s.top)}, args: []string{"-b", "", "top.qcow2"}})
		c := rebaseCase{name: fmt.Sprintf("no old/top %d new %d", s.top/k, s.new/k),
			chain: []layerSpec{q("top.qcow2", s.top)}, other: []layerSpec{q("new.qcow2", s.new)}, args: onto}
		if strings.Contains(opts, "compat=0.10") {
			// qcow2_subcluster_zeroize discards in a version 2 image
			// without backing file, so the new backing file shows
			// through where the image read zeros.
			c.qemuWrong = "QEMU 7.2 discards the zeros it should write"
		}
		add(c)
	}
	return out
}

// rawRebaseCases rebase onto and away from raw files of odd sizes.
func rawRebaseCases() []rebaseCase {
	const k = 1024
	var out []rebaseCase
	for _, s := range []struct{ top, old, new int64 }{
		{320 * k, 256*k + 1000, 320*k - 7},
		{320 * k, 320*k - 7, 256*k + 1000},
		{256 * k, 320*k + 3, 300*k + 1},
	} {
		sz := fmt.Sprintf("top %d old %d new %d", s.top, s.old, s.new)
		top := layerSpec{"top.qcow2", s.top, ""}
		out = append(out,
			rebaseCase{name: "raw down the chain/" + sz,
				chain: []layerSpec{{"new.raw", s.new, ""}, {"old.qcow2", s.old &^ 511, ""}, top},
				args:  []string{"-b", "new.raw", "-F", "raw", "top.qcow2"}},
			rebaseCase{name: "raw to raw/" + sz,
				chain: []layerSpec{{"old.raw", s.old, ""}, top}, other: []layerSpec{{"new.raw", s.new, ""}},
				args: []string{"-b", "new.raw", "-F", "raw", "top.qcow2"}},
			rebaseCase{name: "raw to nothing/" + sz,
				chain: []layerSpec{{"old.raw", s.old, ""}, top}, args: []string{"-b", "", "top.qcow2"}},
		)
	}
	return out
}

// TestRebaseKeepsGuestData rebases with both tools on twin copies and
// requires the overlay to read what it read before and what qemu-img's
// rebase left, to hold the same ranges itself, and to check clean.
func TestRebaseKeepsGuestData(t *testing.T) {
	t.Parallel()
	var cases []rebaseCase
	for oi, opts := range []string{"", "cluster_size=4k", "extended_l2=on", "compat=0.10", "cluster_size=2M", "extended_l2=on,cluster_size=2M"} {
		for ci, c := range rebaseCases(opts) {
			// Every case with the default options, and a third of
			// them with each of the others.
			if oi > 0 && !sampled(3, oi, ci) {
				continue
			}
			c.name = "opts " + opts + "/" + c.name
			cases = append(cases, c)
		}
	}
	cases = append(cases, rawRebaseCases()...)
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			testRebase(t, c)
		})
	}
}

func testRebase(t *testing.T, c rebaseCase) {
	t.Helper()
	qdir, odir := twinDirs(t, func(t *testing.T, dir string) {
		buildChain(t, dir, c.chain...)
		if c.other != nil {
			buildChain(t, dir, c.other...)
		}
	})
	before := snapshotRaw(t, qdir, "top.qcow2")
	bothRun(t, qdir, odir, append([]string{"rebase"}, c.args...))
	readsAsBefore(t, odir, "top.qcow2", before)
	checkClean(t, odir, "top.qcow2")
	if c.qemuWrong != "" {
		t.Log(c.qemuWrong)
		return
	}
	sameImages(t, qdir, odir, "top.qcow2")
	q, o := ownData(t, filepath.Join(qdir, "top.qcow2")), ownData(t, filepath.Join(odir, "top.qcow2"))
	if q != o {
		t.Errorf("top.qcow2 holds different ranges itself\nqemu-img's: %s\n    ovis's: %s", q, o)
	}
}

// ownData lists the ranges an image holds itself, as data or as zero
// clusters, merged; where the host file has holes (QEMU writes zeros out,
// ovis may leave them sparse) does not matter.
func ownData(t *testing.T, path string) string {
	t.Helper()
	var b strings.Builder
	var start, end int64 = -1, -1
	var data bool
	flush := func() {
		if start >= 0 {
			fmt.Fprintf(&b, "[%d, %d) data=%v\n", start, end, data)
		}
	}
	for _, e := range testutil.Map(t, path) {
		if e.Depth != 0 || e.Present == nil || !*e.Present {
			continue
		}
		if e.Start == end && e.Data == data {
			end += e.Length
			continue
		}
		flush()
		start, end, data = e.Start, e.Start+e.Length, e.Data
	}
	flush()
	return b.String()
}

// commitCase is one commit.
type commitCase struct {
	name  string
	chain []layerSpec // bottom up
	args  []string    // after "commit"
}

// commitCases covers the sizes of base, mid and top against each other
// for every kind of commit (only those that differ by the image format
// unless all), with a qcow2 or raw base.
func commitCases(baseFmt, opts string, all bool) []commitCase {
	const k = 1024
	var out []commitCase
	for _, s := range []struct{ base, mid, top int64 }{
		{640 * k, 320 * k, 640 * k}, // mid shorter (issue 14 case 6)
		{640 * k, 300 * k, 640 * k}, // mid ending inside a cluster
		{320 * k, 640 * k, 640 * k}, // base shorter: it grows
		{300 * k, 320 * k, 640 * k}, // both shorter
		{320 * k, 300 * k, 640 * k},
		{640 * k, 640 * k, 320 * k}, // top shorter
		{640 * k, 300 * k, 320 * k},
		{640 * k, 640 * k, 640 * k},
	} {
		bsize := s.base
		if baseFmt == "raw" {
			bsize += 100 // a raw file's size is any byte count
		}
		base := layerSpec{"base." + baseFmt, bsize, opts}
		chain := []layerSpec{base, {"mid.qcow2", s.mid, opts}, {"top.qcow2", s.top, opts}}
		sz := fmt.Sprintf("base %d mid %d top %d", bsize, s.mid, s.top)
		three := []string{"top.qcow2", "-b " + base.name + " top.qcow2"}
		// Four deep: committing into the base through a short layer.
		deep := []layerSpec{base, {"a.qcow2", s.top, opts}, {"mid.qcow2", s.mid, opts}, {"top.qcow2", s.top, opts}}
		four := []string{"-b " + base.name + " top.qcow2"}
		if all {
			three = append(three, "-d top.qcow2", "-b mid.qcow2 top.qcow2", "mid.qcow2")
			four = append(four, "-b a.qcow2 top.qcow2", "mid.qcow2")
		}
		for _, a := range three {
			out = append(out, commitCase{name: a + "/" + sz, chain: chain, args: strings.Fields(a)})
		}
		for _, a := range four {
			out = append(out, commitCase{name: "four deep " + a + "/" + sz, chain: deep, args: strings.Fields(a)})
		}
	}
	return out
}

// TestCommitKeepsGuestData commits with both tools on twin copies and
// requires the same output and exit code, every image of the chain
// reading the same guest data (through its backing chain), described
// alike (virtual size included) and checking clean.
func TestCommitKeepsGuestData(t *testing.T) {
	t.Parallel()
	var cases []commitCase
	for vi, v := range []struct {
		baseFmt, opts string
		all           bool
	}{
		{"qcow2", "", true}, {"raw", "", true}, {"qcow2", "cluster_size=4k", false},
		{"qcow2", "extended_l2=on", false}, {"qcow2", "compat=0.10", true},
	} {
		for ci, c := range commitCases(v.baseFmt, v.opts, v.all) {
			// Every case over a qcow2 base with the default options,
			// and a third of them with each of the others.
			if vi > 0 && !sampled(3, vi, ci) {
				continue
			}
			c.name = v.baseFmt + " " + v.opts + "/" + c.name
			cases = append(cases, c)
		}
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			qdir, odir := twinDirs(t, func(t *testing.T, dir string) { buildChain(t, dir, c.chain...) })
			bothRun(t, qdir, odir, append([]string{"commit"}, c.args...))
			var names []string
			for _, l := range c.chain {
				names = append(names, l.name)
			}
			sameImagesClean(t, qdir, odir, names...)
		})
	}
}

// TestReproRebaseOldBackingShorter is issue 14 case 1: rebasing onto an
// image further down the chain when the old backing file is shorter than
// the overlay; past the old backing file's end the overlay must keep
// reading zeros, not the new backing file's data.
func TestReproRebaseOldBackingShorter(t *testing.T) {
	t.Parallel()
	qdir, odir := twinDirs(t, func(t *testing.T, dir string) {
		for _, s := range []step{
			run("qemu-img", "create", "-q", "-f", "qcow2", "new.qcow2", "320K"),
			run("qemu-img", "create", "-q", "-f", "qcow2", "-b", "new.qcow2", "-F", "qcow2", "old.qcow2", "256K"),
			run("qemu-img", "create", "-q", "-f", "qcow2", "-b", "old.qcow2", "-F", "qcow2", "top.qcow2", "320K"),
			run("qemu-io", "-c", "write -q -P 0x11 0 320K", "new.qcow2"),
			run("qemu-io", "-c", "write -q -P 0x22 0 256K", "old.qcow2"),
		} {
			s(t, dir)
		}
	})
	bothRun(t, qdir, odir, []string{"rebase", "-b", "new.qcow2", "-F", "qcow2", "top.qcow2"})
	for _, d := range []string{qdir, odir} {
		testutil.QemuIO(t, filepath.Join(d, "top.qcow2"), "qcow2", "read -P 0x22 0 256K", "read -P 0 256K 64K")
	}
	sameImagesClean(t, qdir, odir, "top.qcow2")
}

// TestReproCommitMidShorter is issue 14 case 6: committing a top into a
// shorter backing file whose own backing file is longer; the grown range
// of the backing file must read zeros, as it did through the top.
func TestReproCommitMidShorter(t *testing.T) {
	t.Parallel()
	for _, compat := range []string{"1.1", "0.10"} {
		t.Run("compat "+compat, func(t *testing.T) {
			t.Parallel()
			qdir, odir := twinDirs(t, func(t *testing.T, dir string) {
				o := "compat=" + compat
				for _, s := range []step{
					run("qemu-img", "create", "-q", "-f", "qcow2", "-o", o, "base.qcow2", "2M"),
					run("qemu-io", "-c", "write -q -P 1 0 2M", "base.qcow2"),
					run("qemu-img", "create", "-q", "-f", "qcow2", "-o", o, "-b", "base.qcow2", "-F", "qcow2", "mid.qcow2", "1M"),
					run("qemu-img", "create", "-q", "-f", "qcow2", "-o", o, "-b", "mid.qcow2", "-F", "qcow2", "top.qcow2", "2M"),
				} {
					s(t, dir)
				}
			})
			// Version 2 has no zero flag to grow mid with: QEMU's commit
			// fails and leaves the images as they were.
			_, o := bothRun(t, qdir, odir, []string{"commit", "top.qcow2"})
			if (o.code == 0) != (compat == "1.1") {
				t.Errorf("compat=%s: ovis img commit exits %d", compat, o.code)
			}
			for _, d := range []string{qdir, odir} {
				testutil.QemuIO(t, filepath.Join(d, "top.qcow2"), "qcow2", "read -P 0 1M 1M")
				if compat == "1.1" {
					testutil.QemuIO(t, filepath.Join(d, "mid.qcow2"), "qcow2", "read -P 1 0 1M", "read -P 0 1M 1M")
				}
			}
			sameImagesClean(t, qdir, odir, "base.qcow2", "mid.qcow2", "top.qcow2")
		})
	}
}
