package qcow2

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"syscall"
	"testing"
)

// pokeU64 writes v big-endian at off in the file at p.
func pokeU64(t *testing.T, p string, off int64, v uint64) {
	t.Helper()
	f, err := os.OpenFile(p, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var b [8]byte
	binary.BigEndian.PutUint64(b[:], v)
	if _, err := f.WriteAt(b[:], off); err != nil {
		t.Fatal(err)
	}
}

// TestCheckRefcountSaturates: Check counts a cluster's references only up
// to the largest refcount the width holds, each further one an overflow
// corruption, as QEMU does; a repair never writes a count that wrapped
// (refcount_bits=1 stored 2 references as 0, freeing a cluster in use).
func TestCheckRefcountSaturates(t *testing.T) {
	for _, bits := range []int{1, 2, 4, 8, 16} {
		t.Run(fmt.Sprintf("refcount_bits=%d", bits), func(t *testing.T) {
			p := filepath.Join(t.TempDir(), "a.qcow2")
			runQemu(t, "qemu-img", "create", "-q", "-f", "qcow2", "-o", fmt.Sprintf("refcount_bits=%d", bits), p, "64M")
			runQemu(t, "qemu-io", "-f", "qcow2", "-c", "write -q -P 0x5a 0 64k", p)
			extra := min(1<<bits, 8191)
			for i := 1; i <= extra; i++ {
				pokeU64(t, p, 0x40000+int64(i)*8, 0x8000000000050000)
			}
			img, err := Open(p, Options{ForCheck: true})
			if err != nil {
				t.Fatal(err)
			}
			res, err := img.Check(ctx, RepairAll)
			if cerr := img.Close(); err == nil {
				err = cerr
			}
			if err != nil {
				t.Fatal(err)
			}
			max := uint64(1)<<bits - 1
			for _, r := range res.Repairs {
				if want := min(max, uint64(extra+1)); r.Kind == RepairRefcount && r.Cluster == 5 && r.After != want {
					t.Errorf("cluster 5 repaired to refcount %d, want %d", r.After, want)
				}
			}
			overflows := 0
			for _, m := range res.Messages {
				if m == "ERROR: overflow cluster offset=0x50000" {
					overflows++
				}
			}
			if want := extra + 1 - int(min(max, uint64(extra+1))); overflows != want {
				t.Errorf("%d overflow messages, want %d", overflows, want)
			}
			runQemu(t, "qemu-io", "-f", "qcow2", "-c", "write -q -P 0x77 1M 64k", "-c", "read -q -P 0x5a 0 64k", p)
		})
	}
}

// TestSnapshotFailureChangesNothing: a CreateSnapshot or ApplySnapshot
// that a refcount overflow or a corrupt entry makes fail leaves every
// byte of the image as it was, with QEMU's errno.
func TestSnapshotFailureChangesNothing(t *testing.T) {
	for _, tc := range []struct {
		name  string
		bits  int
		poke  func(p string)
		apply bool
		errno syscall.Errno
	}{
		{"create, overflow", 1, nil, false, syscall.EINVAL},
		{"create, no refcount block", 16, func(p string) { pokeU64(t, p, 0x40008, 0x8000010000050000) }, false, syscall.EAGAIN},
		{"apply, overflow", 2, nil, true, syscall.EINVAL},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := filepath.Join(t.TempDir(), "a.qcow2")
			runQemu(t, "qemu-img", "create", "-q", "-f", "qcow2", "-o", fmt.Sprintf("refcount_bits=%d", tc.bits), p, "64M")
			runQemu(t, "qemu-io", "-f", "qcow2", "-c", "write -q -P 0x5a 0 128k", p)
			if tc.apply {
				runQemu(t, "qemu-img", "snapshot", "-c", "a", p)
				runQemu(t, "qemu-img", "snapshot", "-c", "b", p)
			}
			if tc.poke != nil {
				tc.poke(p)
			}
			before, err := os.ReadFile(p)
			if err != nil {
				t.Fatal(err)
			}
			img, err := Open(p, Options{})
			if err != nil {
				t.Fatal(err)
			}
			if tc.apply {
				err = img.ApplySnapshot(ctx, "a")
			} else {
				err = img.CreateSnapshot(ctx, "", "s", 1, 2)
			}
			if !errors.Is(err, tc.errno) {
				t.Errorf("got %v, want %v", err, tc.errno)
			}
			if cerr := img.Close(); cerr != nil {
				t.Fatal(cerr)
			}
			after, err := os.ReadFile(p)
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(before, after) {
				t.Errorf("the failed snapshot changed the image")
			}
		})
	}
}

// TestCheckRefblockFarPastEnd: a refcount table entry 4 TiB past the end
// of a 4 KiB-cluster image. QEMU grows the file to 4 TiB and counts a
// billion clusters; ovis (8 bytes a count) ran out of memory. Past
// maxCheckClusters the table is rebuilt instead, without the entry
// (found by TestCheckRepairFuzzLikeQemu).
func TestCheckRefblockFarPastEnd(t *testing.T) {
	dir := t.TempDir()
	orig, p := filepath.Join(dir, "orig.qcow2"), filepath.Join(dir, "a.qcow2")
	runQemu(t, "qemu-img", "create", "-q", "-f", "qcow2", "-o", "cluster_size=4096", orig, "2M")
	runQemu(t, "qemu-io", "-f", "qcow2", "-c", "write -q -P 0x11 0 12k", "-c", "write -q -P 0x22 64k 8k", orig)
	b, err := os.ReadFile(orig)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(p, b, 0o644); err != nil {
		t.Fatal(err)
	}
	pokeU64(t, p, 0x1000, 0x40000002000)
	img, err := Open(p, Options{ForCheck: true})
	if err != nil {
		t.Fatal(err)
	}
	res, err := img.Check(ctx, RepairAll)
	if cerr := img.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		t.Fatal(err)
	}
	if res.Corruptions != 0 {
		t.Errorf("%d corruptions left: %q", res.Corruptions, res.Messages)
	}
	st, err := os.Stat(p)
	if err != nil {
		t.Fatal(err)
	}
	if st.Size() > 1<<20 {
		t.Errorf("the repair grew the file to %d bytes", st.Size())
	}
	qemuCheck(t, p)
	runQemu(t, "qemu-img", "compare", orig, p)
}
