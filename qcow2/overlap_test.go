package qcow2

import (
	"encoding/binary"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/ovis-storage/ovis/internal/testutil"
)

// overlapTwins makes a qemu-img image with data in its first cluster (and,
// with snap, an internal snapshot), damages it with patch and returns two
// copies.
func overlapTwins(t *testing.T, snap bool, patch func(t *testing.T, b []byte)) (ours, theirs string) {
	t.Helper()
	dir := t.TempDir()
	base := filepath.Join(dir, "base.qcow2")
	testutil.QemuImg(t, "create", "-q", "-f", "qcow2", base, "64M")
	testutil.QemuIO(t, base, "qcow2", "write -q -P 0x11 0 64k")
	if snap {
		testutil.QemuImg(t, "snapshot", "-c", "s1", base)
	}
	b, err := os.ReadFile(base)
	if err != nil {
		t.Fatal(err)
	}
	patch(t, b)
	ours, theirs = filepath.Join(dir, "ours.qcow2"), filepath.Join(dir, "theirs.qcow2")
	for _, p := range []string{ours, theirs} {
		if err := os.WriteFile(p, b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return ours, theirs
}

// zeroRefcount sets the refcount of the cluster at the offset read from
// the header (or given) to 0 in refcount block 0 (16-bit entries).
func zeroRefcount(off func(b []byte) uint64) func(t *testing.T, b []byte) {
	return func(t *testing.T, b []byte) {
		be := binary.BigEndian
		rb := be.Uint64(b[be.Uint64(b[48:]):])
		c := off(b) >> 16
		be.PutUint16(b[rb+2*c:], 0)
	}
}

// TestOverlapAllocationLikeQemu: an allocating write to an image whose
// refcounts call a metadata cluster free is refused as QEMU refuses it
// (the image marked corrupt, EIO, the same message), and the guest data
// already there stays readable.
func TestOverlapAllocationLikeQemu(t *testing.T) {
	be := binary.BigEndian
	cases := []struct {
		name  string
		snap  bool
		patch func(t *testing.T, b []byte)
	}{
		{"header", false, zeroRefcount(func(b []byte) uint64 { return 0 })},
		{"refcount table", false, zeroRefcount(func(b []byte) uint64 { return be.Uint64(b[48:]) })},
		{"refcount block", false, zeroRefcount(func(b []byte) uint64 { return be.Uint64(b[be.Uint64(b[48:]):]) })},
		{"L1 table", false, zeroRefcount(func(b []byte) uint64 { return be.Uint64(b[40:]) })},
		{"L2 table", false, zeroRefcount(func(b []byte) uint64 { return be.Uint64(b[be.Uint64(b[40:]):]) & l1OffsetMask })},
		{"snapshot table", true, zeroRefcount(func(b []byte) uint64 { return be.Uint64(b[64:]) })},
		{"snapshot L1 table", true, zeroRefcount(func(b []byte) uint64 { return be.Uint64(b[be.Uint64(b[64:]):]) })},
		{"refcount block past the end", false, func(t *testing.T, b []byte) {
			be.PutUint64(b[be.Uint64(b[48:]):], 0x1000000)
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			ours, theirs := overlapTwins(t, tc.snap, tc.patch)
			out, code := testutil.QemuIOExit(t, theirs, "qcow2", "write -q -P 0x22 1M 64k")
			if code == 0 || !strings.Contains(out, "write failed: Input/output error") {
				t.Fatalf("qemu-io wrote over metadata (exit %d): %s", code, out)
			}
			var want string
			for _, l := range strings.Split(out, "\n") {
				if strings.HasPrefix(l, "qcow2: Marking image as corrupt") {
					want = l
				}
			}

			img, err := Open(ours, Options{})
			if err != nil {
				t.Fatal(err)
			}
			_, werr := img.WriteAt(ctx, make([]byte, 64<<10), 1<<20, 0)
			var ev *CorruptionEvent
			if !errors.As(werr, &ev) || !errors.Is(werr, syscall.EIO) {
				t.Fatalf("write: %v, want a corruption event (EIO)", werr)
			}
			if got := ev.Message(); got != want {
				t.Errorf("message:\n got %s\nwant %s", got, want)
			}
			// QEMU makes the node unusable; so does ovis.
			if _, err := img.WriteAt(ctx, make([]byte, 512), 0, 0); err == nil {
				t.Error("a second write after the corruption event succeeded")
			}
			if err := img.Close(); err != nil {
				t.Fatal(err)
			}
			for _, p := range []string{ours, theirs} {
				info := testutil.ImageInfo(t, p)
				spec, _ := info["format-specific"].(map[string]any)
				data, _ := spec["data"].(map[string]any)
				if data["corrupt"] != true {
					t.Errorf("%s: not marked corrupt: %v", filepath.Base(p), data)
				}
			}
			// The metadata is intact: the data reads back (read-only
			// opens a corrupt image).
			for _, p := range []string{ours, theirs} {
				out, errs, code := testutil.RunIn(t, "", "qemu-io", "-r", "-U", "-f", "qcow2", "-c", "read -q -P 0x11 0 64k", "-c", "read -q -P 0 1M 64k", p)
				if code != 0 || strings.Contains(out+errs, "fail") {
					t.Errorf("%s: reading back: exit %d %s%s", filepath.Base(p), code, out, errs)
				}
			}
			if fi, err := os.Stat(ours); err != nil || fi.Size() > 1<<20 {
				t.Errorf("file grew: %v %v", fi.Size(), err)
			}
		})
	}
}
