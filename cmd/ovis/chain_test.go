package main

import (
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/ovis-storage/ovis/internal/twin"
)

// threeDeep builds base ← mid.qcow2 ← top.qcow2 with data, zeros and a
// compressed cluster in every layer; the top is larger than the base.
// baseFmt is raw or qcow2, topOpts the top's -o options, and other.qcow2
// is an unrelated image to rebase onto.
func threeDeep(baseFmt, topOpts string) func(t *testing.T, dir string) {
	return func(t *testing.T, dir string) {
		t.Helper()
		base := "base." + baseFmt
		topArgs := []string{"create", "-q", "-f", "qcow2", "-b", "mid.qcow2", "-F", "qcow2"}
		if topOpts != "" {
			topArgs = append(topArgs, "-o", topOpts)
		}
		for _, s := range []step{
			run("qemu-img", "create", "-q", "-f", baseFmt, base, "16M"),
			run("qemu-io", "-f", baseFmt, "-c", "write -P 1 0 4M", "-c", "write -P 6 15M 1M", base),
			run("qemu-img", "create", "-q", "-f", "qcow2", "-b", base, "-F", baseFmt, "mid.qcow2"),
			run("qemu-io", "-f", "qcow2", "-c", "write -P 2 2M 4M", "-c", "write -z 9M 100k", "-c", "write -z 0 64k",
				"-c", "write -c -P 7 12M 64k", "mid.qcow2"),
			run("qemu-img", append(topArgs, "top.qcow2", "20M")...),
			run("qemu-io", "-f", "qcow2", "-c", "write -P 3 5M 2M", "-c", "write -z 1M 512k", "-c", "write -P 4 17M 1M",
				"-c", "write -P 5 1000000 3000", "top.qcow2"),
			run("qemu-img", "create", "-q", "-f", "qcow2", "other.qcow2", "20M"),
			run("qemu-io", "-f", "qcow2", "-c", "write -P 1 0 3M", "-c", "write -P 8 12M 100k", "other.qcow2"),
		} {
			s(t, dir)
		}
	}
}

var chainFiles = []string{"top.qcow2", "mid.qcow2", "other.qcow2"}

// TestCommitMatchesQemu commits three-deep chains with both tools on twin
// copies: into the immediate backing file (emptying the top or not),
// into the base through -b, from the middle; and requires the same output
// and exit code, and every image of the chain reading, checking and
// described alike afterwards.
func TestCommitMatchesQemu(t *testing.T) {
	for _, base := range []string{"raw", "qcow2"} {
		for _, tt := range []struct{ name, args string }{
			{"into backing", "top.qcow2"},
			{"keep top", "-d top.qcow2"},
			{"into base", "-b base.BASE top.qcow2"},
			{"into mid with -b", "-b mid.qcow2 top.qcow2"},
			{"middle into base", "mid.qcow2"},
			{"quiet", "-q top.qcow2"},
			{"unknown base", "-b nonexist top.qcow2"},
			{"base is the image", "-b top.qcow2 top.qcow2"},
			{"no backing file", "-f BASE base.BASE"},
			{"missing image", "nonexist"},
			{"no image", ""},
		} {
			t.Run(base+"/"+tt.name, func(t *testing.T) {
				t.Parallel()
				qdir, odir := twinFixture(t, "three-deep-"+base, threeDeep(base, ""))
				args := append([]string{"commit"}, strings.Fields(strings.ReplaceAll(tt.args, "BASE", base))...)
				bothRun(t, qdir, odir, args)
				sameImages(t, qdir, odir, append(chainFiles, "base."+base)...)
			})
		}
	}
	// Tops that cannot be rebuilt afresh (v2, snapshots, bitmaps, a data
	// file) are emptied in place, cluster by cluster, as QEMU does.
	for _, tt := range []struct {
		opts  string
		extra []string // a qemu-img command run first
	}{
		{"cluster_size=4k", nil},
		{"extended_l2=on", nil},
		{"compat=0.10,cluster_size=128k", nil},
		{"lazy_refcounts=on,refcount_bits=2", nil},
		{"", []string{"snapshot", "-c", "s1", "top.qcow2"}},
		{"extended_l2=on", []string{"snapshot", "-c", "s1", "top.qcow2"}},
		{"", []string{"bitmap", "--add", "top.qcow2", "b0"}},
		{"data_file=top.data", nil},
	} {
		name := "top " + tt.opts + " " + strings.Join(tt.extra, " ")
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			qdir, odir := twinDirs(t, func(t *testing.T, dir string) {
				threeDeep("qcow2", tt.opts)(t, dir)
				if tt.extra != nil {
					run("qemu-img", tt.extra...)(t, dir)
					// Data written after the snapshot or bitmap too.
					run("qemu-io", "-f", "qcow2", "-c", "write -P 9 6M 1M", "top.qcow2")(t, dir)
				}
			})
			bothRun(t, qdir, odir, []string{"commit", "top.qcow2"})
			sameImages(t, qdir, odir, append(chainFiles, "base.qcow2")...)
			m := []string{"map", "--output=json", "-U", "top.qcow2"}
			q, o := qemuImg(t, qdir, m...), qemuImg(t, odir, m...)
			if q, o := ownRuns(q.stdout), ownRuns(o.stdout); q != o || o != "" {
				t.Errorf("top.qcow2 is not emptied alike\nqemu-img's own runs: %s\n    ovis's: %s", q, o)
			}
			if c := qemuImg(t, odir, "check", "top.qcow2"); c.code != 0 {
				t.Errorf("qemu-img check after ovis's commit: exit %d\n%s", c.code, c.stdout)
			}
			if tt.extra != nil && tt.extra[0] == "snapshot" {
				// The snapshot still reads as it did.
				raws := [2]string{}
				for i, d := range []string{qdir, odir} {
					raws[i] = filepath.Join(d, "s1.raw")
					if r := qemuImg(t, d, "convert", "-U", "-l", "s1", "-O", "raw", "top.qcow2", raws[i]); r.code != 0 {
						t.Fatalf("qemu-img convert -l s1: %s", r.stderr)
					}
				}
				if d := twin.RawMismatch(t, raws[0], raws[1]); d != "" {
					t.Errorf("snapshot s1 reads differently: %s", d)
				}
			}
		})
	}
}

