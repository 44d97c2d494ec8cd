package main

import (
	"encoding/binary"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ovis-storage/ovis/internal/testutil"
)

// convertInputs makes, in dir, the sources of the convert tests below:
// a.raw (1 MiB of data), odd.raw (100000 bytes, not a whole number of
// sectors), s.qcow2 (snapshot "snap1" taken after a first write, then
// more writes that the snapshot does not see), bad.qcow2 (compressed,
// with one cluster's deflate stream destroyed) and t.qcow2 (an empty
// 2 MiB image to convert into).
func convertInputs(t *testing.T, dir string) {
	t.Helper()
	fromFixture(t, "convert-inputs", buildConvertInputs, dir)
}

// buildConvertInputs makes convertInputs' files in dir, which tests share
// (sharedFixture): twelve qemu tool runs per folder otherwise.
func buildConvertInputs(t *testing.T, dir string) {
	t.Helper()
	data := make([]byte, 1<<20)
	for i := range data {
		data[i] = byte(i/4096 + 1)
	}
	for _, f := range []struct {
		name string
		b    []byte
	}{{"a.raw", data}, {"odd.raw", data[:100000]}} {
		if err := os.WriteFile(filepath.Join(dir, f.name), f.b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	for _, s := range []step{
		run("qemu-img", "create", "-q", "-f", "qcow2", "s.qcow2", "1M"),
		run("qemu-io", "-f", "qcow2", "-c", "write -P 7 0 64k", "s.qcow2"),
		run("qemu-img", "snapshot", "-c", "snap1", "s.qcow2"),
		run("qemu-io", "-f", "qcow2", "-c", "write -P 9 0 64k", "-c", "write -P 5 512k 128k", "s.qcow2"),
		run("qemu-img", "convert", "-c", "-O", "qcow2", "a.raw", "bad.qcow2"),
		run("qemu-img", "create", "-q", "-f", "qcow2", "t.qcow2", "2M"),
		run("qemu-img", "create", "-q", "-f", "qcow2", "bm.qcow2", "4M"),
		run("qemu-img", "bitmap", "--add", "bm.qcow2", "b0"),
		run("qemu-img", "bitmap", "--add", "-g", "4k", "--disable", "bm.qcow2", "b1"),
		run("qemu-io", "-f", "qcow2", "-c", "write -P 1 1M 100k", "bm.qcow2"),
		run("qemu-img", "bitmap", "--enable", "bm.qcow2", "b1"),
		run("qemu-io", "-f", "qcow2", "-c", "write -P 2 3M 10k", "bm.qcow2"),
	} {
		s(t, dir)
	}
	corruptCompressedCluster(t, filepath.Join(dir, "bad.qcow2"), 3)
	// bad-bm.qcow2: bm.qcow2 whose b0 a writer left in-use.
	b, err := os.ReadFile(filepath.Join(dir, "bm.qcow2"))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "bad-bm.qcow2"), b, 0o644); err != nil {
		t.Fatal(err)
	}
	setBitmapInUse(t, filepath.Join(dir, "bad-bm.qcow2"), 0)
}

// setBitmapInUse sets the in-use flag of entry i of a qcow2 image's bitmap
// directory, as a writer that crashed leaves it.
func setBitmapInUse(t *testing.T, path string, i int) {
	t.Helper()
	patchBitmaps(t, path, func(_, dir []byte) {
		e := dir[bitmapEntryAt(dir, i):]
		binary.BigEndian.PutUint32(e[12:], binary.BigEndian.Uint32(e[12:])|1)
	})
}

// bitmapEntryAt is the offset of entry i in a bitmap directory.
func bitmapEntryAt(dir []byte, i int) int {
	be := binary.BigEndian
	q := 0
	for range i {
		q += (24 + int(be.Uint32(dir[q+20:])) + int(be.Uint16(dir[q+18:])) + 7) &^ 7
	}
	return q
}

// patchBitmaps lets f edit, in place, the data of the bitmaps header
// extension (24 bytes: count, reserved, directory size and offset) and
// the bitmap directory of the qcow2 image at path.
func patchBitmaps(t *testing.T, path string, f func(ext, dir []byte)) {
	t.Helper()
	file, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer file.Close()
	head := make([]byte, 4096)
	if _, err := file.ReadAt(head, 0); err != nil {
		t.Fatal(err)
	}
	be := binary.BigEndian
	for p := int(be.Uint32(head[100:])); p+8 <= len(head); {
		typ, n := be.Uint32(head[p:]), int(be.Uint32(head[p+4:]))
		if typ == 0 {
			break
		}
		if typ == 0x23852875 {
			ext := head[p+8 : p+8+24]
			dirSize, dirOff := be.Uint64(ext[8:]), int64(be.Uint64(ext[16:]))
			dir := make([]byte, dirSize)
			if _, err := file.ReadAt(dir, dirOff); err != nil {
				t.Fatal(err)
			}
			f(ext, dir)
			if _, err := file.WriteAt(dir, dirOff); err != nil {
				t.Fatal(err)
			}
			if _, err := file.WriteAt(ext, int64(p+8)); err != nil {
				t.Fatal(err)
			}
			return
		}
		p += 8 + (n+7)&^7
	}
	t.Fatalf("%s has no bitmaps extension", path)
}

