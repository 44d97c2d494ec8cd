package qcow2

import (
	"bytes"
	"encoding/binary"
	"math/rand"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
)

// TestAmend walks an image through compat and refcount-width changes; after
// each step qemu-img check is clean, qemu-img info shows the new options
// and the contents are unchanged.
func TestAmend(t *testing.T) {
	for _, backing := range []bool{false, true} {
		name := "nobacking"
		if backing {
			name = "backing"
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			dir := t.TempDir()
			p := filepath.Join(dir, "a.qcow2")
			if backing {
				b := filepath.Join(dir, "b.qcow2")
				runQemu(t, "qemu-img", "create", "-f", "qcow2", b, "8M")
				runQemu(t, "qemu-io", "-c", "write -P 4 0 8M", b)
				runQemu(t, "qemu-img", "create", "-f", "qcow2", "-b", "b.qcow2", "-F", "qcow2", p)
			} else {
				runQemu(t, "qemu-img", "create", "-f", "qcow2", p, "8M")
			}
			runQemu(t, "qemu-io", "-c", "write -P 1 0 2M", "-c", "write -z 1M 128k", "-c", "write -z 4M 64k", p)
			// A preallocated zero cluster too.
			runQemu(t, "qemu-io", "-c", "write -P 2 6M 64k", "-c", "write -z 6M 64k", p)
			img, err := Open(p, Options{})
			if err != nil {
				t.Fatal(err)
			}
			rng := rand.New(rand.NewSource(5))
			randomWrites(t, img, rng, 10)
			want := readAll(t, img)
			steps := []struct {
				o    AmendOptions
				info string
			}{
				{AmendOptions{RefcountBits: 64}, "refcount bits: 64"},
				{AmendOptions{RefcountBits: 1}, "refcount bits: 1"},
				{AmendOptions{RefcountBits: 16}, "refcount bits: 16"},
				{AmendOptions{Compat: "0.10"}, "compat: 0.10"},
				{AmendOptions{Compat: "1.1"}, "compat: 1.1"},
				{AmendOptions{LazyRefcounts: ptr(true)}, "lazy refcounts: true"},
				{AmendOptions{LazyRefcounts: ptr(false)}, "lazy refcounts: false"},
			}
			for _, st := range steps {
				if err := img.Amend(ctx, st.o); err != nil {
					t.Fatalf("amend %+v: %v", st.o, err)
				}
				if !bytes.Equal(readAll(t, img), want) {
					t.Fatalf("amend %+v changed the contents", st.o)
				}
				if err := img.Close(); err != nil {
					t.Fatal(err)
				}
				qemuCheck(t, p)
				if info := runQemu(t, "qemu-img", "info", p); !strings.Contains(info, st.info) {
					t.Fatalf("after amend %+v, qemu-img info lacks %q:\n%s", st.o, st.info, info)
				}
				if img, err = Open(p, Options{}); err != nil {
					t.Fatal(err)
				}
				if !bytes.Equal(readAll(t, img), want) {
					t.Fatalf("after amend %+v and reopen the contents differ", st.o)
				}
			}
			if err := img.Amend(ctx, AmendOptions{RefcountBits: 8, Compat: "0.10"}); err == nil {
				t.Fatal("downgrade with 8-bit refcounts succeeded")
			}
			img.Close()
		})
	}
}

func TestSetBacking(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "t.qcow2")
	runQemu(t, "qemu-img", "create", "-f", "raw", filepath.Join(dir, "b.raw"), "1M")
	runQemu(t, "qemu-img", "create", "-f", "qcow2", p, "1M")
	img, err := Open(p, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if err := img.SetBacking(ctx, "b.raw", "raw"); err != nil {
		t.Fatal(err)
	}
	img.Close()
	if info := runQemu(t, "qemu-img", "info", p); !strings.Contains(info, "backing file: b.raw") || !strings.Contains(info, "backing file format: raw") {
		t.Fatalf("qemu-img info:\n%s", info)
	}
	qemuCheck(t, p)
}

