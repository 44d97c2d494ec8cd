package qcow2

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"syscall"
	"testing"
)

type qemuCheckJSON struct {
	CheckErrors int   `json:"check-errors"`
	Corruptions int   `json:"corruptions"`
	Leaks       int   `json:"leaks"`
	ImageEnd    int64 `json:"image-end-offset"`
	Allocated   int64 `json:"allocated-clusters"`
	Total       int64 `json:"total-clusters"`
	Fragmented  int64 `json:"fragmented-clusters"`
	Compressed  int64 `json:"compressed-clusters"`
}

func qemuCheckJSONOf(t *testing.T, path string) qemuCheckJSON {
	t.Helper()
	out, _ := exec.Command("qemu-img", "check", "--output=json", path).Output()
	var r qemuCheckJSON
	if err := json.Unmarshal(out, &r); err != nil {
		t.Fatalf("qemu-img check json: %v: %s", err, out)
	}
	return r
}

// patch overwrites 8 bytes at off with f(old).
func patch64(t *testing.T, path string, off int64, f func(uint64) uint64) {
	t.Helper()
	fh, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer fh.Close()
	var b [8]byte
	fh.ReadAt(b[:], off)
	binary.BigEndian.PutUint64(b[:], f(binary.BigEndian.Uint64(b[:])))
	fh.WriteAt(b[:], off)
}

func patch16(t *testing.T, path string, off int64, v uint16) {
	t.Helper()
	fh, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer fh.Close()
	var b [2]byte
	binary.BigEndian.PutUint16(b[:], v)
	fh.WriteAt(b[:], off)
}