// corruptCompressedCluster overwrites the start of the deflate stream of
// guest cluster i of a qcow2 image with 64 KiB clusters whose first L2
// table maps it to a compressed cluster.
func corruptCompressedCluster(t *testing.T, path string, i int) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	u64 := func(off int64) uint64 {
		var b [8]byte
		if _, err := f.ReadAt(b[:], off); err != nil {
			t.Fatal(err)
		}
		return binary.BigEndian.Uint64(b[:])
	}
	l1 := u64(40)
	l2 := u64(int64(l1)) & 0x00fffffffffffe00
	entry := u64(int64(l2) + 8*int64(i))
	if entry&(1<<62) == 0 {
		t.Fatalf("cluster %d of %s is not compressed (L2 entry %#x)", i, path, entry)
	}
	host := entry & (1<<54 - 1) // 62 - (cluster_bits - 8) offset bits
	if _, err := f.WriteAt([]byte(strings.Repeat("\xff", 64)), int64(host)); err != nil {
		t.Fatal(err)
	}
}

// TestConvertOptionsLikeQemu runs qemu-img convert and ovis img convert on
// the same inputs with the options of several sources (concatenation),
// internal snapshots (-l), -q, copy offloading (-C), rate limits (-r)
// and --target-image-opts, and requires the same messages and exit codes,
// and outputs with the same content (qemu-img compare); ovis's qcow2
// outputs must pass qemu-img check.
func TestConvertOptionsLikeQemu(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name, args string
		out        string // the output file; "" when the args fail
	}{
		{"concatenate raw", "-O raw a.raw odd.raw s.qcow2 out", "out"},
		{"concatenate to qcow2", "-O qcow2 odd.raw s.qcow2 a.raw out", "out"},
		{"concatenate compressed", "-c -O qcow2 odd.raw s.qcow2 a.raw out", "out"},
		{"concatenate out of order", "-W -m 3 -O qcow2 a.raw odd.raw a.raw out", "out"},
		{"concatenate no sparse", "-S 0 -O raw odd.raw odd.raw out", "out"},
		{"concatenate with -B", "-O qcow2 -B a.raw -F raw a.raw odd.raw out", ""},
		{"concatenate with -o backing_file", "-O qcow2 -o backing_file=a.raw,backing_fmt=raw a.raw odd.raw out", ""},
		{"concatenate into existing with -B", "-n -B a.raw -O qcow2 a.raw odd.raw t.qcow2", ""},
		{"snapshot by name", "-O raw -l snap1 s.qcow2 out", "out"},
		{"snapshot by ID", "-O qcow2 -l 1 s.qcow2 out", "out"},
		{"snapshot option form", "-O qcow2 -l snapshot.id=1,snapshot.name=snap1 s.qcow2 out", "out"},
		{"snapshot option form, first of two", "-O raw -l snapshot.name=snap1 s.qcow2 a.raw out", "out"},
		{"snapshot name with two sources", "-O raw -l snap1 s.qcow2 a.raw out", ""},
		{"snapshot missing", "-O raw -l nosuch s.qcow2 out", ""},
		{"snapshot ID and name of two snapshots", "-O raw -l snapshot.id=2,snapshot.name=snap1 s.qcow2 out", ""},
		{"snapshot of raw", "-O raw -l snap1 a.raw out", ""},
		{"snapshot bad parameter", "-O raw -l snapshot.x=1 s.qcow2 out", ""},
		{"quiet with progress", "-q -p -O qcow2 a.raw out", "out"},
		{"copy offloading raw", "-C -O raw odd.raw out", "out"},
		{"copy offloading concatenated", "-C -O raw a.raw odd.raw out", "out"},
		{"copy offloading from qcow2", "-C -O raw s.qcow2 out", "out"},
		{"copy offloading to qcow2", "-C -O qcow2 a.raw out", "out"},
		{"copy offloading and -c", "-C -c -O qcow2 a.raw out", ""},
		{"copy offloading and -S", "-C -S 0 -O raw a.raw out", ""},
		{"copy offloading and --salvage", "-C --salvage -O raw a.raw out", ""},
		{"rate limit", "-r 1G -O qcow2 a.raw out", "out"},
		{"rate limit bad", "-r 1X -O raw a.raw out", ""},
		{"target image opts", "-n --target-image-opts a.raw driver=qcow2,file.filename=t.qcow2", "t.qcow2"},
		{"target image opts probing", "-n --target-image-opts -p -m 2 s.qcow2 file.filename=t.qcow2", "t.qcow2"},
		{"target image opts without -n", "--target-image-opts a.raw driver=qcow2,file.filename=t.qcow2", ""},
		{"target image opts with -O", "-n -O qcow2 --target-image-opts a.raw driver=qcow2,file.filename=t.qcow2", ""},
		{"target image opts bad", "-n --target-image-opts a.raw driver=qcow2,file.filename=t.qcow2,foo=1", ""},
		{"target image opts missing file", "-n --target-image-opts a.raw driver=qcow2,file.filename=nonexist", ""},
		{"-o with -n", "-n -o cluster_size=4k -O qcow2 a.raw t.qcow2", ""},
		{"compressed writethrough", "-t writethrough -c -O qcow2 a.raw out", "out"},
		{"copy offloading directsync", "-t directsync -C -O raw a.raw out", "out"},
		// --bitmaps: s.qcow2 has none, bm.qcow2 two (one disabled, both
		// with bits), bad-bm.qcow2 an inconsistent one.
		{"bitmaps", "--bitmaps -O qcow2 bm.qcow2 out", "out"},
		{"bitmaps none", "--bitmaps -O qcow2 s.qcow2 out", "out"},
		{"bitmaps writethrough", "-t writethrough --bitmaps -W -O qcow2 bm.qcow2 out", "out"},
		{"bitmaps skip broken", "--bitmaps --skip-broken-bitmaps -O qcow2 bad-bm.qcow2 out", "out"},
		{"bitmaps broken", "--bitmaps -O qcow2 bad-bm.qcow2 out", ""},
		{"skip broken without bitmaps", "--skip-broken-bitmaps -O qcow2 bm.qcow2 out", ""},
		{"bitmaps concatenated", "--bitmaps -O qcow2 bm.qcow2 a.raw out", ""},
		{"bitmaps from raw", "--bitmaps -O qcow2 a.raw out", ""},
		{"bitmaps to raw", "--bitmaps -O raw bm.qcow2 out", ""},
		{"bitmaps to v2", "--bitmaps -O qcow2 -o compat=0.10 bm.qcow2 out", ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			qdir, odir := t.TempDir(), t.TempDir()
			convertInputs(t, qdir)
			convertInputs(t, odir)
			args := append([]string{"convert"}, strings.Fields(tt.args)...)
			q, o := qemuImg(t, qdir, args...), ovisImg(t, odir, args...)
			// -p prints qemu-img's progress lines on stdout, compared too.
			sameResult(t, strings.Join(args, " "), q, o)
			if tt.out == "" {
				if q.code == 0 {
					t.Fatal("qemu-img succeeded; the test expects a failure")
				}
				return
			}
			if q.code != 0 {
				t.Fatalf("qemu-img failed: %s", q.stderr)
			}
			qo, oo := filepath.Join(qdir, tt.out), filepath.Join(odir, tt.out)
			testutil.QemuImg(t, "compare", "-q", qo, oo)
			if strings.Contains(tt.args, "--bitmaps") {
				sameBitmaps(t, qdir, odir, tt.out)
			}
			if info := testutil.QemuImg(t, "info", "-U", oo); strings.Contains(info, "file format: qcow2") {
				testutil.CheckImage(t, oo)
			}
			qs, err1 := os.Stat(qo)
			ostat, err2 := os.Stat(oo)
			if err1 != nil || err2 != nil {
				t.Fatal(err1, err2)
			}
			if strings.Contains(tt.args, "-O raw") && qs.Size() != ostat.Size() {
				t.Errorf("raw output of %d bytes; qemu-img's has %d", ostat.Size(), qs.Size())
			}
		})
	}
}

