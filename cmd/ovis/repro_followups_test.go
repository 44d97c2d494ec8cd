package main

import (
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/ovis-storage/ovis/internal/testutil"
)

// dirtyLazyImage makes a qcow2 image with lazy refcounts that a killed
// qemu-io left dirty, its refcounts behind its L2 tables.
func dirtyLazyImage(t *testing.T, path string, extra ...string) {
	t.Helper()
	args := append([]string{"create", "-q", "-f", "qcow2", "-o", "lazy_refcounts=on"}, extra...)
	testutil.QemuImg(t, append(args, path, "1M")...)
	testutil.QemuIOExit(t, path, "qcow2", "write -q -P 0x5a 0 64k", "sigraise 9")
	if _, code := testutil.QemuImgExit(t, "check", path); code != 2 {
		t.Fatalf("qemu-img check of the dirty image exits %d, want 2 (corrupt until repaired)", code)
	}
}

// twin copies the file src into dir/name, holes and all.
func twin(t *testing.T, src, dir, name string) {
	t.Helper()
	if out, err := exec.Command("cp", "--sparse=always", src, filepath.Join(dir, name)).CombinedOutput(); err != nil {
		t.Fatalf("cp %s: %v\n%s", src, err, out)
	}
}

// TestReproDirtyRepairOnWritableOpen: every verb that opens a dirty
// lazy-refcounts image read-write repairs it as qemu-img does, printing
// the repair on stderr, and leaves it clean; the read-only verbs leave it
// alone.
func TestReproDirtyRepairOnWritableOpen(t *testing.T) {
	cases := []struct {
		name  string
		args  []string
		base  bool // the image has a backing file base.qcow2
		clean bool // the image is clean afterwards
	}{
		{"resize", []string{"resize", "a.qcow2", "2M"}, false, true},
		{"resize-shrink-fails", []string{"resize", "a.qcow2", "512K"}, false, true},
		{"snapshot-create", []string{"snapshot", "-c", "s1", "a.qcow2"}, false, true},
		{"snapshot-delete-missing", []string{"snapshot", "-d", "s1", "a.qcow2"}, false, true},
		{"snapshot-list", []string{"snapshot", "-l", "a.qcow2"}, false, false},
		{"bitmap-add", []string{"bitmap", "--add", "a.qcow2", "b0"}, false, true},
		{"rebase-unsafe", []string{"rebase", "-u", "-b", "", "a.qcow2"}, false, true},
		{"rebase-safe", []string{"rebase", "-b", "", "a.qcow2"}, true, true},
		{"commit-no-backing", []string{"commit", "a.qcow2"}, false, true},
		{"commit", []string{"commit", "a.qcow2"}, true, true},
		{"amend", []string{"amend", "-o", "lazy_refcounts=off", "a.qcow2"}, false, true},
		{"convert-existing", []string{"convert", "-n", "-f", "raw", "-O", "qcow2", "s.raw", "a.qcow2"}, false, true},
		{"convert-existing-quiet", []string{"convert", "-q", "-n", "-f", "raw", "-O", "qcow2", "s.raw", "a.qcow2"}, false, true},
		{"resize-quiet", []string{"resize", "-q", "a.qcow2", "2M"}, false, true},
		{"check", []string{"check", "a.qcow2"}, false, false},
		{"check-repair", []string{"check", "-r", "all", "a.qcow2"}, false, true},
		{"info", []string{"info", "a.qcow2"}, false, false},
		{"map", []string{"map", "a.qcow2"}, false, false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			src := t.TempDir()
			var extra []string
			if c.base {
				testutil.QemuImg(t, "create", "-q", "-f", "qcow2", filepath.Join(src, "base.qcow2"), "1M")
				testutil.QemuIO(t, filepath.Join(src, "base.qcow2"), "qcow2", "write -q -P 0x11 0 1M")
				extra = []string{"-b", "base.qcow2", "-F", "qcow2"}
			}
			dirtyLazyImage(t, filepath.Join(src, "a.qcow2"), extra...)
			qd, od := t.TempDir(), t.TempDir()
			for _, d := range []string{qd, od} {
				testutil.QemuImg(t, "create", "-q", "-f", "raw", filepath.Join(d, "s.raw"), "1M")
				testutil.QemuIO(t, filepath.Join(d, "s.raw"), "raw", "write -q -P 0x33 128k 64k")
				twin(t, filepath.Join(src, "a.qcow2"), d, "a.qcow2")
				if c.base {
					twin(t, filepath.Join(src, "base.qcow2"), d, "base.qcow2")
				}
			}
			q := qemuImg(t, qd, c.args...)
			o := ovisImg(t, od, c.args...)
			sameResult(t, c.name, q, o)
			for _, d := range []string{qd, od} {
				_, code := testutil.QemuImgExit(t, "check", filepath.Join(d, "a.qcow2"))
				if clean := code == 0; clean != c.clean {
					t.Errorf("%s: qemu-img check exits %d, want clean=%v", d, code, c.clean)
				}
			}
			if r, code := testutil.QemuImgExit(t, "compare", "-U", filepath.Join(qd, "a.qcow2"), filepath.Join(od, "a.qcow2")); code != 0 {
				t.Errorf("the twins read differently after %s: %s", c.name, r)
			}
			for _, d := range []string{qd, od} {
				info := testutil.ImageInfo(t, filepath.Join(d, "a.qcow2"))
				if dirty := info["dirty-flag"] == true; dirty == c.clean {
					t.Errorf("%s: dirty-flag %v after %s", d, dirty, c.name)
				}
			}
		})
	}
}

