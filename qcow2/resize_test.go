package qcow2

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"syscall"
	"testing"
)

// TestResizeOverBackingReadsZeros grows, through the engine, overlays of
// every layout over a longer backing file in every preallocation mode,
// from an unaligned size: the old range keeps reading the backing file
// (the head of the last cluster included), the new range reads zeros,
// the image checks clean with qemu-img and qemu-io reads it alike.
func TestResizeOverBackingReadsZeros(t *testing.T) {
	layouts := []CreateOptions{
		{ClusterSize: 512},
		{ClusterSize: 64 << 10},
		{ClusterSize: 64 << 10, ExtendedL2: true},
		{ClusterSize: 2 << 20},
	}
	for _, lo := range layouts {
		for _, p := range []string{PreallocOff, PreallocMetadata, PreallocFalloc, PreallocFull} {
			t.Run(fmt.Sprintf("%d/extl2=%v/%s", lo.ClusterSize, lo.ExtendedL2, p), func(t *testing.T) {
				t.Parallel()
				dir := t.TempDir()
				const bsize = 4 << 20
				back := filepath.Join(dir, "b.raw")
				if err := os.WriteFile(back, bytes.Repeat([]byte{1}, bsize), 0o644); err != nil {
					t.Fatal(err)
				}
				path := filepath.Join(dir, "t.qcow2")
				o := lo
				o.Size, o.BackingFile, o.BackingFormat, o.RefcountBits = 31<<10, "b.raw", "raw", 16
				if err := Create(path, o); err != nil {
					t.Fatal(err)
				}
				img, err := Open(path, Options{})
				if err != nil {
					t.Fatal(err)
				}
				const newSize = 3<<20 + 512
				if err := img.Resize(ctx, newSize, false, p); err != nil {
					img.Close()
					t.Fatal(err)
				}
				got := make([]byte, newSize)
				if _, err := img.ReadAt(ctx, got, 0); err != nil {
					t.Fatal(err)
				}
				if err := img.Close(); err != nil {
					t.Fatal(err)
				}
				want := append(bytes.Repeat([]byte{1}, 31<<10), make([]byte, newSize-31<<10)...)
				if i := firstDiff(got, want); i >= 0 {
					t.Fatalf("byte %d reads %d, want %d", i, got[i], want[i])
				}
				qemuCheck(t, path)
				runQemu(t, "qemu-io", "-r", "-c", "read -q -P 1 0 31k", "-c", fmt.Sprintf("read -q -P 0 31k %d", newSize-31<<10), path)
			})
		}
	}
}

// TestResizeShrinkReleasesHostSpace: a shrink through the engine punches
// the dropped clusters and cuts the file after its last used cluster, so
// the file takes much less space; what stays reads as before and the
// image checks clean.
func TestResizeShrinkReleasesHostSpace(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "t.qcow2")
	if err := Create(path, CreateOptions{Size: 16 << 20, ClusterSize: 64 << 10, RefcountBits: 16}); err != nil {
		t.Fatal(err)
	}
	img, err := Open(path, Options{})
	if err != nil {
		t.Fatal(err)
	}
	data := bytes.Repeat([]byte{7}, 16<<20)
	if _, err := img.WriteAt(ctx, data, 0, 0); err != nil {
		t.Fatal(err)
	}
	if err := img.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	before := allocated(t, path)
	if err := img.Resize(ctx, 1<<20+512, true, PreallocOff); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, 1<<20+512)
	if _, err := img.ReadAt(ctx, got, 0); err != nil {
		t.Fatal(err)
	}
	if err := img.Close(); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, data[:len(got)]) {
		t.Fatal("the shrunk image lost data below its new end")
	}
	after := allocated(t, path)
	if after > before/4 {
		t.Errorf("the file takes %d bytes after the shrink, %d before: the dropped clusters were not released", after, before)
	}
	st, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	if st.Size() > 3<<20 {
		t.Errorf("the file is %d bytes after shrinking to 1 MiB: its tail was not cut", st.Size())
	}
	qemuCheck(t, path)
}

func allocated(t *testing.T, path string) int64 {
	t.Helper()
	st, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	return st.Sys().(*syscall.Stat_t).Blocks * 512
}

// TestResizeStoppedStillHidesBacking: a preallocating resize over a
// longer backing file that is stopped (ctx done) returns ctx's error, but
// the grown range still reads zeros rather than the backing file, in
// both versions.
func TestResizeStoppedStillHidesBacking(t *testing.T) {
	for _, compat := range []string{"", "0.10"} {
		for _, p := range []string{PreallocMetadata, PreallocFalloc, PreallocFull} {
			t.Run(compat+"/"+p, func(t *testing.T) {
				dir := t.TempDir()
				if err := os.WriteFile(filepath.Join(dir, "b.raw"), bytes.Repeat([]byte{1}, 2<<20), 0o644); err != nil {
					t.Fatal(err)
				}
				path := filepath.Join(dir, "t.qcow2")
				if err := Create(path, CreateOptions{Size: 64 << 10, ClusterSize: 64 << 10, RefcountBits: 16, Compat: compat, BackingFile: "b.raw", BackingFormat: "raw"}); err != nil {
					t.Fatal(err)
				}
				img, err := Open(path, Options{})
				if err != nil {
					t.Fatal(err)
				}
				ctx, cancel := context.WithCancel(context.Background())
				cancel()
				err = img.Resize(ctx, 2<<20, false, p)
				if compat == "0.10" && p == PreallocMetadata {
					// Refused before anything changes, as qemu-img.
					if err == nil || err.Error() != errZeroNewClusters.Error() {
						t.Fatalf("ResizeContext: %v, want %v", err, errZeroNewClusters)
					}
					img.Close()
					return
				}
				if !errors.Is(err, context.Canceled) {
					t.Fatalf("ResizeContext: %v, want context.Canceled", err)
				}
				got := make([]byte, 2<<20-64<<10)
				if _, err := img.ReadAt(ctx, got, 64<<10); err != nil {
					t.Fatal(err)
				}
				if err := img.Close(); err != nil {
					t.Fatal(err)
				}
				if !bytes.Equal(got, make([]byte, len(got))) {
					t.Fatal("the grown range shows the backing file")
				}
				qemuCheck(t, path)
			})
		}
	}
}