// snapshotRaw returns what snapshot id of the image at p reads, through
// qemu-img convert -l.
func snapshotRaw(t *testing.T, p, id string) []byte {
	t.Helper()
	raw := filepath.Join(t.TempDir(), "snap.raw")
	runQemu(t, "qemu-img", "convert", "-U", "-l", "snapshot.id="+id, "-O", "raw", p, raw)
	b, err := os.ReadFile(raw)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// TestAmendDowngradeSnapshots downgrades images whose snapshots hold zero
// clusters: in L2 tables shared with the active layer, in tables of their
// own, and preallocated zero clusters whose host cluster the active layer
// and a snapshot share. Every zero cluster must be expanded (qemu-img
// check would flag one left in a version 2 image), and neither the active
// layer nor any snapshot may read differently.
func TestAmendDowngradeSnapshots(t *testing.T) {
	for _, tc := range []struct {
		name    string
		backing bool
		// after runs qemu-io commands between the snapshot and the
		// downgrade.
		after []string
	}{
		{"shared tables", false, nil},
		{"shared tables with backing", true, nil},
		{"copied tables", false, []string{"write -P 5 0 64k", "write -z 6M 64k"}},
		{"zero over snapshot data", false, []string{"write -z 0 64k", "write -z 2M 64k", "write -z -u 3M 64k"}},
		{"zero over snapshot data with backing", true, []string{"write -z 0 64k", "write -z 2M 64k", "write -z 9M 64k"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			dir := t.TempDir()
			p := filepath.Join(dir, "a.qcow2")
			if tc.backing {
				b := filepath.Join(dir, "b.qcow2")
				runQemu(t, "qemu-img", "create", "-q", "-f", "qcow2", b, "16M")
				runQemu(t, "qemu-io", "-c", "write -P 4 0 16M", b)
				runQemu(t, "qemu-img", "create", "-q", "-f", "qcow2", "-b", "b.qcow2", "-F", "qcow2", p)
			} else {
				runQemu(t, "qemu-img", "create", "-q", "-f", "qcow2", p, "16M")
			}
			runQemu(t, "qemu-io", "-c", "write -P 1 0 4M", "-c", "write -z 1M 128k", "-c", "write -z 8M 64k",
				"-c", "write -z -u 3M 64k", "-c", "write -c -P 2 12M 64k", p)
			runQemu(t, "qemu-img", "snapshot", "-c", "s1", p)
			if len(tc.after) > 0 {
				args := []string{}
				for _, c := range tc.after {
					args = append(args, "-c", c)
				}
				runQemu(t, "qemu-io", append(args, p)...)
			}
			snap := snapshotRaw(t, p, "1")
			img, err := Open(p, Options{})
			if err != nil {
				t.Fatal(err)
			}
			want := readAll(t, img)
			var calls [][2]int64
			err = img.Amend(ctx, AmendOptions{Compat: "0.10", Progress: func(done, total int64) {
				calls = append(calls, [2]int64{done, total})
			}})
			if cerr := img.Close(); err == nil {
				err = cerr
			}
			if err != nil {
				t.Fatalf("downgrade: %v", err)
			}
			qemuCheck(t, p)
			if info := runQemu(t, "qemu-img", "info", p); !strings.Contains(info, "compat: 0.10") {
				t.Fatalf("not downgraded:\n%s", info)
			}
			// One report per L1 entry, active and snapshot, ending at the
			// total.
			if n := len(calls); n != 2 || calls[n-1][0] != calls[n-1][1] {
				t.Errorf("progress reports %v, want 2 ending at the total", calls)
			}
			if !bytes.Equal(snapshotRaw(t, p, "1"), snap) {
				t.Error("the snapshot reads differently after the downgrade")
			}
			img, err = Open(p, Options{ReadOnly: true})
			if err != nil {
				t.Fatal(err)
			}
			defer img.Close()
			if !bytes.Equal(readAll(t, img), want) {
				t.Error("the active layer reads differently after the downgrade")
			}
		})
	}
}

// TestAmendRefcountNarrowing refuses a refcount width too narrow for a
// refcount the image holds, with qemu-img's message (which names the
// first such cluster), and leaves the image as it was.
func TestAmendRefcountNarrowing(t *testing.T) {
	dir := t.TempDir()
	p, q := filepath.Join(dir, "a.qcow2"), filepath.Join(dir, "q.qcow2")
	runQemu(t, "qemu-img", "create", "-q", "-f", "qcow2", p, "16M")
	runQemu(t, "qemu-io", "-c", "write -P 1 0 4M", p)
	runQemu(t, "qemu-img", "snapshot", "-c", "s1", p)
	runQemu(t, "cp", p, q)
	out, err := exec.Command("qemu-img", "amend", "-o", "refcount_bits=1", q).CombinedOutput()
	if err == nil {
		t.Fatalf("qemu-img amend refcount_bits=1 succeeded on an image with a snapshot")
	}
	want := strings.TrimSpace(strings.TrimPrefix(string(out), "qemu-img: "))
	img, err := Open(p, Options{})
	if err != nil {
		t.Fatal(err)
	}
	err = img.Amend(ctx, AmendOptions{RefcountBits: 1})
	img.Close()
	if err == nil || err.Error() != want {
		t.Fatalf("amend refcount_bits=1: %v, want %q", err, want)
	}
	qemuCheck(t, p)
	if info := runQemu(t, "qemu-img", "info", p); !strings.Contains(info, "refcount bits: 16") {
		t.Fatalf("the refcount width changed:\n%s", info)
	}
}

// TestAmendStepOrder checks that the steps before a failing one stay done,
// as in QEMU: the refcount width changes before the backing file is
// compared, and lazy refcounts are refused before a downgrade.
func TestAmendStepOrder(t *testing.T) {
	for _, tc := range []struct {
		name string
		o    AmendOptions
		err  string
		info []string // what qemu-img info shows afterwards
	}{
		{"width then backing", AmendOptions{RefcountBits: 64, BackingFile: ptr("x")},
			ErrAmendBacking.Error(), []string{"refcount bits: 64", "compat: 1.1"}},
		{"lazy before downgrade", AmendOptions{Compat: "0.10", LazyRefcounts: ptr(true)},
			"Lazy refcounts only supported with compatibility level 1.1 and above (use compat=1.1 or greater)",
			[]string{"compat: 1.1", "lazy refcounts: false"}},
		{"size then downgrade", AmendOptions{Compat: "0.10", Size: 32 << 20, RefcountBits: 64},
			"Refcount widths other than 16 bits require compatibility level 1.1 or above (use compat=1.1 or greater)",
			[]string{"compat: 1.1", "refcount bits: 16", "virtual size: 16 MiB"}},
		{"data file", AmendOptions{DataFile: ptr("d"), RefcountBits: 3},
			"data-file can only be set for images that use an external data file", []string{"refcount bits: 16"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			p := filepath.Join(t.TempDir(), "a.qcow2")
			runQemu(t, "qemu-img", "create", "-q", "-f", "qcow2", p, "16M")
			runQemu(t, "qemu-io", "-c", "write -P 1 0 1M", p)
			img, err := Open(p, Options{})
			if err != nil {
				t.Fatal(err)
			}
			err = img.Amend(ctx, tc.o)
			img.Close()
			if err == nil || err.Error() != tc.err {
				t.Fatalf("amend: %v, want %q", err, tc.err)
			}
			qemuCheck(t, p)
			info := runQemu(t, "qemu-img", "info", p)
			for _, w := range tc.info {
				if !strings.Contains(info, w) {
					t.Errorf("qemu-img info lacks %q:\n%s", w, info)
				}
			}
		})
	}
}

// TestAmendShrinkWithSnapshot shrinks an image whose L2 tables a snapshot
// shares: the table cut in the middle must be copied, not edited in
// place, so that the snapshot keeps reading its data.
func TestAmendShrinkWithSnapshot(t *testing.T) {
	p := filepath.Join(t.TempDir(), "a.qcow2")
	// 4 KiB clusters: an L2 table covers 2 MiB.
	runQemu(t, "qemu-img", "create", "-q", "-f", "qcow2", "-o", "cluster_size=4k", p, "8M")
	runQemu(t, "qemu-io", "-c", "write -P 1 0 8M", p)
	runQemu(t, "qemu-img", "snapshot", "-c", "s1", p)
	snap := snapshotRaw(t, p, "1")
	img, err := Open(p, Options{})
	if err != nil {
		t.Fatal(err)
	}
	want := readAll(t, img)[:3<<20]
	err = img.Amend(ctx, AmendOptions{Size: 3 << 20})
	if cerr := img.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		t.Fatalf("shrink: %v", err)
	}
	qemuCheck(t, p)
	// qemu-img convert -l shows a snapshot at the current size.
	if got := snapshotRaw(t, p, "1"); !bytes.Equal(got, snap[:len(got)]) || len(got) != 3<<20 {
		t.Error("the snapshot reads differently after the shrink")
	}
	img, err = Open(p, Options{ReadOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	defer img.Close()
	if !bytes.Equal(readAll(t, img), want) {
		t.Error("the active layer reads differently after the shrink")
	}
}

// TestAmendUpgradeSnapshotTable upgrades a version 2 image whose snapshot
// entry records no disk size (older writers wrote none in version 2),
// which version 3 requires: the table must be rewritten with it. The
// upgrade reports progress as QEMU does: 0, 1 and 2 of 2.
func TestAmendUpgradeSnapshotTable(t *testing.T) {
	p := filepath.Join(t.TempDir(), "a.qcow2")
	runQemu(t, "qemu-img", "create", "-q", "-f", "qcow2", "-o", "compat=0.10", p, "16M")
	runQemu(t, "qemu-img", "snapshot", "-c", "s1", p)
	// Keep only the entry's first 8 bytes of extra data, the 64-bit VM
	// state size; its ID and name move up.
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	off := binary.BigEndian.Uint64(b[64:])
	binary.BigEndian.PutUint32(b[off+36:], 8)
	copy(b[off+48:], b[off+64:off+67])
	if err := os.WriteFile(p, b, 0o644); err != nil {
		t.Fatal(err)
	}
	img, err := Open(p, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if s := img.Snapshots()[0]; s.HasDiskSize {
		t.Fatal("a version 2 snapshot records its disk size; the test needs one that does not")
	}
	var calls [][2]int64
	err = img.Amend(ctx, AmendOptions{Compat: "1.1", Progress: func(done, total int64) {
		calls = append(calls, [2]int64{done, total})
	}})
	if cerr := img.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		t.Fatalf("upgrade: %v", err)
	}
	if want := [][2]int64{{0, 2}, {1, 2}, {2, 2}}; !reflect.DeepEqual(calls, want) {
		t.Errorf("progress %v, want %v", calls, want)
	}
	qemuCheck(t, p)
	img, err = Open(p, Options{ReadOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	defer img.Close()
	if s := img.Snapshots()[0]; !s.HasDiskSize || s.DiskSize != 16<<20 {
		t.Errorf("snapshot after the upgrade: disk size %d (recorded: %v), want 16 MiB", s.DiskSize, s.HasDiskSize)
	}
}
