package main

import (
	"encoding/binary"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/ovis-storage/ovis/internal/testutil"
	"github.com/ovis-storage/ovis/internal/twin"
)

// untrustedLayout makes the folder an untrusted image lives in (dir, in
// root) and a host file outside it that the image must not reach (secret,
// 64 KiB of "s").
func untrustedLayout(t *testing.T) (root, dir, secret string) {
	t.Helper()
	root = shortTempDir(t)
	dir = filepath.Join(root, "images")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	secret = filepath.Join(root, "secret.raw")
	if err := os.WriteFile(secret, []byte(strings.Repeat("s", 1<<16)), 0o600); err != nil {
		t.Fatal(err)
	}
	return root, dir, secret
}

// TestUntrustedFlag: with --untrusted, ovis img and ovis nbd refuse an
// image whose backing file lies outside its folder (here: a "secret" next
// to the folder, reached by an absolute name, by ../ and by a symlink),
// and name the file and the reason; an image whose backing file is inside
// the folder still works. Without the flag, QEMU's behaviour stays: the
// image opens.
func TestUntrustedFlag(t *testing.T) {
	root, dir, secret := untrustedLayout(t)
	if err := os.Symlink(secret, filepath.Join(dir, "link.raw")); err != nil {
		t.Fatal(err)
	}
	runTool(t, "qemu-img", "create", "-f", "raw", filepath.Join(dir, "base.raw"), "64k")

	for _, c := range []struct {
		name, backing string
		refused       bool
	}{
		{"inside", "base.raw", false},
		{"absolute", secret, true},
		{"escape", "../secret.raw", true},
		{"symlink", "link.raw", true},
	} {
		t.Run(c.name, func(t *testing.T) {
			img := filepath.Join(dir, c.name+".qcow2")
			runTool(t, "qemu-img", "create", "-f", "qcow2", "-u", "-b", c.backing, "-F", "raw", img, "64k")
			out := filepath.Join(root, c.name+".out")
			for _, args := range [][]string{
				{"img", "--untrusted", "convert", "-f", "qcow2", "-O", "raw", img, out},
				{"img", "info", "--untrusted", "-f", "qcow2", "--backing-chain", img},
				{"img", "--untrusted", "compare", "-f", "qcow2", "-F", "raw", img, filepath.Join(dir, "base.raw")},
				{"nbd", "--untrusted", "-f", "qcow2", "-k", filepath.Join(root, "s.sock"), img},
			} {
				if !c.refused && args[0] == "nbd" {
					continue // it would serve; the trusted runs below cover opening
				}
				r := ovis(t, dir, args...)
				if !c.refused {
					if r.code != 0 {
						t.Errorf("ovis %s: exit %d\n%s", strings.Join(args, " "), r.code, r.stderr)
					}
					continue
				}
				if r.code == 0 || !strings.Contains(r.stderr, "not allowed for an untrusted image") {
					t.Errorf("ovis %s: exit %d, want a refusal naming the reason\n%s", strings.Join(args, " "), r.code, r.stderr)
				}
			}
			if c.refused {
				// Trusted (the default): QEMU's behaviour, the chain opens.
				if r := ovis(t, dir, "img", "convert", "-O", "raw", img, out); r.code != 0 {
					t.Errorf("trusted convert: exit %d\n%s", r.code, r.stderr)
				}
			}
		})
	}
}

// probeRefusal is what --untrusted says instead of probing an image's
// format.
const probeRefusal = "the image format must be given (-f FMT): probing the format is not allowed for an untrusted image"

