package qcow2

import (
	"encoding/binary"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
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
	cases := []struct {
		name   string
		damage func(t *testing.T, p string)
	}{
		{"clean", func(t *testing.T, p string) {}},
		{"leak", func(t *testing.T, p string) { patch16(t, p, rb+2*0x1a, 1) }},
		{"leaks-and-corruption", func(t *testing.T, p string) {
			patch16(t, p, rb+2*0x1b, 2)
			patch16(t, p, rb+2*7, 0)
		}},
		{"refcount-zero-under-data", func(t *testing.T, p string) { patch16(t, p, rb+2*6, 0) }},
		{"copied-flag-cleared", func(t *testing.T, p string) {
			patch64(t, p, l2+8*2, func(v uint64) uint64 { return v &^ flagCopied })
		}},
		{"l1-copied-cleared", func(t *testing.T, p string) {
			patch64(t, p, l1, func(v uint64) uint64 { return v &^ flagCopied })
		}},
		{"l2-entry-into-l1", func(t *testing.T, p string) {
			patch64(t, p, l2+8*3, func(v uint64) uint64 { return flagCopied | l1 })
		}},
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
			got, err := img.Check(RepairNone)
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
			fixed, err := img.Check(mode)
			if err != nil {
				t.Fatal(err)
			}
			if fixed.Corruptions != 0 || fixed.Leaks != 0 {
				t.Fatalf("after repair: %+v", fixed)
			}
			if err := img.Close(); err != nil {
				t.Fatal(err)
			}
			after := qemuCheckJSONOf(t, p)
			if after.Corruptions != 0 || after.Leaks != 0 || after.CheckErrors != 0 {
				t.Fatalf("qemu-img check after ovis repair: %+v", after)
			}
		})
	}
}
