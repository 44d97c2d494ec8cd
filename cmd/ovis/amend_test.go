package main

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/ovis-storage/ovis/internal/twin"
)

// TestAmendMatchesQemu runs sequences of `amend` invocations with qemu-img
// and ovis on twin images. At every step both must print the same (the
// progress figures of -p included) and exit alike, and the images must
// then read alike (active layer and every snapshot), be described alike by
// qemu-img info --output=json, and check clean as ovis left them. A
// snapshot must also read as it did before the step: amend never changes
// what a snapshot holds.
//
// A step starting with "!" runs a qemu tool on both images instead (to
// take a snapshot or write between amendments). Steps are split as a shell
// would split them, single quotes included.
func TestAmendMatchesQemu(t *testing.T) {
	// Data, zero clusters (preallocated, plain and unmapped) and
	// compressed clusters, several of which share a host cluster.
	data := ioOn("a.qcow2", "write -P 1 0 2M", "write -z 1M 128k", "write -z 4M 64k",
		"write -z -u 1536k 64k", "write -c -P 3 8M 64k", "write -c -P 4 9M 1M")
	// The same without compressed clusters, whose shared host clusters
	// have refcounts that 1-bit refcounts cannot hold.
	plain := ioOn("a.qcow2", "write -P 1 0 2M", "write -z 1M 128k", "write -z 4M 64k", "write -z -u 1536k 64k")
	snapshot := run("qemu-img", "snapshot", "-c", "s1", "a.qcow2")
	tests := []struct {
		name  string
		setup func(t *testing.T, dir string)
		steps []string
		// qemuCorrupts marks sequences where qemu-img 7.2 leaves an image
		// that its own check reports as corrupt (it zeroes a cluster a
		// snapshot still reads, or sets COPIED on a shared one). ovis's
		// image must still check clean and keep the snapshot; it is not
		// compared with qemu-img's.
		qemuCorrupts bool
	}{
		{"usage", qemuCreateStep("-f qcow2 a.qcow2 32M", run("qemu-img", "create", "-q", "-f", "raw", "r.raw", "1M")), []string{
			"a.qcow2", "", "-o help a.qcow2", "-o ? a.qcow2", "-o help", "-f qcow2 -o help", "-f qcow2 -o help x y",
			"-f raw -o help", "-f foo -o help", "-o help r.raw", "-o compat=1.1 -o help a.qcow2", "-p -o help a.qcow2",
			"-o compat=1.1", "-o compat=1.1 a.qcow2 b.qcow2", "-o ,x a.qcow2", "-o compat=1.1, a.qcow2", "-o '' a.qcow2",
			"-t foo -o compat=1.1 a.qcow2", "-t none -q -o compat=1.1 a.qcow2", "--force -o compat=1.1 a.qcow2",
			"-x a.qcow2", "--foo a.qcow2", "a.qcow2 -o", "-o compat=1.1 nonexist", "-f qcow2 -o compat=1.1 r.raw",
			"-f foo -o compat=1.1 a.qcow2", "-f raw -o size=2M r.raw", "-o compat=1.1 r.raw", "-p -o foo=1 a.qcow2",
			"-p -q -o compat=1.1 a.qcow2", "-p -o compat=1.1 a.qcow2", "-o compat=1.1 -- a.qcow2",
		}, false},
		{"option errors", qemuCreateStep("-f qcow2 a.qcow2 32M", data), []string{
			"-o cluster_size=4k a.qcow2", "-o preallocation=metadata a.qcow2", "-o extended_l2=on a.qcow2",
			"-o compression_type=zstd a.qcow2", "-o encryption=on a.qcow2", "-o encrypt.format=luks a.qcow2",
			"-o cluster_size=4k,foo=1 a.qcow2", "-o cluster_size=xx a.qcow2", "-o compat=0.9,cluster_size=4k a.qcow2",
			"-o foo=bar a.qcow2", "-o nocow=on a.qcow2", "-o compat=0.9 a.qcow2", "-o compat= a.qcow2",
			"-o compat=0.9,refcount_bits=3 a.qcow2", "-o lazy_refcounts=maybe a.qcow2", "-o refcount_bits=3 a.qcow2",
			"-o refcount_bits=0 a.qcow2", "-o refcount_bits=128 a.qcow2", "-o refcount_bits=x a.qcow2",
			"-o size=1000 a.qcow2", "-o size=xx a.qcow2", "-o size=8E a.qcow2", "-o size=4P a.qcow2",
			"-o data_file=x a.qcow2", "-o data_file_raw=on a.qcow2", "-o data_file=x,refcount_bits=3 a.qcow2",
			"-o backing_file=x a.qcow2", "-o backing_fmt=raw a.qcow2", "-o encrypt.new-secret=x a.qcow2",
			"-o encrypt.keyslot=x a.qcow2", "-o encrypt.state=x,refcount_bits=3 a.qcow2",
			// Compressed clusters share host clusters.
			"-p -o refcount_bits=1 a.qcow2",
			// The steps before the failing one stay done.
			"-p -o refcount_bits=64,backing_file=x a.qcow2", "-o compat=0.10,lazy_refcounts=on a.qcow2",
			"-o compat=0.10,refcount_bits=64 a.qcow2", "-p -o compat=0.10 a.qcow2",
		}, false},
		// The snapshot shares every L2 table with the active layer.
		{"compat round trip", qemuCreateStep("-f qcow2 a.qcow2 32M", data, snapshot), []string{
			"-p -o compat=0.10 a.qcow2", "-o lazy_refcounts=on a.qcow2", "-o refcount_bits=8 a.qcow2",
			"-o size=64M a.qcow2", "-p -o compat=1.1 a.qcow2", "!qemu-io -c 'write -z 2M 128k' a.qcow2",
			"-o compat=v2 a.qcow2", "-o compat=v3,lazy_refcounts=on a.qcow2",
		}, false},
		// Writes after the snapshot copied the L2 table, so preallocated
		// zero clusters of the active layer and the snapshot share host
		// clusters.
		{"compat round trip after writes", qemuCreateStep("-f qcow2 a.qcow2 32M", data, snapshot,
			ioOn("a.qcow2", "write -P 5 0 64k", "write -z 10M 64k", "write -z -u 9M 64k")), []string{
			"-p -o compat=0.10 a.qcow2", "-o compat=1.1 a.qcow2", "-o compat=0.10 a.qcow2",
		}, true},
		{"compat with backing file", func(t *testing.T, dir string) {
			qemuCreate("-f qcow2 b.qcow2 32M", ioOn("b.qcow2", "write -P 9 0 16M"))(t, dir)
			qemuCreate("-f qcow2 -b b.qcow2 -F qcow2 a.qcow2", data,
				ioOn("a.qcow2", "write -z 12M 64k", "write -z -u 13M 64k"), snapshot)(t, dir)
		}, []string{
			"-o backing_file=b.qcow2 a.qcow2", "-o backing_fmt=qcow2 a.qcow2",
			"-o backing_file=b.qcow2,backing_fmt=qcow2 a.qcow2", "-o backing_file=./b.qcow2,backing_fmt=qcow2 a.qcow2",
			"-p -o compat=0.10 a.qcow2", "-o compat=1.1 a.qcow2",
		}, false},
		{"v2 image", qemuCreateStep("-f qcow2 -o compat=0.10 a.qcow2 32M", data, snapshot), []string{
			"-o lazy_refcounts=on a.qcow2", "-o refcount_bits=16 a.qcow2", "-o refcount_bits=8 a.qcow2",
			"-o data_file_raw=off a.qcow2", "-p -o compat=1.1,refcount_bits=64 a.qcow2", "-o compat=0.10 a.qcow2",
			"-p -o compat=0.10,refcount_bits=16 a.qcow2",
		}, false},
		{"refcount widths", qemuCreateStep("-f qcow2 a.qcow2 32M", plain), []string{
			"-p -o refcount_bits=64 a.qcow2", "-p -o refcount_bits=1 a.qcow2", "-o refcount_bits=16 a.qcow2",
			"!qemu-img snapshot -c s a.qcow2", "-o refcount_bits=64 a.qcow2", "-p -o refcount_bits=1 a.qcow2",
			"-o refcount_bits=2 a.qcow2", "-o refcount_bits=16 a.qcow2",
		}, false},
		{"lazy refcounts", qemuCreateStep("-f qcow2 a.qcow2 32M", data), []string{
			"-o lazy_refcounts=on a.qcow2", "!qemu-io -c 'write -P 6 5M 64k' a.qcow2", "-o nolazy_refcounts a.qcow2",
			"-o lazy_refcounts a.qcow2", "-o lazy_refcounts=on -o lazy_refcounts=off a.qcow2",
		}, false},
		{"data file", qemuCreateStep("-f qcow2 -o data_file=a.data a.qcow2 32M", plain, run("cp", "a.data", "b.data")), []string{
			"-o data_file=b.data a.qcow2", "-o data_file_raw=on a.qcow2", "-o compat=0.10 a.qcow2",
			"-o refcount_bits=1 a.qcow2", "-o size=64M a.qcow2", "-o data_file=a.data,data_file_raw=off a.qcow2",
		}, false},
		{"raw data file", qemuCreateStep("-f qcow2 -o data_file=a.data,data_file_raw=on a.qcow2 4M",
			ioOn("a.qcow2", "write -P 1 0 2M")), []string{
			"-o data_file_raw=on a.qcow2", "-o size=8M a.qcow2", "-o data_file_raw=off a.qcow2", "-o size=12M a.qcow2",
		}, false},
		{"downgrade extended l2", qemuCreateStep("-f qcow2 -o extended_l2=on a.qcow2 32M", plain), []string{
			"-o compat=0.10 a.qcow2", "-p -o refcount_bits=64 a.qcow2",
		}, false},
		{"downgrade zstd", qemuCreateStep("-f qcow2 -o compression_type=zstd a.qcow2 32M", plain), []string{
			"-p -o compat=0.10 a.qcow2",
		}, false},
		{"downgrade zstd compressed", qemuCreateStep("-f qcow2 -o compression_type=zstd a.qcow2 32M", data), []string{
			"-p -o compat=0.10 a.qcow2",
		}, false},
		{"size", qemuCreateStep("-f qcow2 a.qcow2 32M", data, snapshot, ioOn("a.qcow2", "write -P 7 0 64k")), []string{
			"-o size=64M a.qcow2", "-o size=20M a.qcow2", "-o compat=0.10 a.qcow2", "-o size=1M a.qcow2",
			"-o size=32M,lazy_refcounts=on a.qcow2", "-o size=256M a.qcow2", "-o size=4P a.qcow2",
		}, false},
		{"zero written after snapshot", qemuCreateStep("-f qcow2 a.qcow2 32M",
			ioOn("a.qcow2", "write -P 7 0 128k", "write -P 8 3M 64k"), snapshot,
			ioOn("a.qcow2", "write -z 0 64k", "write -z -u 3M 64k", "write -z 5M 64k")), []string{
			"-p -o compat=0.10 a.qcow2",
		}, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			qdir, odir := twinDirs(t, tt.setup)
			// before is what ovis's snapshots read now (nil: not known
			// yet), and compared the bytes of both folders when they
			// last passed sameAmended. A step that starts and ends on
			// that state byte for byte (most usage and option errors)
			// would compare the same files again, with ten or more
			// qemu-img runs: it is not compared twice. Its messages and
			// exit code still are.
			var before map[string]string
			compared := ""
			for _, s := range tt.steps {
				if strings.HasPrefix(s, "!") {
					amendBoth(t, qdir, odir, s)
					before = nil
					continue
				}
				if before == nil {
					before = snapshotContents(t, odir, "a.qcow2")
				}
				was := dirsFingerprint(t, qdir, odir)
				amendBoth(t, qdir, odir, s)
				now := dirsFingerprint(t, qdir, odir)
				if was == compared && now == compared {
					continue
				}
				before = sameAmended(t, qdir, odir, "a.qcow2", s, before, tt.qemuCorrupts)
				if !t.Failed() {
					compared = now
				}
			}
		})
	}
}

