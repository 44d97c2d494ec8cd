package qcow2

import (
	"bytes"
	"fmt"
	"math/rand"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// withTimeout fails the test if fn has not returned after d: the bug
// this guards against was an endless allocation loop.
func withTimeout(t *testing.T, d time.Duration, fn func() error) {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- fn() }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(d):
		t.Fatalf("did not finish within %v", d)
	}
}

// TestResizeSmallClusters grows images with 512-byte clusters, whose L1
// tables are longer than a refcount block's range, and checks the result
// against qemu-img resizing the same image.
func TestResizeSmallClusters(t *testing.T) {
	for _, bits := range []int{1, 16, 64} {
		for _, size := range []int64{1 << 30, 4 << 30} {
			t.Run(fmt.Sprintf("refcount_bits=%d/%dG", bits, size>>30), func(t *testing.T) {
				dir := t.TempDir()
				p, q := filepath.Join(dir, "ovis.qcow2"), filepath.Join(dir, "qemu.qcow2")
				if err := Create(p, CreateOptions{Size: 1 << 20, ClusterSize: 512, RefcountBits: bits}); err != nil {
					t.Fatal(err)
				}
				img, err := Open(p, Options{})
				if err != nil {
					t.Fatal(err)
				}
				randomWrites(t, img, rand.New(rand.NewSource(int64(bits))), 20)
				before := readAll(t, img)
				if err := img.Close(); err != nil {
					t.Fatal(err)
				}
				runQemu(t, "qemu-img", "convert", "-O", "qcow2", "-o", fmt.Sprintf("cluster_size=512,refcount_bits=%d", bits), p, q)
				runQemu(t, "qemu-img", "resize", "-q", q, fmt.Sprint(size))

				img, err = Open(p, Options{})
				if err != nil {
					t.Fatal(err)
				}
				withTimeout(t, 2*time.Minute, func() error { return img.Resize(ctx, size, false, PreallocOff) })
				got := make([]byte, len(before))
				if _, err := img.ReadAt(ctx, got, 0); err != nil {
					t.Fatal(err)
				}
				if !bytes.Equal(got, before) {
					t.Fatal("data written before the resize reads back differently")
				}
				if err := img.Close(); err != nil {
					t.Fatal(err)
				}
				qemuCheck(t, p)
				runQemu(t, "qemu-img", "compare", "-q", p, q)
			})
		}
	}
}

// TestAllocRunLengths allocates runs shorter than, as long as and longer
// than a refcount block's range; each must come back contiguous, with
// refcount 1 on every cluster and overlapping nothing else (qemu-img then
// finds exactly the allocated clusters leaked and nothing worse).
func TestAllocRunLengths(t *testing.T) {
	for _, bits := range []int{1, 16, 64} {
		t.Run(fmt.Sprintf("refcount_bits=%d", bits), func(t *testing.T) {
			p := filepath.Join(t.TempDir(), "a.qcow2")
			if err := Create(p, CreateOptions{Size: 64 << 20, ClusterSize: 512, RefcountBits: bits}); err != nil {
				t.Fatal(err)
			}
			img, err := Open(p, Options{})
			if err != nil {
				t.Fatal(err)
			}
			randomWrites(t, img, rand.New(rand.NewSource(3)), 10)
			per := img.rcPerBlock
			var leaked, end int64
			for _, n := range []int64{1, per - 1, per, 3 * per, 1, 3*per + 1} {
				withTimeout(t, time.Minute, func() error {
					return img.exclusive(ctx, func() error {
						off, err := img.allocExclusiveLocked(n)
						if err != nil {
							return fmt.Errorf("allocating %d clusters: %w", n, err)
						}
						first := int64(off) >> img.clusterBits
						end = max(end, int64(off)+n*img.clusterSize)
						for c := first; c < first+n; c++ {
							rc, err := img.refcountExclusiveLocked(c)
							if err != nil {
								return err
							}
							if rc != 1 {
								return fmt.Errorf("run of %d at cluster %d: cluster %d has refcount %d", n, first, c, rc)
							}
						}
						return nil
					})
				})
				leaked += n
			}
			if err := img.Close(); err != nil {
				t.Fatal(err)
			}
			// Nothing was written to the runs; qemu-img counts leaks only
			// inside the file.
			if st, err := os.Stat(p); err != nil || st.Size() < end {
				if err := os.Truncate(p, end); err != nil {
					t.Fatal(err)
				}
			}
			r := qemuCheckJSONOf(t, p)
			if r.CheckErrors != 0 || r.Corruptions != 0 || int64(r.Leaks) != leaked {
				t.Fatalf("qemu-img check: %+v, want only %d leaks", r, leaked)
			}
		})
	}
}