// TestReproMapDataFileRawLikeQemu: an image with data_file_raw=on maps
// the holes of its raw data file as data, as qemu-img map and qemu-nbd's
// block status do (only its zero clusters read as zeros), whichever tool
// created it.
func TestReproMapDataFileRawLikeQemu(t *testing.T) {
	t.Parallel()
	writes := []string{"write -q -P 1 64k 64k", "write -q -z 256k 64k", "write -q -P 2 512k 4k", "discard -q 768k 64k", "write -q -P 3 1000k 1k"}
	for _, creator := range []string{"qemu-img", "ovis"} {
		for _, opts := range []string{"", ",cluster_size=4096", ",extended_l2=on", ",preallocation=metadata", ",preallocation=falloc"} {
			// No comma in the name: it goes into t.TempDir()'s, and so into -o.
			name := creator + strings.ReplaceAll(opts, ",", "-")
			t.Run(name, func(t *testing.T) {
				dir := t.TempDir()
				args := []string{"create", "-q", "-f", "qcow2", "-o", "data_file=" + filepath.Join(dir, "d.raw") + ",data_file_raw=on" + opts, "x.qcow2", "1M"}
				if creator == "ovis" {
					mustOvisImg(t, dir, args...)
				} else if r := qemuImg(t, dir, args...); r.code != 0 {
					t.Fatalf("qemu-img create: %s", r.stderr)
				}
				p := filepath.Join(dir, "x.qcow2")
				for i := 0; i <= len(writes); i++ {
					if i > 0 {
						testutil.QemuIO(t, p, "qcow2", writes[i-1])
					}
					for _, out := range []string{"human", "json"} {
						args := []string{"map", "--output=" + out, "x.qcow2"}
						sameResult(t, name+" "+out, qemuImg(t, dir, args...), ovisImg(t, dir, args...))
					}
				}
				sameNBDMap(t, p)
			})
		}
	}
}