// TestUntrustedRefusesProbing: the classic attack is a raw guest disk
// whose first sector holds a qcow2 header naming a host file as its
// backing file; probed, it reads as qcow2 and exposes the host file. With
// --untrusted, every verb and ovis nbd refuse to open an image without a
// format, naming the file; given -f raw, they treat it as the raw disk it
// is, as qemu-img -f raw does.
func TestUntrustedRefusesProbing(t *testing.T) {
	t.Parallel()
	root, dir, secret := untrustedLayout(t)
	// The guest disk: a qcow2 header pointing at the secret.
	disk := filepath.Join(dir, "disk.img")
	runTool(t, "qemu-img", "create", "-q", "-f", "qcow2", "-b", secret, "-F", "raw", disk, "64k")
	other := filepath.Join(dir, "other.raw")
	runTool(t, "qemu-img", "create", "-q", "-f", "raw", other, "64k")

	for _, args := range [][]string{
		{"img", "--untrusted", "info", disk},
		{"img", "--untrusted", "info", "--backing-chain", "--output=json", disk},
		{"img", "--untrusted", "map", disk},
		{"img", "--untrusted", "check", disk},
		{"img", "--untrusted", "measure", "-O", "qcow2", disk},
		{"img", "--untrusted", "compare", "-F", "raw", disk, other},
		{"img", "--untrusted", "convert", "-O", "raw", disk, filepath.Join(root, "out.raw")},
		{"img", "--untrusted", "bench", "-c", "1", disk},
		// qemu-img snapshot takes no -f: an untrusted image cannot be
		// given one, so it is refused rather than probed.
		{"img", "--untrusted", "snapshot", "-l", disk},
		{"nbd", "--untrusted", "-k", filepath.Join(root, "s.sock"), disk},
	} {
		what := "ovis " + strings.Join(args, " ")
		r := ovis(t, dir, args...)
		if r.code != openFailureCode(args) || !strings.Contains(r.stderr, "'"+disk+"'") || !strings.Contains(r.stderr, probeRefusal) {
			t.Errorf("%s: exit %d, want %d naming the file and saying %q\n%s%s", what, r.code, openFailureCode(args), probeRefusal, r.stdout, r.stderr)
		}
	}

	// With -f raw the disk is raw for both tools.
	for _, a := range []string{
		"info -f raw --output=json DISK",
		"info -f raw --backing-chain DISK",
		"map -f raw --output=json DISK",
		"check -f raw DISK",
		"measure -f raw -O qcow2 DISK",
		"compare -f raw -F raw DISK OTHER",
	} {
		args := strings.Fields(strings.NewReplacer("DISK", disk, "OTHER", other).Replace(a))
		q := qemuImg(t, dir, args...)
		o := ovis(t, dir, append([]string{"img", "--untrusted"}, args...)...)
		q.stdout = actualSizeRE.ReplaceAllString(q.stdout, "")
		o.stdout = actualSizeRE.ReplaceAllString(o.stdout, "")
		sameResult(t, "--untrusted "+a, q, o)
	}
	qout, oout := filepath.Join(root, "q.raw"), filepath.Join(root, "o.raw")
	runTool(t, "qemu-img", "convert", "-f", "raw", "-O", "raw", disk, qout)
	if r := ovis(t, dir, "img", "--untrusted", "convert", "-f", "raw", "-O", "raw", disk, oout); r.code != 0 {
		t.Fatalf("ovis img --untrusted convert -f raw: exit %d\n%s", r.code, r.stderr)
	}
	if qn, on, at := twin.FirstFileDiff(t, qout, oout); at >= 0 {
		t.Errorf("convert -f raw: outputs differ (%d bytes from qemu-img, %d from ovis) from byte %d", qn, on, at)
	}
	s := startNBD(t, nbdRun{args: []string{"--untrusted", "-f", "raw", "-r", disk}})
	if out, code := testutil.QemuImgExit(t, "compare", "-f", "raw", "-F", "raw", disk, s.uri); code != 0 {
		t.Errorf("qemu-img compare of the disk and ovis nbd --untrusted -f raw: exit %d\n%s", code, out)
	}

	// Trusted (the default) keeps QEMU's behaviour: probed as qcow2.
	q := qemuImg(t, dir, "info", "--output=json", disk)
	o := ovisImg(t, dir, "info", "--output=json", disk)
	if o.code != 0 || !strings.Contains(o.stdout, `"format": "qcow2"`) {
		t.Errorf("trusted ovis img info: exit %d, want the probed qcow2\n%s%s", o.code, o.stdout, o.stderr)
	}
	sameJSONFields(t, "trusted info", actualSizeRE.ReplaceAllString(q.stdout, ""), actualSizeRE.ReplaceAllString(o.stdout, ""))
}

// openFailureCode is the exit status of ovis args when the image does
// not open: 1, but 2 for compare, as qemu-img's.
func openFailureCode(args []string) int {
	if slices.Contains(args, "compare") {
		return 2
	}
	return 1
}

