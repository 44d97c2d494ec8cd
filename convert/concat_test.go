package convert

import (
	"bytes"
	"os"
	"path/filepath"
	"testing"

	"github.com/ovis-storage/ovis/block"
)

// TestConcat reads every range of a few sizes across three parts against
// the model qemu-img convert has of them: the parts in order, each padded
// with zeros to whole sectors; and requires extents that never cross a
// part and report the padding as a hole.
func TestConcat(t *testing.T) {
	dir := t.TempDir()
	var parts []block.Device
	var model []byte
	var starts []int64
	for i, size := range []int{1000, 512, 1700} {
		b := bytes.Repeat([]byte{byte(i + 1)}, size)
		path := filepath.Join(dir, string(rune('a'+i)))
		if err := os.WriteFile(path, b, 0o644); err != nil {
			t.Fatal(err)
		}
		r, err := block.OpenRaw(path, true)
		if err != nil {
			t.Fatal(err)
		}
		parts = append(parts, r)
		starts = append(starts, int64(len(model)))
		model = append(model, b...)
		model = append(model, make([]byte, (512-size%512)%512)...)
	}
	c := Concat(parts...)
	defer c.Close()
	if c.Size() != int64(len(model)) {
		t.Fatalf("Size = %d, want %d", c.Size(), len(model))
	}
	for off := 0; off < len(model); off += 100 {
		for _, n := range []int{1, 100, 511, 1024, len(model) - off} {
			if off+n > len(model) {
				continue
			}
			got := bytes.Repeat([]byte{0xee}, n)
			if _, err := c.ReadAt(ctx, got, int64(off)); err != nil {
				t.Fatalf("ReadAt(%d, %d): %v", off, n, err)
			}
			if !bytes.Equal(got, model[off:off+n]) {
				t.Fatalf("ReadAt(%d, %d) differs from the model", off, n)
			}
		}
		e, err := block.FirstExtent(ctx, c, int64(off), int64(len(model)-off))
		if err != nil || e.Length <= 0 {
			t.Fatalf("Extent(%d) = %+v, %v", off, e, err)
		}
		end := int64(off) + e.Length
		for _, s := range append(starts[1:], int64(len(model))) {
			if int64(off) < s && end > s {
				t.Fatalf("Extent(%d) = %+v crosses the part boundary at %d", off, e, s)
			}
		}
		if model[off] != 0 && e.Status != block.StatusData {
			t.Fatalf("Extent(%d) = %+v on data", off, e)
		}
		if model[off] == 0 && e.Status != block.StatusHole|block.StatusZero {
			t.Fatalf("Extent(%d) = %+v on padding", off, e)
		}
	}
	if _, err := c.ReadAt(ctx, make([]byte, 2), c.Size()-1); err == nil {
		t.Fatal("ReadAt past the end succeeded")
	}
	if _, err := c.WriteAt(ctx, []byte{1}, 0, 0); err == nil {
		t.Fatal("WriteAt succeeded on concatenated sources")
	}
}