// TestCheckAgainstQemu damages images the way the issue lists and
// compares ovis's check with qemu-img's, then repairs.
func TestCheckAgainstQemu(t *testing.T) {
	// Layout of a fresh 64 KiB-cluster image: refcount table at 0x10000,
	// refcount block at 0x20000, L1 at 0x30000; after writing 0..1M the
	// L2 table is at 0x40000 and data from 0x50000.
	const rb, l1, l2 = 0x20000, 0x30000, 0x40000
	const rebuild, refcount, copiedL1, copiedL2 = RepairRebuild, RepairRefcount, RepairCopiedL1, RepairCopiedL2
	cases := []struct {
		name   string
		damage func(t *testing.T, p string)
		// repairs are the kinds of the repairs made, in order; a rebuild
		// frees the old refcount table and block (clusters 1 and 2).
		repairs []RepairKind
	}{
		{"clean", func(t *testing.T, p string) {}, nil},
		{"leak", func(t *testing.T, p string) { patch16(t, p, rb+2*0x1a, 1) }, []RepairKind{refcount}},
		{"leaks-and-corruption", func(t *testing.T, p string) {
			patch16(t, p, rb+2*0x1b, 2)
			patch16(t, p, rb+2*7, 0)
		}, []RepairKind{rebuild, refcount, refcount}},
		{"refcount-zero-under-data", func(t *testing.T, p string) { patch16(t, p, rb+2*6, 0) }, []RepairKind{rebuild, refcount, refcount}},
		{"copied-flag-cleared", func(t *testing.T, p string) {
			patch64(t, p, l2+8*2, func(v uint64) uint64 { return v &^ flagCopied })
		}, []RepairKind{copiedL2}},
		{"l1-copied-cleared", func(t *testing.T, p string) {
			patch64(t, p, l1, func(v uint64) uint64 { return v &^ flagCopied })
		}, []RepairKind{copiedL1}},
		{"l2-entry-into-l1", func(t *testing.T, p string) {
			patch64(t, p, l2+8*3, func(v uint64) uint64 { return flagCopied | l1 })
		}, []RepairKind{refcount, refcount, copiedL2}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			p := filepath.Join(t.TempDir(), "c.qcow2")
			if out, err := exec.Command("qemu-img", "create", "-f", "qcow2", p, "64M").CombinedOutput(); err != nil {
				t.Fatalf("%v %s", err, out)
			}
			// 2 MiB written, the second MiB discarded: clusters 0x15..0x24
			// are free but inside the file.
			if out, err := exec.Command("qemu-io", "-c", "write -P 7 0 2M", "-c", "discard 1M 1M", p).CombinedOutput(); err != nil {
				t.Fatalf("%v %s", err, out)
			}
			tc.damage(t, p)
			want := qemuCheckJSONOf(t, p)
			t.Logf("qemu-img check: %+v", want)
			if tc.name != "clean" && want.Corruptions+want.Leaks == 0 {
				t.Fatal("the damage did not damage")
			}
			img, err := Open(p, Options{})
			if err != nil {
				t.Fatal(err)
			}
			got, err := img.Check(ctx, RepairNone)
			if err != nil {
				t.Fatal(err)
			}
			if got.Corruptions != want.Corruptions || got.Leaks != want.Leaks || got.CheckErrors != want.CheckErrors ||
				got.ImageEndOffset != want.ImageEnd || got.AllocatedClusters != want.Allocated || got.TotalClusters != want.Total ||
				got.FragmentedClusters != want.Fragmented {
				t.Fatalf("ovis %+v\nqemu %+v", got, want)
			}
			mode := RepairAll
			if want.Corruptions == 0 {
				mode = RepairLeaks
			}
			fixed, err := img.Check(ctx, mode)
			if err != nil {
				t.Fatal(err)
			}
			if fixed.Corruptions != 0 || fixed.Leaks != 0 {
				t.Fatalf("after repair: %+v", fixed)
			}
			var kinds []RepairKind
			for _, r := range fixed.Repairs {
				kinds = append(kinds, r.Kind)
			}
			if !slices.Equal(kinds, tc.repairs) {
				t.Errorf("repairs %v (%+v), want kinds %v", kinds, fixed.Repairs, tc.repairs)
			}
			if n := len(fixed.Repairs); n != fixed.LeaksFixed+fixed.CorruptionsFixed && !(n > 0 && fixed.Repairs[0].Kind == RepairRebuild) {
				t.Errorf("%d repairs listed, %d leaks and %d corruptions fixed", n, fixed.LeaksFixed, fixed.CorruptionsFixed)
			}
			// Like QEMU, the repair pass does not check again: that is
			// the caller's double check.
			again, err := img.Check(ctx, RepairNone)
			if err != nil {
				t.Fatal(err)
			}
			if again.Corruptions != 0 || again.Leaks != 0 || again.CheckErrors != 0 || len(again.Messages) != 0 {
				t.Fatalf("check after repair: %+v", again)
			}
			// The repaired image stays in use: new clusters must come from
			// the repaired refcounts (freed clusters may be reused).
			w := bytes.Repeat([]byte{9}, 3<<16)
			if _, err := img.WriteAt(ctx, w, 8<<20, 0); err != nil {
				t.Fatalf("write after repair: %v", err)
			}
			if err := img.Close(); err != nil {
				t.Fatal(err)
			}
			if out, err := exec.Command("qemu-io", "-r", "-c", "read -P 9 8M 192k", "-c", "read -P 7 0 64k", p).CombinedOutput(); err != nil || bytes.Contains(out, []byte("Pattern verification failed")) {
				t.Fatalf("qemu-io after repair and write: %v\n%s", err, out)
			}
			after := qemuCheckJSONOf(t, p)
			if after.Corruptions != 0 || after.Leaks != 0 || after.CheckErrors != 0 {
				t.Fatalf("qemu-img check after ovis repair: %+v", after)
			}
		})
	}
}