// dropBackingFormat turns the backing format extension of a qcow2 v3
// image into an unknown extension, which QEMU and ovis skip: the image
// then names its backing file without a format, as images of old QEMUs
// do (qemu-img 7.2 no longer creates them).
func dropBackingFormat(t *testing.T, path string) {
	t.Helper()
	p := patchQcow2(t, path)
	off := uint64(binary.BigEndian.Uint32(p.read(100, 4)))
	for {
		typ := binary.BigEndian.Uint32(p.read(int64(off), 4))
		n := uint64(binary.BigEndian.Uint32(p.read(int64(off)+4, 4)))
		switch typ {
		case 0:
			t.Fatalf("%s: no backing format extension", path)
		case 0xe2792aca:
			p.put32(off, 0x6f766973) // "ovis"
			return
		}
		off += 8 + (n+7)&^7
	}
}

// TestUntrustedRefusesBackingWithoutFormat: with --untrusted, an image
// whose header names a backing file but not its format is refused
// wherever the backing file would be opened (and its format probed),
// with the backing file named; info, which does not open it, still
// describes the image as qemu-img does. Recording the format (rebase -u
// -F) makes it open; trusted, it opens as it does in QEMU.
func TestUntrustedRefusesBackingWithoutFormat(t *testing.T) {
	t.Parallel()
	root := shortTempDir(t)
	top := filepath.Join(root, "top.qcow2")
	runTool(t, "qemu-img", "create", "-q", "-f", "raw", filepath.Join(root, "base.raw"), "64k")
	runTool(t, "qemu-img", "create", "-q", "-f", "qcow2", "-b", "base.raw", "-F", "raw", top, "64k")
	dropBackingFormat(t, top)
	if q := qemuImg(t, root, "info", "--output=json", top); q.code != 0 || !strings.Contains(q.stdout, `"backing-filename": "base.raw"`) || strings.Contains(q.stdout, "backing-filename-format") {
		t.Fatalf("qemu-img info after dropping the backing format: exit %d\n%s%s", q.code, q.stdout, q.stderr)
	}
	out := filepath.Join(root, "out.raw")
	cases := []struct {
		args    string
		refused bool
	}{
		{"img --untrusted convert -f qcow2 -O raw TOP OUT", true},
		{"img --untrusted info -f qcow2 --backing-chain TOP", true},
		{"img --untrusted map -f qcow2 TOP", true},
		{"img --untrusted compare -f qcow2 -F raw TOP BASE", true},
		{"img --untrusted check -f qcow2 TOP", true},
		{"nbd --untrusted -f qcow2 -k SOCK TOP", true},
		// info alone opens no backing file, so it probes nothing.
		{"img --untrusted info -f qcow2 TOP", false},
		// Trusted: QEMU's behaviour, the backing file is probed.
		{"img convert -f qcow2 -O raw TOP OUT", false},
		{"img info --backing-chain TOP", false},
	}
	repl := strings.NewReplacer("TOP", top, "OUT", out, "BASE", filepath.Join(root, "base.raw"), "SOCK", filepath.Join(root, "s.sock"))
	for _, c := range cases {
		args := strings.Fields(repl.Replace(c.args))
		r := ovis(t, root, args...)
		switch {
		case c.refused && (r.code != openFailureCode(args) || !strings.Contains(r.stderr, "base.raw") || !strings.Contains(r.stderr, "no backing format") ||
			!strings.Contains(r.stderr, "not allowed for an untrusted image")):
			t.Errorf("ovis %s: exit %d, want 1 naming base.raw and the missing backing format\n%s", c.args, r.code, r.stderr)
		case !c.refused && r.code != 0:
			t.Errorf("ovis %s: exit %d\n%s", c.args, r.code, r.stderr)
		case !c.refused && args[1] == "info":
			// The same arguments, without "img" and --untrusted.
			qargs := slices.DeleteFunc(slices.Clone(args[1:]), func(a string) bool { return a == "--untrusted" })
			q := qemuImg(t, root, qargs...)
			sameResult(t, c.args, result{actualSizeRE.ReplaceAllString(q.stdout, ""), q.stderr, q.code},
				result{actualSizeRE.ReplaceAllString(r.stdout, ""), r.stderr, r.code})
		}
	}

	// With the format recorded, the untrusted chain opens.
	runTool(t, "qemu-img", "rebase", "-u", "-b", "base.raw", "-F", "raw", top)
	if r := ovis(t, root, "img", "--untrusted", "convert", "-f", "qcow2", "-O", "raw", top, out); r.code != 0 {
		t.Errorf("untrusted convert with the backing format recorded: exit %d\n%s", r.code, r.stderr)
	}
}
