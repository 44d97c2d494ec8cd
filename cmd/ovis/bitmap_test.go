package main

import (
	"encoding/binary"
	"encoding/json"
	"os/exec"
	"path/filepath"
	"reflect"
	"regexp"
	"strings"
	"testing"

	"github.com/ovis-storage/ovis/internal/testutil"
)

var nodeNameRE = regexp.MustCompile(`to #block\d+:`)

// dirtyMap exports bitmap name of image (in dir) with qemu-nbd -B and
// returns nbdinfo's map of its dirty ranges: QEMU reads the bits.
func dirtyMap(t *testing.T, dir, image, name string) string {
	t.Helper()
	uri, stop := serveURI(t, dir, "qemu-nbd", "-r", "-f", "qcow2", "-B", name, image)
	defer stop()
	return runTool(t, "nbdinfo", "--map=qemu:dirty-bitmap:"+name, uri)
}

// bitmapList returns qemu-img info's list of the image's bitmaps.
func bitmapList(t *testing.T, path string) []any {
	t.Helper()
	var info struct {
		FormatSpecific struct {
			Data struct {
				Bitmaps []any `json:"bitmaps"`
			} `json:"data"`
		} `json:"format-specific"`
	}
	if err := json.Unmarshal([]byte(testutil.QemuImg(t, "info", "-U", "--output=json", path)), &info); err != nil {
		t.Fatal(err)
	}
	return info.FormatSpecific.Data.Bitmaps
}

// sameBitmaps requires two images to list the same bitmaps, with the same
// bits (as QEMU reads them), and ovis's image to be clean.
func sameBitmaps(t *testing.T, qdir, odir, image string) {
	t.Helper()
	ql, ol := bitmapList(t, filepath.Join(qdir, image)), bitmapList(t, filepath.Join(odir, image))
	if !reflect.DeepEqual(ql, ol) {
		t.Fatalf("bitmaps differ\nqemu-img: %v\n    ovis: %v", ql, ol)
	}
	for _, b := range ol {
		m := b.(map[string]any)
		name := m["name"].(string)
		if strings.Contains(toString(m["flags"]), "in-use") {
			continue // QEMU will not export an inconsistent bitmap
		}
		if q, o := dirtyMap(t, qdir, image, name), dirtyMap(t, odir, image, name); q != o {
			t.Errorf("bitmap %s: bits differ\nqemu: %s\novis: %s", name, q, o)
		}
	}
	testutil.CheckImage(t, filepath.Join(odir, image))
}

func toString(v any) string {
	b, _ := json.Marshal(v)
	return string(b)
}