// TestReproConvertBackingTailLikeQemu: convert -B leaves the new target
// unallocated where the source reports zeros past the end of the target's
// backing file (qemu-img's target_backing_sectors), but writes zeros
// found in data there, and everything with -n; the targets map alike, and
// still read alike once the backing file grows data in that tail.
func TestReproConvertBackingTailLikeQemu(t *testing.T) {
	t.Parallel()
	type tc struct {
		name     string
		backFmt  string // the target's backing file: raw or qcow2
		backSize string
		backOpts string // -o of a qcow2 backing file
		backIO   []string
		srcFmt   string
		srcSize  string
		srcIO    []string
		outOpts  string
		flags    []string
		noCreate bool
		// srcOnBack: the source is an overlay of the backing file.
		srcOnBack bool
	}
	tail := []string{"write -q -P 0x61 0 4k", "write -q -z 100k 8k", "write -q -P 0 200k 64k", "write -q -P 0x62 300k 1k"}
	cases := []tc{
		{name: "issue", backFmt: "qcow2", backSize: "66048", backOpts: "cluster_size=2097152,extended_l2=on", backIO: []string{"write -q -P 0x4d 20480 40960"},
			srcFmt: "raw", srcSize: "327680", outOpts: "cluster_size=512"},
		{name: "raw-backing-shorter", backFmt: "raw", backSize: "64k", backIO: []string{"write -q -P 0x4d 0 64k"},
			srcFmt: "raw", srcSize: "1M", srcIO: tail},
		{name: "raw-backing-unaligned", backFmt: "raw", backSize: "66000", backIO: []string{"write -q -P 0x4d 0 66000"},
			srcFmt: "raw", srcSize: "1000000", srcIO: tail},
		{name: "qcow2-backing-shorter", backFmt: "qcow2", backSize: "96k", backIO: []string{"write -q -P 0x4d 32k 64k"},
			srcFmt: "qcow2", srcSize: "1M", srcIO: tail},
		{name: "backing-longer", backFmt: "qcow2", backSize: "2M", backIO: []string{"write -q -P 0x4d 0 2M"},
			srcFmt: "qcow2", srcSize: "1M", srcIO: tail},
		{name: "backing-empty", backFmt: "raw", backSize: "0",
			srcFmt: "qcow2", srcSize: "1M", srcIO: tail},
		{name: "extended-l2-subclusters", backFmt: "raw", backSize: "150k", backIO: []string{"write -q -P 0x4d 0 150k"},
			srcFmt: "qcow2", srcSize: "1M", srcIO: tail, outOpts: "extended_l2=on"},
		{name: "small-clusters-zero-clusters", backFmt: "qcow2", backSize: "130k", backOpts: "cluster_size=4096",
			srcFmt: "qcow2", srcSize: "1M", srcIO: []string{"write -q -P 0x61 0 1M", "write -q -z 64k 512k"}, outOpts: "cluster_size=4096"},
		{name: "compressed", backFmt: "raw", backSize: "100k", backIO: []string{"write -q -P 0x4d 0 100k"},
			srcFmt: "qcow2", srcSize: "1M", srcIO: tail, flags: []string{"-c"}},
		{name: "S0", backFmt: "raw", backSize: "100k", backIO: []string{"write -q -P 0x4d 0 100k"},
			srcFmt: "raw", srcSize: "1M", srcIO: tail, flags: []string{"-S", "0"}},
		{name: "no-create", backFmt: "raw", backSize: "64k", backIO: []string{"write -q -P 0x4d 0 64k"},
			srcFmt: "raw", srcSize: "1M", srcIO: tail, noCreate: true},
		{name: "no-create-qcow2", backFmt: "qcow2", backSize: "100k", backIO: []string{"write -q -P 0x4d 0 100k"},
			srcFmt: "qcow2", srcSize: "1M", srcIO: tail, noCreate: true, outOpts: "cluster_size=4096"},
		{name: "unaligned-source", backFmt: "raw", backSize: "70001", backIO: []string{"write -q -P 0x4d 0 70001"},
			srcFmt: "raw", srcSize: "777777", srcIO: append(tail, "write -q -P 0x70 777000 777")},
		{name: "compressed-qcow2-backing", backFmt: "qcow2", backSize: "160k", backOpts: "extended_l2=on", backIO: []string{"write -q -P 0x4d 0 160k"},
			srcFmt: "qcow2", srcSize: "1M", srcIO: tail, flags: []string{"-c"}, outOpts: "cluster_size=4096"},
		{name: "S0-qcow2", backFmt: "qcow2", backSize: "100k", backIO: []string{"write -q -P 0x4d 0 100k"},
			srcFmt: "qcow2", srcSize: "1M", srcIO: tail, flags: []string{"-S", "0"}, outOpts: "extended_l2=on"},
		{name: "S16k", backFmt: "raw", backSize: "100k", backIO: []string{"write -q -P 0x4d 0 100k"},
			srcFmt: "raw", srcSize: "1M", srcIO: tail, flags: []string{"-S", "16k"}, outOpts: "cluster_size=8192"},
		{name: "v2-target", backFmt: "raw", backSize: "100k", backIO: []string{"write -q -P 0x4d 0 100k"},
			srcFmt: "qcow2", srcSize: "1M", srcIO: tail, outOpts: "compat=0.10"},
		{name: "overlay-source", backFmt: "qcow2", backSize: "100k", backIO: []string{"write -q -P 0x4d 0 100k"},
			srcFmt: "qcow2", srcSize: "1M", srcIO: tail, srcOnBack: true},
		{name: "overlay-source-zero-clusters", backFmt: "raw", backSize: "200k", backIO: []string{"write -q -P 0x4d 0 200k"},
			srcFmt: "qcow2", srcSize: "1M", srcIO: []string{"write -q -z 0 1M", "write -q -P 0x61 500k 4k"}, srcOnBack: true, outOpts: "cluster_size=4096"},
		{name: "zeros-all-over", backFmt: "raw", backSize: "300k", backIO: []string{"write -q -P 0x4d 0 300k"},
			srcFmt: "qcow2", srcSize: "1M", srcIO: []string{"write -q -P 0x61 0 1M", "write -q -z 10k 500k", "write -q -P 0 600k 100k", "discard -q 800k 64k"}, outOpts: "cluster_size=16384"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			src := t.TempDir()
			back := "back." + c.backFmt
			args := []string{"create", "-q", "-f", c.backFmt}
			if c.backOpts != "" {
				args = append(args, "-o", c.backOpts)
			}
			testutil.QemuImg(t, append(args, filepath.Join(src, back), c.backSize)...)
			for _, cmd := range c.backIO {
				testutil.QemuIO(t, filepath.Join(src, back), c.backFmt, cmd)
			}
			in := "in." + c.srcFmt
			if c.srcOnBack {
				testutil.QemuImg(t, "create", "-q", "-f", c.srcFmt, "-b", back, "-F", c.backFmt, filepath.Join(src, in), c.srcSize)
			} else {
				testutil.QemuImg(t, "create", "-q", "-f", c.srcFmt, filepath.Join(src, in), c.srcSize)
			}
			for _, cmd := range c.srcIO {
				testutil.QemuIO(t, filepath.Join(src, in), c.srcFmt, cmd)
			}
			conv := append([]string{"convert", "-f", c.srcFmt, "-O", "qcow2", "-B", back, "-F", c.backFmt}, c.flags...)
			if c.outOpts != "" && !c.noCreate {
				conv = append(conv, "-o", c.outOpts)
			}
			if c.noCreate {
				conv = append(conv, "-n")
			}
			conv = append(conv, in, "out.qcow2")
			dirs := []string{t.TempDir(), t.TempDir()}
			for _, d := range dirs {
				twin(t, filepath.Join(src, back), d, back)
				twin(t, filepath.Join(src, in), d, in)
				if c.noCreate {
					args := []string{"create", "-q", "-f", "qcow2", "-b", back, "-F", c.backFmt}
					if c.outOpts != "" {
						args = append(args, "-o", c.outOpts)
					}
					if r := qemuImg(t, d, append(args, "out.qcow2", c.srcSize)...); r.code != 0 {
						t.Fatalf("qemu-img create: %s", r.stderr)
					}
				}
			}
			q := qemuImg(t, dirs[0], conv...)
			o := ovisImg(t, dirs[1], conv...)
			sameResult(t, "convert", q, o)
			if q.code != 0 {
				t.Fatalf("qemu-img convert exits %d: %s", q.code, q.stderr)
			}
			maps := make([]string, 2)
			for i, d := range dirs {
				p := filepath.Join(d, "out.qcow2")
				testutil.CheckImage(t, p)
				maps[i] = testutil.QemuImg(t, "map", "--output=json", p)
			}
			if maps[0] != maps[1] {
				t.Errorf("the targets map differently\nqemu-img: %s\n    ovis: %s", maps[0], maps[1])
			}
			// The backing file grows and fills: whatever was left to it
			// now shows through, in both targets alike.
			for _, d := range dirs {
				p := filepath.Join(d, back)
				testutil.QemuImg(t, "resize", "-q", "-f", c.backFmt, p, "2M")
				testutil.QemuIO(t, p, c.backFmt, "write -q -P 0x77 0 2M")
			}
			if out, code := testutil.QemuImgExit(t, "compare", filepath.Join(dirs[0], "out.qcow2"), filepath.Join(dirs[1], "out.qcow2")); code != 0 {
				t.Errorf("the targets read differently over the grown backing file: %s", out)
			}
		})
	}
}