// TestRebaseMatchesQemu rebases three-deep chains with both tools on twin
// copies: onto an image further down the chain, onto an unrelated image,
// onto nothing, unsafely, and with errors; and requires the same output
// and exit code, and every image reading, checking and described alike.
func TestRebaseMatchesQemu(t *testing.T) {
	for _, base := range []string{"raw", "qcow2"} {
		for _, tt := range []struct {
			name string
			args []string
		}{
			{"onto base", []string{"-b", "base.BASE", "-F", "BASE", "top.qcow2"}},
			{"onto mid", []string{"-b", "mid.qcow2", "-F", "qcow2", "top.qcow2"}},
			{"onto other", []string{"-b", "other.qcow2", "-F", "qcow2", "top.qcow2"}},
			{"mid onto other", []string{"-b", "other.qcow2", "-F", "qcow2", "mid.qcow2"}},
			{"onto nothing", []string{"-b", "", "top.qcow2"}},
			{"mid onto nothing", []string{"-b", "", "mid.qcow2"}},
			{"progress", []string{"-p", "-b", "base.BASE", "-F", "BASE", "top.qcow2"}},
			{"unsafe", []string{"-u", "-b", "other.qcow2", "-F", "qcow2", "top.qcow2"}},
			{"unsafe onto nothing", []string{"-u", "-b", "", "top.qcow2"}},
			{"no format", []string{"-b", "base.BASE", "top.qcow2"}},
			{"unsafe no format", []string{"-u", "-b", "x", "top.qcow2"}},
			{"bad format", []string{"-b", "base.BASE", "-F", "foo", "top.qcow2"}},
			{"missing backing", []string{"-b", "nonexist", "-F", "qcow2", "top.qcow2"}},
			{"no -b", []string{"top.qcow2"}},
			{"raw image", []string{"-f", "BASE", "-b", "other.qcow2", "-F", "qcow2", "base.BASE"}},
		} {
			t.Run(base+"/"+tt.name, func(t *testing.T) {
				t.Parallel()
				qdir, odir := twinFixture(t, "three-deep-"+base, threeDeep(base, ""))
				args := []string{"rebase"}
				for _, a := range tt.args {
					args = append(args, strings.ReplaceAll(a, "BASE", base))
				}
				// The progress figures follow each tool's own steps.
				bothRun(t, qdir, odir, args, progressRE)
				names := []string{"mid.qcow2", "other.qcow2", "base." + base}
				if !strings.HasPrefix(tt.name, "unsafe") {
					names = append(names, "top.qcow2") // an unsafe rebase may leave it unreadable
				}
				sameImages(t, qdir, odir, names...)
				for _, d := range []string{qdir, odir} {
					warmDir(t, d)
				}
				// What the top holds itself must be alike, in the same
				// places of the file.
				m := []string{"map", "--output=json", "-U", "top.qcow2"}
				q, o := qemuImg(t, qdir, m...), qemuImg(t, odir, m...)
				if q, o := ownRuns(q.stdout), ownRuns(o.stdout); q != o {
					t.Errorf("top.qcow2 maps differently\nqemu-img's: %s\n    ovis's: %s", q, o)
				}
			})
		}
	}
}

// progressRE matches QEMU's progress figures, for -p runs.
var progressRE = regexp.MustCompile(`(    \(\d+\.\d\d/100%\)\r)+`)

// ownRuns keeps the lines of a JSON map that describe the image's own
// layer (depth 0).
func ownRuns(m string) string {
	var b strings.Builder
	for _, l := range strings.Split(m, "\n") {
		if strings.Contains(l, `"depth": 0,`) {
			b.WriteString(strings.TrimSuffix(strings.TrimPrefix(l, "["), ","))
			b.WriteByte('\n')
		}
	}
	return b.String()
}