// TestBitmapLikeQemu runs the same qemu-img bitmap commands with both
// tools on images whose bits QEMU set (qemu-io writes), and requires the
// same messages and exit codes at every step and, at the end, the same
// bitmaps with the same bits.
func TestBitmapLikeQemu(t *testing.T) {
	t.Parallel()
	qdir, odir := t.TempDir(), t.TempDir()
	for _, dir := range []string{qdir, odir} {
		for _, s := range []step{
			run("qemu-img", "create", "-q", "-f", "qcow2", "i.qcow2", "64M"),
			run("qemu-img", "create", "-q", "-f", "qcow2", "other.qcow2", "64M"),
			run("qemu-img", "bitmap", "--add", "-g", "8k", "other.qcow2", "o0"),
			run("qemu-io", "-f", "qcow2", "-c", "write -P 1 40M 100k", "other.qcow2"),
			run("qemu-img", "create", "-q", "-f", "qcow2", "-o", "compat=0.10", "v2.qcow2", "1M"),
			run("qemu-img", "create", "-q", "-f", "raw", "r.raw", "1M"),
		} {
			s(t, dir)
		}
	}
	steps := []string{
		"--add i.qcow2 b0",
		"--add -g 4k i.qcow2 b1",
		"--add --disable i.qcow2 b2",
		"--add -g 2M --disable --enable i.qcow2 b3",
		"qemu-io write -P 1 100k 10k",
		"qemu-io write -z 1M 300k",
		"qemu-io write -P 2 63M 1M",
		"--merge b1 i.qcow2 b2",
		"--merge o0 -b other.qcow2 -F qcow2 i.qcow2 b3",
		"--disable i.qcow2 b1",
		"qemu-io write -P 3 20M 64k",
		"--clear i.qcow2 b0",
		"qemu-io write -P 4 30M 5k",
		"--add --remove --add i.qcow2 z",
		"--remove i.qcow2 z",
		// Refusals.
		"--add i.qcow2 b0",
		"--remove i.qcow2 nosuch",
		"--clear i.qcow2 nosuch",
		"--enable i.qcow2 nosuch",
		"--merge b0 i.qcow2 nosuch",
		"--merge nosuch i.qcow2 b0",
		"--merge nosuch -b other.qcow2 i.qcow2 b0",
		"--add -g 1000 i.qcow2 b9",
		"--add -g 256 i.qcow2 b9",
		"--add -g 4G i.qcow2 b9",
		"i.qcow2 b0",
		"-g 4k --remove i.qcow2 b0",
		"-F qcow2 --merge b1 i.qcow2 b0",
		"-b other.qcow2 --add i.qcow2 b9",
		"--add i.qcow2",
		"--add missing.qcow2 b0",
		"--add -f raw r.raw b0",
		"--remove -f raw r.raw b0",
	}
	for _, s := range steps {
		if cmds, ok := strings.CutPrefix(s, "qemu-io "); ok {
			for _, dir := range []string{qdir, odir} {
				run("qemu-io", "-f", "qcow2", "-c", cmds, "i.qcow2")(t, dir)
			}
			continue
		}
		args := append([]string{"bitmap"}, strings.Fields(s)...)
		q := qemuImg(t, qdir, args...)
		// QEMU names a raw image by its node name.
		q.stderr = nodeNameRE.ReplaceAllString(q.stderr, "to r.raw:")
		sameResult(t, s, q, ovisImg(t, odir, args...))
	}
	sameBitmaps(t, qdir, odir, "i.qcow2")
	// A v2 image cannot hold bitmaps; QEMU names it by its node name.
	q, o := qemuImg(t, qdir, "bitmap", "--add", "v2.qcow2", "b0"), ovisImg(t, odir, "bitmap", "--add", "v2.qcow2", "b0")
	if q.code != 1 || o.code != 1 || !strings.Contains(o.stderr, "Cannot store dirty bitmaps in qcow2 v2 files") {
		t.Errorf("v2: qemu-img exits %d, ovis %d: %s", q.code, o.code, o.stderr)
	}
}

