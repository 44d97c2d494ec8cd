package qcow2

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"os/exec"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/ovis-storage/ovis/block"
)

// TestReadNoWait: whatever ReadNoWait serves equals ReadAt, on an image
// with data, zero clusters, unallocated ranges over a backing file,
// compressed clusters and preallocated clusters that are host holes; and
// it does serve the cases it promises to (cached mappings of zeros,
// unallocated ranges, host holes, and data in the page cache).
func TestReadNoWait(t *testing.T) {
	dir := t.TempDir()
	base := filepath.Join(dir, "base.qcow2")
	top := filepath.Join(dir, "top.qcow2")
	const size = 8 << 20
	if err := Create(base, CreateOptions{Size: size}); err != nil {
		t.Fatal(err)
	}
	b, err := Open(base, Options{})
	if err != nil {
		t.Fatal(err)
	}
	fill := func(seed byte, n int) []byte {
		p := make([]byte, n)
		for i := range p {
			p[i] = seed + byte(i%251)
		}
		return p
	}
	if _, err := b.WriteAt(ctx, fill(1, 1<<20), 2<<20, 0); err != nil {
		t.Fatal(err)
	}
	b.Close()
	if err := Create(top, CreateOptions{Size: size, BackingFile: base, BackingFormat: "qcow2", Preallocation: "metadata"}); err != nil {
		t.Fatal(err)
	}
	img, err := Open(top, Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer img.Close()
	if _, err := img.WriteAt(ctx, fill(7, 256<<10), 0, 0); err != nil {
		t.Fatal(err)
	}
	if err := img.WriteZeroes(ctx, 1<<20, 128<<10, block.NoUnmap); err != nil {
		t.Fatal(err)
	}
	if err := img.WriteCompressed(ctx, fill(9, 64<<10), 4<<20); err != nil {
		t.Fatal(err)
	}

	cases := []struct {
		name   string
		off, n int64
		served bool // ReadNoWait must serve it
	}{
		{"data in page cache", 0, 4096, true},
		{"zero clusters", 1 << 20, 64 << 10, true},
		{"preallocated host hole", 6 << 20, 4096, true},
		{"compressed", 4 << 20, 4096, false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			want := make([]byte, c.n)
			if _, err := img.ReadAt(ctx, want, c.off); err != nil {
				t.Fatal(err)
			}
			got := make([]byte, c.n)
			ok := img.ReadNoWait(got, c.off)
			if ok != c.served {
				t.Fatalf("served %v, want %v", ok, c.served)
			}
			if ok && !bytes.Equal(got, want) {
				t.Fatal("ReadNoWait differs from ReadAt")
			}
		})
	}
	// Random ranges: never a wrong byte.
	r := rand.New(rand.NewPCG(1, 2))
	served := 0
	for i := 0; i < 2000; i++ {
		off := r.Int64N(size - 1)
		n := 1 + r.Int64N(min(size-off, 200<<10))
		want := make([]byte, n)
		if _, err := img.ReadAt(ctx, want, off); err != nil {
			t.Fatal(err)
		}
		got := make([]byte, n)
		if img.ReadNoWait(got, off) {
			served++
			if !bytes.Equal(got, want) {
				t.Fatalf("ReadNoWait(%d, %#x) differs from ReadAt", n, off)
			}
		}
	}
	if served == 0 {
		t.Fatal("ReadNoWait served none of 2000 random reads")
	}
}