// TestAmendRemovesDataFileName covers -o data_file= (an empty name), after
// which neither tool can open the image for I/O: only the messages and
// the header (as qemu-img info shows it) are compared.
func TestAmendRemovesDataFileName(t *testing.T) {
	t.Parallel()
	qdir, odir := twinDirs(t, qemuCreateStep("-f qcow2 -o data_file=a.data a.qcow2 4M", ioOn("a.qcow2", "write -P 1 0 1M")))
	amendBoth(t, qdir, odir, "-o data_file= a.qcow2")
	q, o := infoJSON(t, qdir, "a.qcow2"), infoJSON(t, odir, "a.qcow2")
	if q != o {
		t.Errorf("qemu-img info differs\nqemu-img's: %s\n    ovis's: %s", q, o)
	}
	if strings.Contains(o, `"data-file"`) {
		t.Errorf("the data file is still named: %s", o)
	}
}

// ioOn returns a step that runs qemu-io commands on an image.
func ioOn(image string, cmds ...string) step {
	var args []string
	for _, c := range cmds {
		args = append(args, "-c", c)
	}
	return run("qemu-io", append(args, image)...)
}

// amendBoth runs one step in both folders: `qemu-img amend` and `ovis img
// amend` with the same arguments, which must print the same and exit
// alike, or (with a leading "!") a qemu tool on both.
func amendBoth(t *testing.T, qdir, odir, s string) {
	t.Helper()
	if tool, ok := strings.CutPrefix(s, "!"); ok {
		a := splitQuoted(tool)
		run(a[0], a[1:]...)(t, qdir)
		run(a[0], a[1:]...)(t, odir)
		return
	}
	args := append([]string{"amend"}, splitQuoted(s)...)
	q, o := qemuImg(t, qdir, args...), ovisImg(t, odir, args...)
	// The hint names the tool to use instead.
	q.stderr = strings.ReplaceAll(q.stderr, "'qemu-img rebase'", "'ovis img rebase'")
	sameResult(t, "amend "+s, q, o)
}