// TestCheckRepairLeaksNeedsRebuild: a refcount of 0 under live data can
// only be repaired by a rebuild, which -r leaks does not do; QEMU fails
// with EIO and leaves the refcounts alone, and so must Check.
func TestCheckRepairLeaksNeedsRebuild(t *testing.T) {
	const rb = 0x20000
	p := filepath.Join(t.TempDir(), "c.qcow2")
	if out, err := exec.Command("qemu-img", "create", "-f", "qcow2", p, "64M").CombinedOutput(); err != nil {
		t.Fatalf("%v %s", err, out)
	}
	if out, err := exec.Command("qemu-io", "-c", "write -P 7 0 1M", p).CombinedOutput(); err != nil {
		t.Fatalf("%v %s", err, out)
	}
	patch16(t, p, rb+2*6, 0)
	before := qemuCheckJSONOf(t, p)
	img, err := Open(p, Options{})
	if err != nil {
		t.Fatal(err)
	}
	res, err := img.Check(ctx, RepairLeaks)
	if !errors.Is(err, ErrNeedRebuild) || !errors.Is(err, syscall.EIO) {
		t.Fatalf("Check(RepairLeaks) = %v, want ErrNeedRebuild (EIO)", err)
	}
	want := []string{"ERROR cluster 6 refcount=0 reference=1", "ERROR need to rebuild refcount structures"}
	if !slices.Equal(res.Messages, want) || len(res.Repairs) != 0 || res.CheckErrors != 1 {
		t.Errorf("result %+v, want messages %q, one check error and no repairs", res, want)
	}
	if err := img.Close(); err != nil {
		t.Fatal(err)
	}
	if after := qemuCheckJSONOf(t, p); after != before || after.Corruptions == 0 {
		t.Errorf("qemu-img check after the failed repair: %+v, before it: %+v", after, before)
	}
}

// countdownCtx is a context whose Err reports cancellation from its
// n+1st call on: it stops Check at its n+1st stop point.
type countdownCtx struct {
	context.Context
	n int
}

func (c *countdownCtx) Err() error {
	if c.n--; c.n < 0 {
		return context.Canceled
	}
	return nil
}

// TestCheckContextStopsSafely stops a repair at each of its stop points
// in turn, until one is past the end. Each stop must return the
// context's error and leave an image that qemu-img finds no more corrupt
// than before (leaks allowed), that reads as before, and that is still
// marked dirty if it was: the refcounts not reached may be too low.
func TestCheckContextStopsSafely(t *testing.T) {
	const rb, l2 = 0x20000, 0x40000
	leaks := func(t *testing.T, p string) {
		for c := int64(0x1a); c < 0x20; c++ {
			patch16(t, p, rb+2*c, 1)
		}
	}
	cases := []struct {
		name   string
		opts   string
		damage func(t *testing.T, p string)
	}{
		{"leaks", "", leaks},
		{"rebuild and leaks", "", func(t *testing.T, p string) {
			leaks(t, p)
			patch16(t, p, rb+2*6, 0)
		}},
		{"COPIED flags and leaks", "", func(t *testing.T, p string) {
			leaks(t, p)
			for i := int64(0); i < 8; i++ {
				patch64(t, p, l2+8*i, func(v uint64) uint64 { return v &^ flagCopied })
			}
		}},
		{"dirty", "lazy_refcounts=on", func(t *testing.T, p string) {
			exec.Command("qemu-io", "-c", "write -P 7 2M 1M", "-c", "sigraise 9", p).Run()
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			dir := t.TempDir()
			orig := filepath.Join(dir, "orig.qcow2")
			args := []string{"create", "-q", "-f", "qcow2", orig, "64M"}
			if tc.opts != "" {
				args = append(args, "-o", tc.opts)
			}
			if out, err := exec.Command("qemu-img", args...).CombinedOutput(); err != nil {
				t.Fatalf("%v %s", err, out)
			}
			if out, err := exec.Command("qemu-io", "-c", "write -P 7 0 2M", "-c", "discard 1M 1M", orig).CombinedOutput(); err != nil {
				t.Fatalf("%v %s", err, out)
			}
			tc.damage(t, orig)
			before := qemuCheckJSONOf(t, orig)
			if before.Corruptions+before.Leaks == 0 {
				t.Fatal("the damage did not damage")
			}
			dirty := readIncompat(t, orig)&IncompatDirty != 0
			for n := 0; ; n++ {
				p := filepath.Join(dir, "c.qcow2")
				b, err := os.ReadFile(orig)
				if err != nil {
					t.Fatal(err)
				}
				if err := os.WriteFile(p, b, 0o644); err != nil {
					t.Fatal(err)
				}
				img, err := Open(p, Options{ForCheck: true})
				if err != nil {
					t.Fatal(err)
				}
				_, cerr := img.Check(&countdownCtx{Context: context.Background(), n: n}, RepairAll)
				if err := img.Close(); err != nil {
					t.Fatalf("stop point %d: close: %v", n, err)
				}
				if cerr != nil && !errors.Is(cerr, context.Canceled) {
					t.Fatalf("stop point %d: %v, want context.Canceled", n, cerr)
				}
				after := qemuCheckJSONOf(t, p)
				if after.CheckErrors != 0 || after.Corruptions > before.Corruptions {
					t.Errorf("stop point %d: qemu-img check %+v, before the repair %+v", n, after, before)
				}
				if cerr != nil && dirty && readIncompat(t, p)&IncompatDirty == 0 {
					t.Errorf("stop point %d: the dirty bit was cleared", n)
				}
				if out, err := exec.Command("qemu-io", "-r", "-c", "read -P 7 0 1M", "-c", "read -P 0 1M 1M", p).CombinedOutput(); err != nil || bytes.Contains(out, []byte("verification failed")) {
					t.Errorf("stop point %d: qemu-io: %v\n%s", n, err, out)
				}
				if cerr == nil {
					if after.Corruptions+after.Leaks != 0 {
						t.Errorf("after the whole repair: %+v", after)
					}
					t.Logf("%d stop points", n)
					return
				}
			}
		})
	}
}

