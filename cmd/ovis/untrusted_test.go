package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestUntrustedFlag: with --untrusted, ovis img and ovis nbd refuse an
// image whose backing file lies outside its folder (here: a "secret" next
// to the folder, reached by an absolute name, by ../ and by a symlink),
// and name the file and the reason; an image whose backing file is inside
// the folder still works. Without the flag, QEMU's behaviour stays: the
// image opens.
func TestUntrustedFlag(t *testing.T) {
	root := shortTempDir(t)
	dir := filepath.Join(root, "images")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	secret := filepath.Join(root, "secret.raw")
	if err := os.WriteFile(secret, []byte(strings.Repeat("s", 1<<16)), 0o600); err != nil {
		t.Fatal(err)
	}
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
				{"img", "--untrusted", "convert", "-O", "raw", img, out},
				{"img", "info", "--untrusted", "--backing-chain", img},
				{"img", "--untrusted", "compare", img, filepath.Join(dir, "base.raw")},
				{"nbd", "--untrusted", "-k", filepath.Join(root, "s.sock"), img},
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