// splitQuoted splits s at spaces, as a shell does, keeping what single
// quotes enclose (which may be empty) as one argument.
func splitQuoted(s string) []string {
	var out []string
	var cur strings.Builder
	quoted, inArg := false, false
	for _, r := range s {
		switch {
		case r == '\'':
			quoted, inArg = !quoted, true
		case r == ' ' && !quoted:
			if inArg {
				out = append(out, cur.String())
				cur.Reset()
			}
			inArg = false
		default:
			cur.WriteRune(r)
			inArg = true
		}
	}
	if inArg {
		out = append(out, cur.String())
	}
	return out
}

// sameAmended compares the image name as qemu-img (in qdir) and ovis (in
// odir) left it after step; before holds raw copies of what ovis's
// snapshots read before the step. It returns those of after the step.
func sameAmended(t *testing.T, qdir, odir, name, step string, before map[string]string, qemuCorrupts bool) map[string]string {
	t.Helper()
	if q, o := infoJSON(t, qdir, name), infoJSON(t, odir, name); q != o {
		t.Errorf("after amend %s: qemu-img info differs\nqemu-img's: %s\n    ovis's: %s", step, q, o)
	}
	// One qemu-img compare, or a convert of each image in its own
	// folder, where QEMU looks for its external data file
	// (twin.GuestMismatch).
	if d := twin.GuestMismatch(t, qdir, odir, name); d != "" {
		t.Errorf("after amend %s: the images read differently: %s", step, d)
	}
	oc := qemuImg(t, odir, "check", "-U", name)
	if oc.code != 0 {
		t.Errorf("after amend %s: qemu-img check of ovis's image: exit %d\n%s%s", step, oc.code, oc.stdout, oc.stderr)
	}
	if qc := qemuImg(t, qdir, "check", "-U", name); !qemuCorrupts && qc.code != oc.code {
		t.Errorf("after amend %s: qemu-img check exits %d on ovis's image, %d on qemu-img's", step, oc.code, qc.code)
	}
	after := snapshotContents(t, odir, name)
	if len(after) != len(before) {
		t.Errorf("after amend %s: %d snapshots, %d before", step, len(after), len(before))
	}
	theirs := map[string]string{}
	if !qemuCorrupts {
		theirs = snapshotContents(t, qdir, name)
	}
	same := func(a, b string) bool {
		return a != "" && b != "" && twin.RawMismatch(t, a, b) == ""
	}
	for id, raw := range after {
		// qemu-img convert -l shows a snapshot at the image's current
		// size, which the step may have changed: compare what both show.
		if !samePrefix(t, raw, before[id]) {
			t.Errorf("after amend %s: snapshot %s reads differently than before", step, id)
		}
		if !qemuCorrupts && !same(raw, theirs[id]) {
			t.Errorf("after amend %s: snapshot %s reads differently than qemu-img's", step, id)
		}
	}
	return after
}