// TestBitmapTracksWrites writes the same ranges through qemu-nbd and
// ovis nbd into copies of an image with enabled and disabled bitmaps, and
// requires the same bits afterwards (QEMU reads them), after a resize
// too; and a server killed while writing leaves its enabled bitmaps
// flagged in-use, and the image otherwise clean.
func TestBitmapTracksWrites(t *testing.T) {
	t.Parallel()
	qdir, odir := t.TempDir(), t.TempDir()
	for _, dir := range []string{qdir, odir} {
		for _, s := range []step{
			run("qemu-img", "create", "-q", "-f", "qcow2", "i.qcow2", "64M"),
			run("qemu-io", "-f", "qcow2", "-c", "write -P 9 0 4M", "i.qcow2"),
			run("qemu-img", "bitmap", "--add", "i.qcow2", "b0"),
			run("qemu-img", "bitmap", "--add", "-g", "4k", "i.qcow2", "b1"),
			run("qemu-img", "bitmap", "--add", "--disable", "i.qcow2", "b2"),
			run("qemu-img", "bitmap", "--add", "-g", "512", "i.qcow2", "b3"),
		} {
			s(t, dir)
		}
	}
	writes := []string{"write -P 1 100k 10k", "write -z 1M 300k", "write -P 2 63M 1M", "write -P 3 70000 1", "aio_write -P 4 10M 4k", "aio_write -P 5 10M 64k", "aio_flush", "write -P 6 67108352 512"}
	for dir, bin := range map[string]string{qdir: "qemu-nbd", odir: ovisBin} {
		uri, stop := serveURI(t, dir, bin, "-f", "qcow2", "i.qcow2")
		qemuIONBD(t, uri, writes...)
		stop()
	}
	sameBitmaps(t, qdir, odir, "i.qcow2")

	// Growing keeps the bits and adds clear ones.
	testutil.QemuImg(t, "resize", filepath.Join(qdir, "i.qcow2"), "100M")
	mustOvisImg(t, odir, "resize", "i.qcow2", "100M")
	sameBitmaps(t, qdir, odir, "i.qcow2")

	// A server killed after writing: the enabled bitmaps say in-use.
	sock := filepath.Join(shortTempDir(t), "s.sock")
	uri := "nbd+unix:///?socket=" + sock
	cmd := exec.Command(ovisBin, "nbd", "-t", "-k", sock, "-f", "qcow2", "i.qcow2")
	cmd.Dir = odir
	stop := testutil.StartUntil(t, cmd, func() bool { return exec.Command("nbdinfo", "--size", uri).Run() == nil })
	qemuIONBD(t, uri, "write -P 7 90M 64k")
	cmd.Process.Kill()
	stop()
	for _, b := range bitmapList(t, filepath.Join(odir, "i.qcow2")) {
		m := b.(map[string]any)
		inUse := strings.Contains(toString(m["flags"]), "in-use")
		if want := m["name"] != "b2"; inUse != want {
			t.Errorf("after a crash, bitmap %v: flags %v, want in-use %v", m["name"], m["flags"], want)
		}
	}
	testutil.CheckImage(t, filepath.Join(odir, "i.qcow2"))
	// An in-use bitmap can only be removed, by either tool.
	for _, b := range []string{"b0", "b1", "b3"} {
		mustOvisImg(t, odir, "bitmap", "--remove", "i.qcow2", b)
	}
	if l := bitmapList(t, filepath.Join(odir, "i.qcow2")); len(l) != 1 {
		t.Fatalf("bitmaps left: %v", l)
	}
	testutil.CheckImage(t, filepath.Join(odir, "i.qcow2"))
}

// TestBitmapSnapshotApply requires applying an internal snapshot to mark
// every bit of the enabled bitmaps (any cluster may have changed), and
// leave a disabled one alone.
func TestBitmapSnapshotApply(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	for _, s := range []step{
		run("qemu-img", "create", "-q", "-f", "qcow2", "i.qcow2", "4M"),
		run("qemu-io", "-f", "qcow2", "-c", "write -P 1 0 64k", "i.qcow2"),
		run("qemu-img", "snapshot", "-c", "s1", "i.qcow2"),
		run("qemu-img", "bitmap", "--add", "i.qcow2", "b0"),
		run("qemu-img", "bitmap", "--add", "--disable", "i.qcow2", "b1"),
	} {
		s(t, dir)
	}
	mustOvisImg(t, dir, "snapshot", "-a", "s1", "i.qcow2")
	testutil.CheckImage(t, filepath.Join(dir, "i.qcow2"))
	if m := dirtyMap(t, dir, "i.qcow2", "b0"); !strings.Contains(m, "0     4194304    1  dirty") {
		t.Errorf("b0 after applying a snapshot:\n%s", m)
	}
	if m := dirtyMap(t, dir, "i.qcow2", "b1"); strings.Contains(m, "dirty") {
		t.Errorf("disabled b1 after applying a snapshot:\n%s", m)
	}
}

// TestBitmapCheckLikeQemu: bitmaps QEMU no longer trusts (a version 2
// image, after amend) leave their clusters as leaks for both tools'
// check, and check -r leaks frees them.
func TestBitmapCheckLikeQemu(t *testing.T) {
	t.Parallel()
	qdir, odir := t.TempDir(), t.TempDir()
	for _, dir := range []string{qdir, odir} {
		for _, s := range []step{
			run("qemu-img", "create", "-q", "-f", "qcow2", "i.qcow2", "4M"),
			run("qemu-img", "bitmap", "--add", "i.qcow2", "b0"),
			run("qemu-img", "amend", "-o", "compat=0.10", "i.qcow2"),
		} {
			s(t, dir)
		}
	}
	for _, args := range [][]string{{"check", "--output=json", "i.qcow2"}, {"check", "-r", "leaks", "i.qcow2"}, {"check", "i.qcow2"}} {
		sameResult(t, strings.Join(args, " "), qemuImg(t, qdir, args...), ovisImg(t, odir, args...))
	}
}

