package main

import (
	"bytes"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestImageOptsLikeQemuImg: ovis img verbs take --image-opts as qemu-img
// 7.2 does: the same output for option lists that name an image, and the
// same message and exit code for ones that are wrong.
func TestImageOptsLikeQemuImg(t *testing.T) {
	dir := t.TempDir()
	lockLayout(t, dir)
	q := func(rest string) string { return "driver=qcow2,file.filename=top.qcow2" + rest }
	for _, args := range [][]string{
		{"info", "--image-opts", q("")},
		{"info", "--image-opts", q(",file.driver=file,l2-cache-size=1M,cache.direct=on,cache.no-flush=off")},
		{"info", "--image-opts", "file.filename=top.qcow2"},
		{"info", "--image-opts", "driver=raw,file.filename=top.qcow2"},
		{"info", "--image-opts", q(",backing=null")},
		{"info", "--image-opts", q(",file.locking=off,node-name=n0")},
		{"info", "--image-opts", q(",read-only=on,force-share=on")},
		{"info", "--output=json", "--backing-chain", "--image-opts", q(",l2-cache-entry-size=4k")},
		{"check", "--image-opts", q(",refcount-cache-size=256k")},
		{"map", "--output=json", "--image-opts", q(",cache-size=1M")},
		{"compare", "--image-opts", q(""), "driver=qcow2,file.filename=base.qcow2"},
		{"measure", "-O", "qcow2", "--image-opts", q("")},
		{"snapshot", "-l", "--image-opts", q("")},
		// Wrong lists.
		{"info", "--image-opts", q(",foo=1")},
		{"info", "--image-opts", q(",file.foo=1")},
		{"info", "-f", "qcow2", "--image-opts", q("")},
		{"info", "--image-opts", "driver=qcow2,file.filename=missing.qcow2"},
		{"info", "--image-opts", "driver=qcow2"},
		{"info", "--image-opts", "driver=qcow2,file=top.qcow2"},
		{"info", "--image-opts", q(",l2-cache-size=abc")},
		{"info", "--image-opts", q(",read-only=maybe")},
		{"info", "--image-opts", "driver=vmdk2,file.filename=top.qcow2"},
		{"info", "--image-opts", q(",file.driver=nfs2")},
		{"info", "--image-opts", "driver=raw,file.filename=plain.raw,l2-cache-size=1M"},
		{"info", "--image-opts", ""},
		{"compare", "-F", "qcow2", "--image-opts", q(""), "driver=qcow2,file.filename=base.qcow2"},
		{"amend", "-o", "lazy_refcounts=off", "--image-opts", q("")},
		{"amend", "-f", "qcow2", "-o", "lazy_refcounts=off", "--image-opts", q("")},
		{"amend", "-o", "lazy_refcounts=off", "--image-opts", q(",foo=1")},
		{"amend", "-o", "lazy_refcounts=off", "--image-opts", "driver=raw,file.filename=plain.raw"},
		// -T, the cache mode of check's and compare's images.
		{"check", "-T", "none", "top.qcow2"},
		{"check", "-T", "directsync", "--output=json", "base.qcow2"},
		{"check", "-T", "foo", "top.qcow2"},
		{"compare", "-T", "none", "top.qcow2", "base.qcow2"},
		{"compare", "-T", "foo", "top.qcow2", "base.qcow2"},
		// Writing verbs refuse force-share; resize parses its own
		// arguments (a size may start with -). Last: it grows the image.
		{"commit", "--image-opts", q(",force-share=on")},
		{"snapshot", "-c", "s9", "--image-opts", q(",force-share=on")},
		{"resize", "--image-opts", q(",force-share=on"), "1G"},
		{"resize", "-f", "qcow2", "--image-opts", q(""), "1G"},
		{"resize", "--image-opts", q(",l2-cache-size=1M"), "1G"},
	} {
		sameResult(t, strings.Join(args, " "), qemuImg(t, dir, args...), ovisImg(t, dir, args...))
	}
}

// TestNBDImageOpts: ovis nbd --image-opts serves the image the list names
// with its options (cache sizes, read-only), and refuses wrong lists with
// qemu-nbd's message.
func TestNBDImageOpts(t *testing.T) {
	dir := shortTempDir(t)
	img := filepath.Join(dir, "i.qcow2")
	// 4 GiB, 64 KiB clusters: 8 L2 tables, so a 192 KiB L2 cache cannot
	// cover it and holds three.
	runTool(t, "qemu-img", "create", "-f", "qcow2", img, "4G")
	runTool(t, "qemu-io", "-f", "qcow2", "-c", "write -P 7 512M 64k", img)
	maddr := net.JoinHostPort("127.0.0.1", freePort(t))
	spec := "driver=qcow2,file.driver=file,file.filename=" + img +
		",cache.direct=on,l2-cache-size=192k,l2-cache-entry-size=64k,read-only=on"
	s := startNBD(t, nbdRun{args: []string{"-t", "--metrics", maddr, "--image-opts", spec}})
	if info := nbdinfo(t, s.uri).Exports[0]; !info.ReadOnly || info.Size != 4<<30 {
		t.Errorf("export: read-only %v, size %d; want read-only, 4 GiB", info.ReadOnly, info.Size)
	}
	runTool(t, "qemu-io", "-r", "-f", "raw", "-c", "read -P 7 512M 64k", "-c", "read -P 0 0 4k", s.uri)
	m := scrape(t, "http://"+maddr+"/metrics")
	if v := m[`ovis_qcow2_cache_capacity_entries{cache="l2",image="`+img+`"}`]; v != 3 {
		t.Errorf("L2 cache capacity %v entries, want 3 (l2-cache-size=192k)", v)
	}

	// Wrong lists, on an image nobody holds (QEMU takes the image's
	// locks before it reads the qcow2 options).
	img = filepath.Join(dir, "j.qcow2")
	runTool(t, "qemu-img", "create", "-f", "qcow2", img, "1M")

	sock := filepath.Join(dir, "bad.sock")
	for _, args := range [][]string{
		{"-f", "qcow2", "--image-opts", "driver=qcow2,file.filename=" + img},
		{"--image-opts", "driver=qcow2,file.filename=" + img + ",foo=1"},
		{"--image-opts", "driver=qcow2,file.filename=" + filepath.Join(dir, "missing.qcow2")},
		{"--image-opts", "driver=qcow2,file.filename=" + img + ",l2-cache-size=x"},
	} {
		args = append([]string{"-k", sock}, args...)
		q := runBounded(t, "qemu-nbd", args...)
		o := runBounded(t, ovisBin, append([]string{"nbd"}, args...)...)
		if q.code != 1 || o.code != 1 || nbdStderr(q.stderr) != nbdStderr(o.stderr) {
			t.Errorf("nbd %q:\nqemu-nbd: exit %d, %q\n    ovis: exit %d, %q", strings.Join(args, " "), q.code, q.stderr, o.code, o.stderr)
		}
	}
}

// TestNBDLoadSnapshot: ovis nbd -l exports an internal snapshot read-only
// with the same bytes and size as qemu-nbd -l, for every form of the
// parameter, and refuses what qemu-nbd refuses with its message.
func TestNBDLoadSnapshot(t *testing.T) {
	dir := shortTempDir(t)
	img := filepath.Join(dir, "s.qcow2")
	runTool(t, "qemu-img", "create", "-f", "qcow2", img, "1M")
	runTool(t, "qemu-io", "-f", "qcow2", "-c", "write -P 1 0 64k", "-c", "write -P 4 512k 4k", img)
	runTool(t, "qemu-img", "snapshot", "-c", "snap1", img)
	runTool(t, "qemu-img", "resize", img, "2M")
	runTool(t, "qemu-io", "-f", "qcow2", "-c", "write -P 2 0 64k", "-c", "write -P 3 1536k 64k", img)
	raw := filepath.Join(dir, "r.raw")
	runTool(t, "qemu-img", "create", "-f", "raw", raw, "1M")

	for _, l := range []string{"snap1", "1", "snapshot.name=snap1", "snapshot.id=1", "snapshot.id=1,snapshot.name=snap1"} {
		var got [2][]byte
		for i, bin := range []string{"qemu-nbd", ovisBin} {
			out := filepath.Join(dir, "out.raw")
			uri, stop := serveURI(t, dir, bin, "-f", "qcow2", "-l", l, img)
			if info := nbdinfo(t, uri).Exports[0]; !info.ReadOnly || info.Size != 2<<20 {
				t.Errorf("%s -l %s: read-only %v, size %d; want read-only, 2 MiB", bin, l, info.ReadOnly, info.Size)
			}
			runTool(t, "nbdcopy", uri, out)
			stop()
			data, err := os.ReadFile(out)
			if err != nil {
				t.Fatal(err)
			}
			got[i] = data
		}
		if !bytes.Equal(got[0], got[1]) {
			t.Errorf("-l %s: ovis exports other bytes than qemu-nbd", l)
		}
		if len(got[1]) != 2<<20 || got[1][0] != 1 || got[1][512<<10] != 4 || got[1][1536<<10] != 0 {
			t.Errorf("-l %s: the export is not the snapshot", l)
		}
	}

	sock := filepath.Join(dir, "bad.sock")
	for _, args := range [][]string{
		{"-f", "qcow2", "-l", "nosuch", img},
		{"-f", "qcow2", "-l", "snapshot.id=1,snapshot.name=other", img},
		{"-f", "qcow2", "-l", "snapshot.foo=1", img},
		{"-f", "qcow2", "-s", "-l", "snap1", img},
		{"-f", "raw", "-l", "snap1", raw},
	} {
		args = append([]string{"-k", sock}, args...)
		q := runBounded(t, "qemu-nbd", args...)
		o := runBounded(t, ovisBin, append([]string{"nbd"}, args...)...)
		if q.code != 1 || o.code != 1 || normStderr(strings.ReplaceAll(q.stderr, "qemu-nbd: ", "ovis: ")) != normStderr(o.stderr) {
			t.Errorf("nbd %q:\nqemu-nbd: exit %d, %q\n    ovis: exit %d, %q", strings.Join(args, " "), q.code, q.stderr, o.code, o.stderr)
		}
	}
}