var salvageRE = regexp.MustCompile(`(?m)^(?:qemu-img|ovis): warning: error while reading offset (\d+): `)

// TestConvertSalvage converts an image with an unreadable compressed
// cluster: without --salvage both tools fail; with it both write zeros in
// its place and the same output, warn once for each of the same sectors,
// and -q silences the warnings.
func TestConvertSalvage(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	convertInputs(t, dir)
	q := qemuImg(t, dir, "convert", "-O", "raw", "bad.qcow2", "q.raw")
	o := ovisImg(t, dir, "convert", "-O", "raw", "bad.qcow2", "o.raw")
	if q.code != 1 || o.code != 1 || !strings.Contains(o.stderr, "error while reading at byte") {
		t.Fatalf("without --salvage: qemu-img exits %d, ovis %d: %s", q.code, o.code, o.stderr)
	}
	for _, w := range []string{"-W", "-m 1", "-c -O qcow2"} {
		t.Run(w, func(t *testing.T) {
			args := append(strings.Fields(w), "--salvage")
			if !strings.Contains(w, "-O") {
				args = append(args, "-O", "raw")
			}
			q := qemuImg(t, dir, append(append([]string{"convert"}, args...), "bad.qcow2", "q-"+w)...)
			o := ovisImg(t, dir, append(append([]string{"convert"}, args...), "bad.qcow2", "o-"+w)...)
			if q.code != 0 || o.code != 0 {
				t.Fatalf("--salvage: qemu-img exits %d, ovis %d: %s", q.code, o.code, o.stderr)
			}
			offsets := func(s string) []string {
				var out []string
				for _, m := range salvageRE.FindAllStringSubmatch(s, -1) {
					out = append(out, m[1])
				}
				slices.Sort(out)
				return out
			}
			qw, ow := offsets(q.stderr), offsets(o.stderr)
			if len(qw) != 128 || !slices.Equal(qw, ow) {
				t.Fatalf("warnings at %d sectors, qemu-img's at %d:\n%s", len(ow), len(qw), o.stderr)
			}
			testutil.QemuImg(t, "compare", "-q", filepath.Join(dir, "q-"+w), filepath.Join(dir, "o-"+w))
		})
	}
	o = ovisImg(t, dir, "convert", "-q", "--salvage", "-O", "raw", "bad.qcow2", "quiet.raw")
	if o.code != 0 || o.stderr != "" {
		t.Fatalf("-q --salvage: exit %d, stderr %q", o.code, o.stderr)
	}
	testutil.QemuImg(t, "compare", "-q", filepath.Join(dir, "q--W"), filepath.Join(dir, "quiet.raw"))
}