// TestNBDDirtyBitmapLikeQemu exports bitmaps with ovis nbd -B and
// qemu-nbd -B, read-only and writable, and requires nbdinfo to read the
// same qemu:dirty-bitmap contexts from both, including after a write
// through the writable export (which an enabled bitmap records at once),
// and qemu-nbd's refusals of a missing or inconsistent bitmap.
func TestNBDDirtyBitmapLikeQemu(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	for _, s := range []step{
		run("qemu-img", "create", "-q", "-f", "qcow2", "i.qcow2", "64M"),
		run("qemu-img", "bitmap", "--add", "i.qcow2", "b0"),
		run("qemu-img", "bitmap", "--add", "-g", "4k", "--disable", "i.qcow2", "b1"),
		run("qemu-io", "-f", "qcow2", "-c", "write -P 1 1M 100k", "i.qcow2"),
		run("qemu-img", "bitmap", "--enable", "i.qcow2", "b1"),
		run("qemu-io", "-f", "qcow2", "-c", "write -P 2 5M 10k", "-c", "write -P 3 40M 8M", "i.qcow2"),
		run("cp", "i.qcow2", "q.qcow2"),
		run("cp", "i.qcow2", "o.qcow2"),
	} {
		s(t, dir)
	}
	maps := func(uri string) string {
		var out string
		for _, b := range []string{"b0", "b1"} {
			out += b + ":\n" + runTool(t, "nbdinfo", "--map=qemu:dirty-bitmap:"+b, uri)
		}
		return out
	}
	for _, args := range [][]string{{"-r"}, {"-e", "2"}} {
		var got [2]string
		for i, bin := range []string{"qemu-nbd", ovisBin} {
			img := map[int]string{0: "q.qcow2", 1: "o.qcow2"}[i]
			uri, stop := serveURI(t, dir, bin, append(args, "-f", "qcow2", "-B", "b0", "-B", "b1", img)...)
			got[i] = maps(uri)
			if args[0] != "-r" {
				qemuIONBD(t, uri, "write -P 4 20M 70k")
				got[i] += maps(uri)
			}
			stop()
		}
		if got[0] != got[1] {
			t.Errorf("%v: maps differ\nqemu-nbd:\n%s\novis:\n%s", args, got[0], got[1])
		}
		if !strings.Contains(got[1], "dirty") {
			t.Errorf("%v: no dirty range in\n%s", args, got[1])
		}
		if args[0] != "-r" && !strings.Contains(got[1], "20971520") {
			t.Errorf("%v: the write at 20 MiB is not in\n%s", args, got[1])
		}
	}
	testutil.CheckImage(t, filepath.Join(dir, "o.qcow2"))

	// Bitmaps are found down the backing chain: under -s's overlay, and
	// in the backing file of a larger overlay (clean past its end).
	run("qemu-img", "create", "-q", "-f", "qcow2", "-b", "i.qcow2", "-F", "qcow2", "top.qcow2", "96M")(t, dir)
	for _, c := range []struct{ args []string }{
		{[]string{"-s", "i.qcow2"}},
		{[]string{"-r", "top.qcow2"}},
	} {
		var got [2]string
		for i, bin := range []string{"qemu-nbd", ovisBin} {
			uri, stop := serveURI(t, dir, bin, append([]string{"-f", "qcow2", "-B", "b0", "-B", "b1"}, c.args...)...)
			got[i] = maps(uri)
			if c.args[0] == "-s" {
				qemuIONBD(t, uri, "write -P 4 20M 70k")
				got[i] += maps(uri)
			}
			stop()
		}
		if got[0] != got[1] {
			t.Errorf("%v: maps differ\nqemu-nbd:\n%s\novis:\n%s", c.args, got[0], got[1])
		}
		if !strings.Contains(got[1], "dirty") || strings.Contains(got[1], "20971520") {
			t.Errorf("%v: want the base's dirty ranges and not the overlay's write in\n%s", c.args, got[1])
		}
	}

	// A missing bitmap, and one a crashed writer left in-use.
	run("cp", "i.qcow2", "bad.qcow2")(t, dir)
	setBitmapInUse(t, filepath.Join(dir, "bad.qcow2"), 0)
	strip := regexp.MustCompile(`(?m)^(qemu-nbd|ovis): `)
	for _, a := range [][]string{{"-B", "nosuch", "i.qcow2"}, {"-B", "b0", "bad.qcow2"}, {"-B", "b0", "-f", "raw", "i.qcow2"}} {
		a[len(a)-1] = filepath.Join(dir, a[len(a)-1])
		args := append([]string{"-r", "-k", filepath.Join(shortTempDir(t), "s.sock")}, a...)
		q := runBounded(t, "qemu-nbd", args...)
		o := runBounded(t, ovisBin, append([]string{"nbd"}, args...)...)
		if q.code != 1 || o.code != 1 || strip.ReplaceAllString(q.stderr, "") != strip.ReplaceAllString(o.stderr, "") {
			t.Errorf("%v: qemu-nbd exits %d (%q), ovis %d (%q)", a, q.code, q.stderr, o.code, o.stderr)
		}
	}
}

