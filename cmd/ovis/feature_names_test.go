package main

import (
	"encoding/binary"
	"os"
	"strings"
	"testing"

	"github.com/ovis-storage/ovis/internal/testutil"
	"github.com/ovis-storage/ovis/qcow2"
)

// addIncompatFeatures sets the incompatible feature bits mask in the
// qcow2 image at path and appends entries to its feature name table.
func addIncompatFeatures(t *testing.T, path string, mask uint64, names ...qcow2.FeatureName) {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	be := binary.BigEndian
	be.PutUint64(b[72:], be.Uint64(b[72:])|mask)
	hl := int(be.Uint32(b[100:]))
	var exts []byte
	for off := hl; ; {
		typ, n := be.Uint32(b[off:]), int(be.Uint32(b[off+4:]))
		if typ == 0 {
			break
		}
		data := append([]byte(nil), b[off+8:off+8+n]...)
		if typ == 0x6803f857 {
			for _, f := range names {
				e := make([]byte, 48)
				e[0], e[1] = f.Kind, f.Bit
				copy(e[2:], f.Name)
				data = append(data, e...)
			}
		}
		exts = be.AppendUint32(exts, typ)
		exts = be.AppendUint32(exts, uint32(len(data)))
		exts = append(exts, data...)
		exts = append(exts, make([]byte, (8-len(data)%8)%8)...)
		off += 8 + (n+7)&^7
	}
	exts = append(exts, make([]byte, 8)...)
	copy(b[hl:], exts)
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
}

// TestReproUnsupportedFeatureNames: an image with incompatible feature
// bits ovis does not know is refused with qemu-img's message, which names
// the bits from the image's own feature name table (in table order, up to
// its first unnamed entry) and gives the rest as one hex mask, from every
// verb and as a backing file.
func TestReproUnsupportedFeatureNames(t *testing.T) {
	t.Parallel()
	named := func(bit uint8, name string) qcow2.FeatureName {
		return qcow2.FeatureName{Kind: 0, Bit: bit, Name: name}
	}
	images := []struct {
		name  string
		mask  uint64
		names []qcow2.FeatureName
	}{
		{"named and unknown", 0x7000000000000000, []qcow2.FeatureName{named(60, "Test feature")}},
		{"unknown only", 1 << 5, nil},
		{"two named in table order", 1<<40 | 1<<7, []qcow2.FeatureName{named(40, "forty"), named(7, "seven")}},
		{"compat entry for the bit", 1 << 9, []qcow2.FeatureName{{Kind: 1, Bit: 9, Name: "not this"}}},
		{"after an unnamed entry", 1<<9 | 1<<10, []qcow2.FeatureName{named(9, "nine"), {Kind: 0, Bit: 11}, named(10, "ten")}},
		{"name of 46 bytes", 1 << 63, []qcow2.FeatureName{named(63, strings.Repeat("n", 46))}},
	}
	verbs := [][]string{
		{"info", "f.qcow2"},
		{"convert", "-O", "raw", "top.qcow2", "o.raw"},
		{"info", "--backing-chain", "top.qcow2"},
		{"check", "f.qcow2"},
		{"convert", "-O", "raw", "f.qcow2", "o.raw"},
		{"map", "f.qcow2"},
		{"compare", "f.qcow2", "f.qcow2"},
		{"measure", "-O", "qcow2", "f.qcow2"},
		{"amend", "-o", "lazy_refcounts=on", "f.qcow2"},
		{"dd", "if=f.qcow2", "of=o.raw"},
	}
	for _, im := range images {
		for _, args := range verbs {
			name := im.name + "/" + strings.Join(args, " ")
			t.Run(name, func(t *testing.T) {
				run := func(bin string) result {
					dir := t.TempDir()
					testutil.QemuImg(t, "create", "-q", "-f", "qcow2", dir+"/f.qcow2", "1M")
					testutil.QemuImg(t, "create", "-q", "-f", "qcow2", "-b", "f.qcow2", "-F", "qcow2", dir+"/top.qcow2")
					addIncompatFeatures(t, dir+"/f.qcow2", im.mask, im.names...)
					if bin == "qemu-img" {
						return qemuImg(t, dir, args...)
					}
					return ovisImg(t, dir, args...)
				}
				q := run("qemu-img")
				if !strings.Contains(q.stderr, "Unsupported qcow2 feature(s)") {
					t.Fatalf("qemu-img does not refuse it: %q", q.stderr)
				}
				sameResult(t, name, q, run(ovisBin))
			})
		}
	}
}