var offsetRE = regexp.MustCompile(`, "offset": [0-9]+`)

// TestReproConvertZeroRunsLikeQemu: convert splits what it reads into
// data and zeros where qemu-img does (is_allocated_sectors_min): data
// ends rounded up to the -S alignment, zero runs shrunk to it, short zero
// runs inside data written as data; visible in outputs with small
// (sub)clusters.
func TestReproConvertZeroRunsLikeQemu(t *testing.T) {
	t.Parallel()
	src := t.TempDir()
	in := filepath.Join(src, "in.qcow2")
	testutil.QemuImg(t, "create", "-q", "-f", "qcow2", in, "1M")
	for _, cmd := range []string{
		"write -q -P 0 200k 64k", "write -q -P 0x62 300k 1k", "write -q -P 0x63 301k 512",
		"write -q -P 0x64 310k 512", "write -q -P 0x65 313k 1536", "write -q -P 0x66 330k 3k",
		"write -q -P 0x67 338k 512", "write -q -P 0x68 351k 512", "write -q -P 0x69 400k 100k",
		"write -q -P 0 420k 2560", "write -q -P 0 440k 8k", "write -q -P 0 460k 16k",
		"write -q -P 0x6a 1000k 24k",
	} {
		testutil.QemuIO(t, in, "qcow2", cmd)
	}
	for _, opts := range []string{"cluster_size=512", "cluster_size=2048", "cluster_size=4096", "extended_l2=on", "extended_l2=on,cluster_size=131072", "cluster_size=65536"} {
		for _, sparse := range []string{"", "0", "1k", "8k", "12k", "64k"} {
			name := strings.ReplaceAll(opts, ",", "-") + "/S" + sparse
			t.Run(name, func(t *testing.T) {
				args := []string{"convert", "-f", "qcow2", "-O", "qcow2", "-o", opts}
				if sparse != "" {
					args = append(args, "-S", sparse)
				}
				args = append(args, in)
				var maps []string
				for _, tool := range []string{"qemu-img", "ovis"} {
					out := filepath.Join(t.TempDir(), "out.qcow2")
					var r result
					if tool == "qemu-img" {
						r = qemuImg(t, "", append(args, out)...)
					} else {
						r = ovisImg(t, "", append(args, out)...)
					}
					if r.code != 0 {
						t.Fatalf("%s convert: exit %d: %s", tool, r.code, r.stderr)
					}
					testutil.CheckImage(t, out)
					if o, code := testutil.QemuImgExit(t, "compare", in, out); code != 0 {
						t.Errorf("%s's output differs from the source: %s", tool, o)
					}
					m := testutil.QemuImg(t, "map", "--output=json", out)
					if opts == "cluster_size=512" {
						// The host offsets differ there for a reason of the
						// engine's (where it puts new refcount blocks), not
						// of the copy's: compare the allocation alone.
						m = offsetRE.ReplaceAllString(m, "")
					}
					maps = append(maps, m)
				}
				if maps[0] != maps[1] {
					t.Errorf("the outputs map differently\nqemu-img: %s\n    ovis: %s", maps[0], maps[1])
				}
			})
		}
	}
}