// readIncompat reads the incompatible feature bits of the image at p.
func readIncompat(t *testing.T, p string) uint64 {
	t.Helper()
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	return binary.BigEndian.Uint64(b[72:])
}

// TestCheckRebuildSparesOldBlocks: a refcount table entry check cannot
// count (reserved bits, misaligned) still names a block. QEMU's rebuild
// refuses to write over it (its overlap check); ovis rebuilds elsewhere,
// so the old structures stay intact until the header names the new ones.
func TestCheckRebuildSparesOldBlocks(t *testing.T) {
	const rt, rb = 0x10000, 0x20000
	for _, tc := range []struct {
		name  string
		entry func(uint64) uint64
	}{
		{"reserved bits", func(v uint64) uint64 { return v | 1 }},
		{"misaligned", func(v uint64) uint64 { return v + 0x200 }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			p := filepath.Join(t.TempDir(), "c.qcow2")
			if out, err := exec.Command("qemu-img", "create", "-f", "qcow2", p, "64M").CombinedOutput(); err != nil {
				t.Fatalf("%v %s", err, out)
			}
			if out, err := exec.Command("qemu-io", "-c", "write -P 7 0 1M", p).CombinedOutput(); err != nil {
				t.Fatalf("%v %s", err, out)
			}
			patch64(t, p, rt, tc.entry)
			img, err := Open(p, Options{ForCheck: true})
			if err != nil {
				t.Fatal(err)
			}
			if _, err := img.Check(ctx, RepairAll); err != nil {
				t.Fatal(err)
			}
			if err := img.Close(); err != nil {
				t.Fatal(err)
			}
			b, err := os.ReadFile(p)
			if err != nil {
				t.Fatal(err)
			}
			table := binary.BigEndian.Uint64(b[48:])
			for i := uint64(0); i < uint64(binary.BigEndian.Uint32(b[56:]))<<16/8; i++ {
				if e := binary.BigEndian.Uint64(b[table+8*i:]); e>>16 == rb>>16 {
					t.Errorf("rebuilt refcount table entry %d is %#x, over the old block at %#x", i, e, rb)
				}
			}
			if after := qemuCheckJSONOf(t, p); after.Corruptions != 0 || after.Leaks != 0 || after.CheckErrors != 0 {
				t.Errorf("qemu-img check after the rebuild: %+v", after)
			}
		})
	}
}
