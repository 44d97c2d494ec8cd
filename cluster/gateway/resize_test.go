package gateway_test

import (
	"bytes"
	"errors"
	"sync"
	"testing"

	"github.com/ovis-storage/ovis/block"
	"github.com/ovis-storage/ovis/cluster/object"
)

// TestSetSize: growing while writers run loses none of their writes and
// opens the new range at once; a shrink refuses what lies past the new
// end; a size the object size cannot reach is refused and changes
// nothing.
func TestSetSize(t *testing.T) {
	const (
		old   = 1 << 20
		grown = 3<<20 + 4096 // crosses into a fourth object
	)
	c := newCluster(t, 3, 1)
	d := c.open(t, nil, 1, old, 3)

	// Writers fill the old range while the size grows under them.
	const writers, chunk = 4, 64 << 10
	var wg sync.WaitGroup
	errs := make([]error, writers)
	for w := range writers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for off := int64(w * chunk); off < old; off += writers * chunk {
				if _, err := d.WriteAt(ctx, fill(uint64(off), chunk), off, 0); err != nil {
					errs[w] = err
					return
				}
			}
		}()
	}
	if err := d.SetSize(grown); err != nil {
		t.Fatal(err)
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatalf("a write during the resize failed: %v", err)
	}
	if got := d.Size(); got != grown {
		t.Fatalf("size %d after SetSize(%d)", got, grown)
	}
	tail := fill(99, 4096)
	if _, err := d.WriteAt(ctx, tail, grown-4096, block.FUA); err != nil {
		t.Fatalf("write at the new end: %v", err)
	}
	got := readAll(t, d)
	for off := int64(0); off < old; off += chunk {
		if !bytes.Equal(got[off:off+chunk], fill(uint64(off), chunk)) {
			t.Fatalf("bytes at %d differ after the resize", off)
		}
	}
	if !bytes.Equal(got[old:grown-4096], make([]byte, grown-4096-old)) {
		t.Error("the grown range does not read as zeros")
	}
	if !bytes.Equal(got[grown-4096:], tail) {
		t.Error("the write at the new end does not read back")
	}

	tests := []struct {
		name    string
		size    int64
		wantErr bool
		want    int64 // Size() afterwards
	}{
		{"negative", -512, true, grown},
		{"past the object size's reach", object.MaxVDISize(1<<object.MinSizeShift) + 512, true, grown},
		{"shrink", old, false, old},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			err := d.SetSize(tc.size)
			if (err != nil) != tc.wantErr {
				t.Fatalf("SetSize(%d): %v, want error %v", tc.size, err, tc.wantErr)
			}
			if got := d.Size(); got != tc.want {
				t.Errorf("size %d, want %d", got, tc.want)
			}
		})
	}
	if _, err := d.WriteAt(ctx, tail, grown-4096, 0); !errors.Is(err, block.ErrOutOfRange) {
		t.Errorf("write past a shrunk end: %v, want ErrOutOfRange", err)
	}
	if _, err := d.ReadAt(ctx, make([]byte, 512), old); !errors.Is(err, block.ErrOutOfRange) {
		t.Errorf("read past a shrunk end: %v, want ErrOutOfRange", err)
	}
}
