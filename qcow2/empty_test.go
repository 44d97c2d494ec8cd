package qcow2

import (
	"bytes"
	"context"
	"path/filepath"
	"testing"

	"github.com/ovis-storage/ovis/internal/testutil"

	"github.com/ovis-storage/ovis/block"
)

// TestMakeEmpty empties tops of every L2 layout, with a snapshot sharing
// their clusters and a cache smaller than their metadata: afterwards the
// top allocates nothing of its own, reads as its backing file, still
// reads as the snapshot when that is loaded, and qemu-img check finds
// neither leaks nor corruption.
func TestMakeEmpty(t *testing.T) {
	for _, tt := range []struct {
		name string
		co   CreateOptions
	}{
		{"64k", CreateOptions{}},
		{"4k clusters", CreateOptions{ClusterSize: 4096}},
		{"extended L2", CreateOptions{ExtendedL2: true}},
		{"v2", CreateOptions{Compat: "0.10"}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			base, top := filepath.Join(dir, "base.qcow2"), filepath.Join(dir, "top.qcow2")
			const size = 3 << 30 // several L2 tables, most never allocated
			if err := Create(base, CreateOptions{Size: size}); err != nil {
				t.Fatal(err)
			}
			b, err := Open(base, Options{})
			if err != nil {
				t.Fatal(err)
			}
			baseData := bytes.Repeat([]byte{0xb5}, 1<<20)
			if _, err := b.WriteAt(ctx, baseData, 0, 0); err != nil {
				t.Fatal(err)
			}
			b.Close()
			co := tt.co
			co.Size, co.BackingFile, co.BackingFormat = size, base, "qcow2"
			if err := Create(top, co); err != nil {
				t.Fatal(err)
			}
			img, err := Open(top, Options{L2CacheSize: 64 << 10})
			if err != nil {
				t.Fatal(err)
			}
			writes := []int64{0, 512 << 10, 1 << 30, 2<<30 + 4096, size - 64<<10}
			top1 := bytes.Repeat([]byte{0x71}, 64<<10)
			for _, off := range writes {
				if _, err := img.WriteAt(ctx, top1, off, 0); err != nil {
					t.Fatal(err)
				}
			}
			if err := img.WriteCompressed(ctx, bytes.Repeat([]byte{0x33}, int(img.ClusterSize())), 5<<20); err != nil {
				t.Fatal(err)
			}
			if err := img.WriteZeroes(ctx, 8<<20, 1<<20, block.NoUnmap); err != nil {
				t.Fatal(err)
			}
			if err := img.CreateSnapshot(ctx, "", "s1", 0, 0); err != nil {
				t.Fatal(err)
			}
			if _, err := img.WriteAt(ctx, bytes.Repeat([]byte{0x72}, 4096), 1<<30, 0); err != nil {
				t.Fatal(err)
			}
			if err := img.MakeEmpty(context.Background()); err != nil {
				t.Fatal(err)
			}
			for off := int64(0); off < size; {
				e, err := img.MapAt(ctx, off, size-off)
				if err != nil {
					t.Fatal(err)
				}
				if e.Depth == 0 && e.Present {
					t.Fatalf("[%#x, +%#x) is still allocated in the top: %+v", off, e.Length, e)
				}
				off += e.Length
			}
			got := make([]byte, 1<<20)
			if _, err := img.ReadAt(ctx, got, 0); err != nil || !bytes.Equal(got, baseData) {
				t.Errorf("the top does not read as its backing file at 0 (err %v)", err)
			}
			if err := img.Close(); err != nil {
				t.Fatal(err)
			}
			testutil.CheckImage(t, top)

			snap, err := Open(top, Options{ReadOnly: true})
			if err != nil {
				t.Fatal(err)
			}
			defer snap.Close()
			if err := snap.LoadSnapshot("", "s1"); err != nil {
				t.Fatal(err)
			}
			for _, off := range writes {
				got := make([]byte, len(top1))
				if _, err := snap.ReadAt(ctx, got, off); err != nil || !bytes.Equal(got, top1) {
					t.Errorf("snapshot s1 at %#x lost its data (err %v)", off, err)
				}
			}
		})
	}
}