// dirsFingerprint returns a SHA-256 of the names and bytes of the regular
// files in the folders dirs, in order.
func dirsFingerprint(t *testing.T, dirs ...string) string {
	t.Helper()
	h := sha256.New()
	for _, dir := range dirs {
		ents, err := os.ReadDir(dir)
		if err != nil {
			t.Fatalf("fingerprint of %s: %v", dir, err)
		}
		fmt.Fprintf(h, "dir %d\n", len(ents))
		for _, e := range ents {
			if !e.Type().IsRegular() {
				continue
			}
			// Mapped rather than read: the race detector accounts
			// every byte a read fills in Go's memory.
			f, err := os.Open(filepath.Join(dir, e.Name()))
			if err != nil {
				t.Fatalf("fingerprint of %s: %v", dir, err)
			}
			fi, err := f.Stat()
			if err != nil {
				f.Close()
				t.Fatalf("fingerprint of %s: %v", dir, err)
			}
			fmt.Fprintf(h, "%q %d\n", e.Name(), fi.Size())
			if fi.Size() > 0 {
				b, err := unix.Mmap(int(f.Fd()), 0, int(fi.Size()), unix.PROT_READ, unix.MAP_SHARED)
				if err != nil {
					f.Close()
					t.Fatalf("fingerprint of %s: map %s: %v", dir, e.Name(), err)
				}
				h.Write(b)
				unix.Munmap(b)
			}
			f.Close()
		}
	}
	return hex.EncodeToString(h.Sum(nil))
}