// TestConvertRateLimit requires -r to hold the writes to its rate: 3 MiB
// at 4 MiB/s take at least half a second, in order or not.
func TestConvertRateLimit(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	data := make([]byte, 3<<20)
	for i := range data {
		data[i] = byte(i>>9 + 1)
	}
	if err := os.WriteFile(filepath.Join(dir, "src"), data, 0o644); err != nil {
		t.Fatal(err)
	}
	for _, args := range []string{"-O raw", "-W -O qcow2", "-c -O qcow2"} {
		start := time.Now()
		mustOvisImg(t, dir, append(append([]string{"convert", "-r", "4M"}, strings.Fields(args)...), "src", "dst")...)
		if d := time.Since(start); d < 500*time.Millisecond {
			t.Errorf("%s: 3 MiB at 4 MiB/s took %v", args, d)
		}
		testutil.QemuImg(t, "compare", "-q", filepath.Join(dir, "src"), filepath.Join(dir, "dst"))
	}
}

// TestCommitRateLimit requires commit -r to hold the copy to its rate (2
// MiB at 4 MiB/s take at least 400 ms) and to refuse a bad rate as
// qemu-img does.
func TestCommitRateLimit(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	for _, s := range []step{
		run("qemu-img", "create", "-q", "-f", "qcow2", "base.qcow2", "8M"),
		run("qemu-img", "create", "-q", "-f", "qcow2", "-b", "base.qcow2", "-F", "qcow2", "top.qcow2"),
		run("qemu-io", "-f", "qcow2", "-c", "write -P 3 1M 2M", "top.qcow2"),
	} {
		s(t, dir)
	}
	sameResult(t, "commit -r 1X", qemuImg(t, dir, "commit", "-r", "1X", "top.qcow2"), ovisImg(t, dir, "commit", "-r", "1X", "top.qcow2"))
	start := time.Now()
	mustOvisImg(t, dir, "commit", "-d", "-r", "4M", "top.qcow2")
	if d := time.Since(start); d < 400*time.Millisecond {
		t.Errorf("2 MiB at 4 MiB/s took %v", d)
	}
	testutil.QemuImg(t, "compare", "-q", filepath.Join(dir, "top.qcow2"), filepath.Join(dir, "base.qcow2"))
	testutil.CheckImage(t, filepath.Join(dir, "base.qcow2"))
}
