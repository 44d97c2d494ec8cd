package main

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/ovis-storage/ovis/internal/testutil"
)

// TestReproPseudoFilenames: image names QEMU users write beside paths,
// "file:PATH" and json:{...} trees of the qcow2, raw and file drivers,
// work in every verb that takes an image (and as backing file names), as
// in qemu-img: same output (info names the file itself), same errors
// (which name the image as written), same files afterwards. Creating an
// image under a json: name is refused, as QEMU has no json protocol.
func TestReproPseudoFilenames(t *testing.T) {
	t.Parallel()
	const (
		j    = `json:{"driver":"qcow2","file":{"driver":"file","filename":"x.qcow2"}}`
		jraw = `json:{"driver":"raw","file":{"driver":"file","filename":"r.raw"}}`
	)
	setup := func(t *testing.T, dir string) {
		p := func(name string) string { return filepath.Join(dir, name) }
		testutil.QemuImg(t, "create", "-q", "-f", "qcow2", p("x.qcow2"), "1M")
		testutil.QemuIO(t, p("x.qcow2"), "qcow2", "write -q -P 1 0 64k")
		testutil.QemuImg(t, "create", "-q", "-f", "raw", p("r.raw"), "1M")
		for name, backing := range map[string][]string{
			"t1.qcow2": {"-b", j, "-F", "qcow2"},
			"t2.qcow2": {"-b", "file:x.qcow2", "-F", "qcow2"},
			"t3.qcow2": {"-b", `json:{"driver":"file","filename":"r.raw"}`, "-F", "raw"},
			"t4.qcow2": {"-b", `json:{"driver":"qcow2","file":{"driver":"file","filename":"nope"}}`, "-F", "qcow2"},
		} {
			testutil.QemuImg(t, append(append([]string{"create", "-q", "-f", "qcow2", "-u"}, backing...), p(name), "1M")...)
		}
	}
	for _, args := range [][]string{
		{"info", "file:x.qcow2"},
		{"info", "file:nope"},
		{"info", j},
		{"info", "--output=json", j},
		{"info", `json:{"driver":"qcow2","file":{"driver":"file","filename":"nope.qcow2"}}`},
		{"info", `json:{"driver":"qcow2","file":"x.qcow2"}`},
		{"info", `json:{"driver":"qcow2","file":{"driver":"file","filename":"x.qcow2"},"l2-cache-size":"1M"}`},
		{"info", `json:{"driver":"raw","file":{"driver":"file","filename":"x.qcow2"}}`},
		{"info", "-f", "raw", j},
		{"info", `json:{"file":{"filename":"x.qcow2"}}`},
		{"info", `json:{"driver":"qcow2","file":{"driver":"file","filename":"x.qcow2"},"foo":1}`},
		{"info", `json:{"driver":"qcow2","file":{"driver":"file","filename":"x.qcow2","x":[1]}}`},
		{"info", "json:[1]"},
		// Syntax errors, in the words of QEMU's JSON parser.
		{"info", "json:{bad"},
		{"info", `json:{"driver":"qcow2",}`},
		{"info", `json:{"driver":"qcow2"`},
		{"info", "json:"},
		{"info", `json:{"driver":qcow2}`},
		{"info", j + "x"},
		{"info", `json:{"driver":"qcow2" "x":1}`},
		{"info", `json:{"driver" "qcow2"}`},
		{"info", `json:{"a":[1 2]}`},
		{"info", `json:{"a":}`},
		{"info", `json:{"driver":null}`},
		{"info", "json:{}"},
		{"info", `json:{"driver":"qcow2"}`},
		{"info", "-f", "raw", `json:{"driver":"file","filename":"r.raw"}`},
		{"info", `json:{"driver":"file","filename":"r.raw"}`},
		{"info", "--output=json", `json:{"driver":"file","filename":"r.raw"}`},
		{"map", `json:{"driver":"file","filename":"r.raw"}`},
		{"info", "--backing-chain", "t1.qcow2"},
		{"info", "--backing-chain", "t2.qcow2"},
		{"info", "--backing-chain", "t3.qcow2"},
		{"info", "--backing-chain", "t4.qcow2"},
		{"info", "--backing-chain", "--output=json", "t2.qcow2"},
		{"check", j},
		{"check", "file:x.qcow2"},
		{"check", "t3.qcow2"},
		{"map", j},
		{"map", "--output=json", "t2.qcow2"},
		{"compare", j, "file:x.qcow2"},
		{"compare", "t1.qcow2", "t2.qcow2"},
		{"measure", "-O", "qcow2", j},
		{"convert", "-O", "raw", j, "o1.raw"},
		{"convert", "-O", "raw", "file:x.qcow2", "file:o2.raw"},
		{"convert", "-O", "raw", "t1.qcow2", "o3.raw"},
		{"convert", "-O", "raw", "t4.qcow2", "o4.raw"},
		{"convert", "-O", "qcow2", "x.qcow2", j},
		{"convert", "-n", "-O", "raw", "x.qcow2", jraw},
		{"dd", "if=" + j, "of=file:o5.raw"},
		{"dd", "if=x.qcow2", "of=" + j},
		{"create", "-f", "qcow2", "file:n1.qcow2", "1M"},
		{"create", "-f", "qcow2", j, "1M"},
		{"create", "-f", "qcow2", "-b", "file:x.qcow2", "-F", "qcow2", "n2.qcow2"},
		{"create", "-f", "qcow2", "-b", j, "-F", "qcow2", "n3.qcow2"},
		{"create", "-f", "qcow2", "-b", j, "n4.qcow2"},
		{"snapshot", "-c", "s", j},
		{"resize", j, "2M"},
		{"amend", "-o", "lazy_refcounts=on", j},
		{"bitmap", "--add", j, "b"},
		{"rebase", "-b", "file:r.raw", "-F", "raw", j},
		{"commit", "t1.qcow2"},
	} {
		name := strings.Join(args, " ")
		t.Run(name, func(t *testing.T) {
			qdir, odir := t.TempDir(), t.TempDir()
			fromFixture(t, "pseudo-filenames", setup, qdir, odir)
			sameResult(t, name, qemuImg(t, qdir, args...), ovisImg(t, odir, args...))
			for _, f := range []string{"x.qcow2", "n1.qcow2", "o1.raw", "o2.raw", "o5.raw", "file:n1.qcow2", "file:o2.raw"} {
				_, qerr := os.Stat(filepath.Join(qdir, f))
				_, oerr := os.Stat(filepath.Join(odir, f))
				if (qerr == nil) != (oerr == nil) {
					t.Errorf("%s: after qemu-img %v, after ovis %v", f, qerr, oerr)
				}
			}
			if args[0] != "info" && args[0] != "create" {
				q := testutil.QemuImg(t, "info", "-U", "--output=json", filepath.Join(qdir, "x.qcow2"))
				o := testutil.QemuImg(t, "info", "-U", "--output=json", filepath.Join(odir, "x.qcow2"))
				if strip := func(s string) string {
					return regexp.MustCompile(`"(actual-size|date-sec|date-nsec|filename)": ("[^"]*"|\d+)`).ReplaceAllString(s, "")
				}; strip(q) != strip(o) {
					t.Errorf("x.qcow2 differs afterwards:\nqemu-img: %s\n    ovis: %s", q, o)
				}
			}
		})
	}
}