// samePrefix reports whether two files hold the same bytes up to the end
// of the shorter; a missing name ("") never matches.
func samePrefix(t *testing.T, a, b string) bool {
	t.Helper()
	if a == "" || b == "" {
		return false
	}
	an, bn, at := twin.FirstFileDiff(t, a, b)
	return at < 0 || at == min(an, bn)
}

// infoJSON returns `qemu-img info --output=json` of an image as one line,
// without what depends on the layout or the clock: the disk size and the
// time snapshots were taken.
func infoJSON(t *testing.T, dir, name string) string {
	t.Helper()
	r := qemuImg(t, dir, "info", "-U", "--output=json", name)
	if r.code != 0 {
		t.Fatalf("qemu-img info %s: %s", name, r.stderr)
	}
	var info map[string]any
	if err := json.Unmarshal([]byte(r.stdout), &info); err != nil {
		t.Fatalf("qemu-img info %s: %v", name, err)
	}
	delete(info, "actual-size")
	if snaps, ok := info["snapshots"].([]any); ok {
		for _, s := range snaps {
			if m, ok := s.(map[string]any); ok {
				delete(m, "date-sec")
				delete(m, "date-nsec")
			}
		}
	}
	b, err := json.Marshal(info) // maps marshal with sorted keys
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// snapshotContents converts every internal snapshot of an image to a raw
// file and returns their paths by snapshot ID.
func snapshotContents(t *testing.T, dir, name string) map[string]string {
	t.Helper()
	r := qemuImg(t, dir, "info", "-U", "--output=json", name)
	var info struct {
		Snapshots []struct {
			ID string `json:"id"`
		} `json:"snapshots"`
	}
	if err := json.Unmarshal([]byte(r.stdout), &info); err != nil {
		t.Fatalf("qemu-img info %s: %v\n%s", name, err, r.stderr)
	}
	out := map[string]string{}
	for _, s := range info.Snapshots {
		raw := filepath.Join(t.TempDir(), "snap.raw")
		if r := qemuImg(t, dir, "convert", "-U", "-l", "snapshot.id="+s.ID, "-O", "raw", name, raw); r.code != 0 {
			t.Fatalf("qemu-img convert -l snapshot.id=%s %s: %s", s.ID, name, r.stderr)
		}
		out[s.ID] = raw
	}
	return out
}
