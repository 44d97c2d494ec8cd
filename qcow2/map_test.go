package qcow2

import (
	"encoding/json"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/ovis-storage/ovis/block"
)

type qemuMapEntry struct {
	Start   int64  `json:"start"`
	Length  int64  `json:"length"`
	Depth   int    `json:"depth"`
	Present bool   `json:"present"`
	Zero    bool   `json:"zero"`
	Data    bool   `json:"data"`
	Offset  *int64 `json:"offset"`
}

// mapAll walks MapAt over the whole device, merging runs the way
// qemu-img map merges them (same flags and depth, contiguous offsets).
func mapAll(t *testing.T, d block.Mapper, size int64) []qemuMapEntry {
	t.Helper()
	var out []qemuMapEntry
	for off := int64(0); off < size; {
		m, err := d.MapAt(ctx, off, size-off)
		if err != nil {
			t.Fatal(err)
		}
		if m.Length <= 0 {
			t.Fatalf("MapAt(%d) returned length %d", off, m.Length)
		}
		e := qemuMapEntry{Start: off, Length: m.Length, Depth: m.Depth, Present: m.Present, Zero: m.Zero, Data: m.Data}
		if m.Offset >= 0 {
			o := m.Offset
			e.Offset = &o
		}
		if k := len(out) - 1; k >= 0 {
			p := out[k]
			contig := (p.Offset == nil) == (e.Offset == nil) && (p.Offset == nil || *p.Offset+p.Length == *e.Offset)
			if p.Depth == e.Depth && p.Present == e.Present && p.Zero == e.Zero && p.Data == e.Data && contig {
				out[k].Length += e.Length
				off += m.Length
				continue
			}
		}
		out = append(out, e)
		off += m.Length
	}
	return out
}

func TestMapMatchesQemu(t *testing.T) {
	dir := t.TempDir()
	base := filepath.Join(dir, "base.qcow2")
	top := filepath.Join(dir, "top.qcow2")
	rawb := filepath.Join(dir, "b.raw")
	runQemu(t, "qemu-img", "create", "-f", "qcow2", base, "4M")
	runQemu(t, "qemu-io", "-c", "write -P 1 0 1M", "-c", "write -z 1536k 64k", base)
	runQemu(t, "qemu-img", "create", "-f", "qcow2", "-b", "base.qcow2", "-F", "qcow2", top)
	runQemu(t, "qemu-io", "-c", "write -P 2 512k 64k", "-c", "write -z 2M 64k", "-c", "write -c -P 3 3M 64k", top)
	prealloc := filepath.Join(dir, "pre.qcow2")
	runQemu(t, "qemu-img", "create", "-f", "qcow2", "-o", "preallocation=metadata", prealloc, "1M")
	runQemu(t, "qemu-io", "-c", "write -z 0 64k", "-c", "write -P 5 128k 4k", prealloc)
	runQemu(t, "qemu-img", "create", "-f", "raw", rawb, "2M")
	runQemu(t, "qemu-io", "-f", "raw", "-c", "write -P 1 1M 64k", rawb)
	overRaw := filepath.Join(dir, "over-raw.qcow2")
	runQemu(t, "qemu-img", "create", "-f", "qcow2", "-b", "b.raw", "-F", "raw", overRaw, "4M")
	runQemu(t, "qemu-io", "-c", "write -P 9 0 64k", overRaw)

	for _, p := range []string{base, top, prealloc, overRaw} {
		t.Run(filepath.Base(p), func(t *testing.T) {
			out, err := exec.Command("qemu-img", "map", "--output=json", p).Output()
			if err != nil {
				t.Fatal(err)
			}
			var want []qemuMapEntry
			if err := json.Unmarshal(out, &want); err != nil {
				t.Fatal(err)
			}
			img, err := Open(p, Options{ReadOnly: true})
			if err != nil {
				t.Fatal(err)
			}
			defer img.Close()
			got := mapAll(t, img, img.Size())
			g, _ := json.Marshal(got)
			w, _ := json.Marshal(want)
			if string(g) != string(w) {
				t.Fatalf("map differs\novis: %s\nqemu: %s", g, w)
			}
		})
	}
}