// TestHostHoleRunGoesStale: a hole run remembered by one read is not
// trusted after a write fills part of it. Writers fill clusters of a
// metadata-preallocated image (all one host hole) while readers keep
// reading, so that hole runs are found and cached around the writes;
// a read that starts after a write returned must return its data.
func TestHostHoleRunGoesStale(t *testing.T) {
	path := filepath.Join(t.TempDir(), "a.qcow2")
	const size, cs = 32 << 20, 64 << 10
	if err := Create(path, CreateOptions{Size: size, Preallocation: "metadata"}); err != nil {
		t.Fatal(err)
	}
	img, err := Open(path, Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer img.Close()
	const clusters = size / cs
	value := func(c int64) byte { return byte(c%250 + 1) }
	done := make([]atomic.Bool, clusters) // the write of cluster c returned
	// check: p, read from cluster c, holds zeros or c's value, and only
	// c's value if its write had returned before the read started.
	check := func(c int64, p []byte, wasDone bool, how string) error {
		for _, b := range p {
			if b != value(c) && (wasDone || b != 0) {
				return fmt.Errorf("%s of cluster %d: byte %#x (write returned before the read: %v)", how, c, b, wasDone)
			}
		}
		return nil
	}
	var wg sync.WaitGroup
	errs := make(chan error, 4)
	for w := range 2 {
		wg.Go(func() {
			p := make([]byte, cs)
			for c := int64(w); c < clusters; c += 2 {
				for i := range p {
					p[i] = value(c)
				}
				if _, err := img.WriteAt(ctx, p, c*cs, 0); err != nil {
					errs <- err
					return
				}
				done[c].Store(true)
			}
		})
	}
	for r := range 2 {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(r), 1))
			p := make([]byte, 4096)
			for range 20000 {
				c := rng.Int64N(clusters)
				off := c*cs + rng.Int64N(cs/4096)*4096
				wasDone := done[c].Load()
				how := "ReadNoWait"
				if !img.ReadNoWait(p, off) {
					how = "ReadAt"
					if _, err := img.ReadAt(ctx, p, off); err != nil {
						errs <- err
						return
					}
				}
				if err := check(c, p, wasDone, how); err != nil {
					errs <- err
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	p := make([]byte, cs)
	for c := int64(0); c < clusters; c++ {
		how := "final ReadNoWait"
		if !img.ReadNoWait(p, c*cs) {
			how = "final ReadAt"
			if _, err := img.ReadAt(ctx, p, c*cs); err != nil {
				t.Fatal(err)
			}
		}
		if err := check(c, p, true, how); err != nil {
			t.Fatal(err)
		}
	}
}

// TestHostRunsRemembered: on a metadata-preallocated image made by
// qemu-img, whose L2 tables sit between the runs they map (so the file
// has one hole per table), block status finds each hole once: a second
// sweep in another order makes no lseek. A write makes the holes stale;
// the next sweep looks again and sees the written cluster as data.
func TestHostRunsRemembered(t *testing.T) {
	path := filepath.Join(t.TempDir(), "a.qcow2")
	const size, cs = 64 << 20, 4096
	out, err := exec.Command("qemu-img", "create", "-q", "-f", "qcow2", "-o",
		"preallocation=metadata,cluster_size=4096", path, "64M").CombinedOutput()
	if err != nil {
		t.Fatalf("qemu-img create: %v\n%s", err, out)
	}
	img, err := Open(path, Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer img.Close()
	rng := rand.New(rand.NewPCG(1, 2))
	sweep := func(data int64) {
		t.Helper()
		for _, c := range rng.Perm(size / cs) {
			off := int64(c) * cs
			e, err := block.FirstExtent(ctx, img, off, cs)
			if err != nil {
				t.Fatal(err)
			}
			if isData := e.Status&block.StatusZero == 0; isData != (off == data) {
				t.Fatalf("guest offset %#x: extent %+v", off, e)
			}
		}
	}
	sweep(-1)
	first := img.hostLookups.Load()
	if n := len(img.hostRuns.Load().runs); n < 16 {
		t.Fatalf("%d runs remembered after a sweep; the file has a hole per L2 table (32)", n)
	}
	sweep(-1)
	if again := img.hostLookups.Load() - first; again != 0 {
		t.Fatalf("a second sweep made %d lseeks (the first %d)", again, first)
	}
	if _, err := img.WriteAt(ctx, bytes.Repeat([]byte{1}, cs), 5*cs, 0); err != nil {
		t.Fatal(err)
	}
	before := img.hostLookups.Load()
	sweep(5 * cs)
	if img.hostLookups.Load() == before {
		t.Fatal("no lseek after a write made the remembered holes stale")
	}
}
