package qcow2

import (
	"bytes"
	"errors"
	"path/filepath"
	"testing"

	"pgregory.net/rapid"
)

// TestSetBits sets ranges of bits against a bit-by-bit model.
func TestSetBits(t *testing.T) {
	tests := []struct{ g, off, n int64 }{
		{512, 0, 1}, {512, 511, 2}, {512, 0, 512 * 64}, {512, 100, 512 * 70},
		{4096, 4095, 1}, {4096, 8 * 4096, 16 * 4096}, {65536, 0, 1 << 20}, {512, 512 * 127, 0},
	}
	for _, tt := range tests {
		got := make([]byte, 32)
		setBits(got, tt.g, tt.off, tt.n)
		want := make([]byte, 32)
		if tt.n > 0 {
			for i := tt.off / tt.g; i <= (tt.off+tt.n-1)/tt.g && i < 256; i++ {
				want[i/8] |= 1 << (i % 8)
			}
		}
		if !bytes.Equal(got, want) {
			t.Errorf("setBits(g=%d, off=%d, n=%d) = %x, want %x", tt.g, tt.off, tt.n, got, want)
		}
	}
}

// TestBitmapModel runs random writes, zero writes, bitmap changes and
// reopens against a model of every bitmap's bits: an enabled bitmap sets
// the bits of each write, a disabled one keeps its bits, clear and merge
// do what they say. After every reopen the stored bits must equal the
// model's, and qemu-img check must find the image clean.
func TestBitmapModel(t *testing.T) {
	mdlHaveQemu(t)
	mdlCheck(t, 25, func(rt *rapid.T) {
		dir := t.TempDir()
		path := filepath.Join(dir, "b.qcow2")
		cs := rapid.SampledFrom([]int64{512, 4096, 65536}).Draw(rt, "cluster")
		size := rapid.Int64Range(1, 64).Draw(rt, "MiB") << 20
		if err := Create(path, CreateOptions{Size: size, ClusterSize: cs}); err != nil {
			rt.Fatal(err)
		}
		img, err := Open(path, Options{})
		if err != nil {
			rt.Fatal(err)
		}
		defer func() { img.Close() }()
		type mbm struct {
			g    int64
			auto bool
			bits []byte
		}
		model := map[string]*mbm{}
		names := []string{"a", "b", "c"}
		for step := range rapid.IntRange(1, 30).Draw(rt, "steps") {
			_ = step
			switch op := rapid.IntRange(0, 7).Draw(rt, "op"); op {
			case 0, 1, 2: // write or zero
				off := rapid.Int64Range(0, size-1).Draw(rt, "off")
				n := rapid.Int64Range(1, min(size-off, 300<<10)).Draw(rt, "n")
				if op == 2 {
					err = img.WriteZeroes(ctx, off, n, 0)
				} else {
					_, err = img.WriteAt(ctx, bytes.Repeat([]byte{byte(op + 1)}, int(n)), off, 0)
				}
				if err != nil {
					rt.Fatal(err)
				}
				for _, b := range model {
					if b.auto {
						setBits(b.bits, b.g, off, n)
					}
				}
			case 3: // add
				name := rapid.SampledFrom(names).Draw(rt, "name")
				g := rapid.SampledFrom([]int64{0, 512, 4096, 1 << 20}).Draw(rt, "gran")
				disabled := rapid.Bool().Draw(rt, "disabled")
				err := img.AddBitmap(ctx, name, g, disabled)
				if model[name] != nil {
					if !errors.Is(err, ErrBitmapExists) {
						rt.Fatalf("adding %s twice: %v", name, err)
					}
					continue
				}
				if err != nil {
					rt.Fatal(err)
				}
				if g == 0 {
					g = max(4096, cs)
				}
				model[name] = &mbm{g: g, auto: !disabled, bits: make([]byte, (bitCount(size, g)+7)/8)}
			case 4: // remove, clear or toggle
				name := rapid.SampledFrom(names).Draw(rt, "name")
				what := rapid.IntRange(0, 2).Draw(rt, "what")
				var err error
				switch what {
				case 0:
					err = img.RemoveBitmap(ctx, name)
				case 1:
					err = img.ClearBitmap(ctx, name)
				case 2:
					on := rapid.Bool().Draw(rt, "on")
					err = img.SetBitmapEnabled(ctx, name, on)
					if b := model[name]; b != nil {
						b.auto = on
					}
				}
				b := model[name]
				if b == nil {
					if !errors.Is(err, ErrBitmapNotFound) {
						rt.Fatalf("%d on missing %s: %v", what, name, err)
					}
					continue
				}
				if err != nil {
					rt.Fatal(err)
				}
				switch what {
				case 0:
					delete(model, name)
				case 1:
					clear(b.bits)
				}
			case 5: // merge
				src, dst := rapid.SampledFrom(names).Draw(rt, "src"), rapid.SampledFrom(names).Draw(rt, "dst")
				if model[src] == nil || model[dst] == nil {
					continue
				}
				bits, g, err := img.BitmapBits(src)
				if err != nil {
					rt.Fatal(err)
				}
				if err := img.MergeBitmap(ctx, dst, bits, g); err != nil {
					rt.Fatal(err)
				}
				d := model[dst]
				s := model[src]
				for i := int64(0); i < bitCount(size, s.g); i++ {
					if s.bits[i/8]&(1<<(i%8)) != 0 {
						setBits(d.bits, d.g, i*s.g, min(s.g, size-i*s.g))
					}
				}
			case 6, 7: // reopen, and compare everything
				if err := img.Close(); err != nil {
					rt.Fatal(err)
				}
				if err := mdlQemuCheck(path); err != nil {
					rt.Fatal(err)
				}
				if img, err = Open(path, Options{}); err != nil {
					rt.Fatal(err)
				}
				list := img.Bitmaps()
				if len(list) != len(model) {
					rt.Fatalf("%d bitmaps, model has %d", len(list), len(model))
				}
				for _, b := range list {
					m := model[b.Name]
					if m == nil || b.Granularity != m.g || b.Auto != m.auto || b.InUse {
						rt.Fatalf("bitmap %+v, model %+v", b, m)
					}
					bits, _, err := img.BitmapBits(b.Name)
					if err != nil {
						rt.Fatal(err)
					}
					if !bytes.Equal(bits, m.bits) {
						rt.Fatalf("bitmap %s: stored bits differ from the model", b.Name)
					}
				}
			}
		}
	})
}