// TestInfoBitmapDirectoryLikeQemu damages the bitmap directory in the ways
// QEMU's bitmap_list_load refuses (and one it accepts) and requires
// ovis img info to answer as qemu-img info does.
func TestInfoBitmapDirectoryLikeQemu(t *testing.T) {
	t.Parallel()
	be := binary.BigEndian
	for _, c := range []struct {
		name  string
		patch func(ext, dir []byte, second int)
	}{
		{"undamaged", func(ext, dir []byte, second int) {}},
		{"granularity 2^40", func(ext, dir []byte, second int) { dir[second+17] = 40 }},
		{"granularity 2^8", func(ext, dir []byte, second int) { dir[17] = 8 }},
		{"unknown type", func(ext, dir []byte, second int) { dir[16] = 7 }},
		{"reserved flag", func(ext, dir []byte, second int) { dir[second+15] |= 4 }},
		{"table offset 0", func(ext, dir []byte, second int) { be.PutUint64(dir[second:], 0) }},
		{"table offset misaligned", func(ext, dir []byte, second int) { be.PutUint64(dir[0:], be.Uint64(dir[0:])+512) }},
		{"table past the end of the file", func(ext, dir []byte, second int) { be.PutUint64(dir[0:], 1<<32) }},
		{"table size 0", func(ext, dir []byte, second int) { be.PutUint32(dir[8:], 0) }},
		{"table too small", func(ext, dir []byte, second int) { dir[17] = 9 }},
		{"table too small but in use", func(ext, dir []byte, second int) { dir[17] = 9; dir[15] |= 1 }},
		{"extra data", func(ext, dir []byte, second int) { be.PutUint32(dir[20:], 8) }},
		{"entry past the directory", func(ext, dir []byte, second int) { be.PutUint16(dir[second+18:], 200) }},
		{"more bitmaps than the header says", func(ext, dir []byte, second int) { be.PutUint32(ext[0:], 1) }},
		{"fewer bitmaps than the header says", func(ext, dir []byte, second int) { be.PutUint32(ext[0:], 3) }},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			dir := t.TempDir()
			for _, s := range []step{
				run("qemu-img", "create", "-q", "-f", "qcow2", "i.qcow2", "64M"),
				run("qemu-img", "bitmap", "--add", "i.qcow2", "b0"),
				run("qemu-img", "bitmap", "--add", "-g", "1M", "--disable", "i.qcow2", "second"),
			} {
				s(t, dir)
			}
			patchBitmaps(t, filepath.Join(dir, "i.qcow2"), func(ext, d []byte) { c.patch(ext, d, bitmapEntryAt(d, 1)) })
			for _, args := range [][]string{{"info", "i.qcow2"}, {"info", "--output=json", "i.qcow2"}} {
				q, o := qemuImg(t, dir, args...), ovisImg(t, dir, args...)
				q.stdout = actualSizeRE.ReplaceAllString(q.stdout, "")
				o.stdout = actualSizeRE.ReplaceAllString(o.stdout, "")
				sameResult(t, strings.Join(args, " "), q, o)
			}
		})
	}
}
