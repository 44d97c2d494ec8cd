package qcow2

import (
	"bytes"
	"math/rand"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

func runQemu(t *testing.T, name string, args ...string) string {
	t.Helper()
	out, err := exec.Command(name, args...).CombinedOutput()
	if err != nil {
		t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
	}
	return string(out)
}

func readAll(t *testing.T, img *Image) []byte {
	t.Helper()
	buf := make([]byte, img.Size())
	if _, err := img.ReadAt(ctx, buf, 0); err != nil {
		t.Fatal(err)
	}
	return buf
}

func randomWrites(t *testing.T, img *Image, rng *rand.Rand, n int) {
	t.Helper()
	for i := 0; i < n; i++ {
		off := rng.Int63n(img.Size())
		p := make([]byte, rng.Int63n(min(256<<10, img.Size()-off))+1)
		rng.Read(p)
		if _, err := img.WriteAt(ctx, p, off, 0); err != nil {
			t.Fatal(err)
		}
	}
}

// TestSnapshotCycle creates, applies and deletes internal snapshots with
// ovis and with qemu-img in turn; both tools must agree on the contents
// and qemu-img check must stay clean after every step.
func TestSnapshotCycle(t *testing.T) {
	for _, cs := range []string{"4096", "65536"} {
		for _, compat := range []string{"0.10", "1.1"} {
			t.Run(cs+"-"+compat, func(t *testing.T) {
				t.Parallel()
				dir := t.TempDir()
				p := filepath.Join(dir, "s.qcow2")
				runQemu(t, "qemu-img", "create", "-f", "qcow2", "-o", "cluster_size="+cs+",compat="+compat, p, "8M")
				runQemu(t, "qemu-io", "-c", "write -P 1 0 3M", "-c", "write -c -P 2 4M 64k", p)
				rng := rand.New(rand.NewSource(3))

				img, err := Open(p, Options{})
				if err != nil {
					t.Fatal(err)
				}
				a := readAll(t, img)
				if err := img.CreateSnapshot(ctx, "", "ovis-a", 1700000000, 5); err != nil {
					t.Fatal(err)
				}
				randomWrites(t, img, rng, 40)
				b := readAll(t, img)
				if err := img.Close(); err != nil {
					t.Fatal(err)
				}
				qemuCheck(t, p)
				if l := runQemu(t, "qemu-img", "snapshot", "-l", p); !strings.Contains(l, "ovis-a") {
					t.Fatalf("qemu-img does not list the snapshot:\n%s", l)
				}

				// QEMU snapshots the current state; ovis applies ovis-a.
				runQemu(t, "qemu-img", "snapshot", "-c", "qemu-b", p)
				img, err = Open(p, Options{})
				if err != nil {
					t.Fatal(err)
				}
				if err := img.ApplySnapshot(ctx, "ovis-a"); err != nil {
					t.Fatal(err)
				}
				if !bytes.Equal(readAll(t, img), a) {
					t.Fatal("after applying ovis-a the disk differs from when it was taken")
				}
				randomWrites(t, img, rng, 20)
				if err := img.Close(); err != nil {
					t.Fatal(err)
				}
				qemuCheck(t, p)

				// QEMU applies its own snapshot: it must see the state b.
				runQemu(t, "qemu-img", "snapshot", "-a", "qemu-b", p)
				raw := filepath.Join(dir, "b.raw")
				if err := os.WriteFile(raw, b, 0o644); err != nil {
					t.Fatal(err)
				}
				runQemu(t, "qemu-img", "compare", "-f", "qcow2", "-F", "raw", p, raw)

				// ovis deletes both, QEMU checks.
				img, err = Open(p, Options{})
				if err != nil {
					t.Fatal(err)
				}
				for _, s := range []string{"ovis-a", "qemu-b"} {
					if err := img.DeleteSnapshot(ctx, s); err != nil {
						t.Fatal(err)
					}
				}
				if len(img.Snapshots()) != 0 {
					t.Fatalf("%d snapshots left", len(img.Snapshots()))
				}
				if !bytes.Equal(readAll(t, img), b) {
					t.Fatal("deleting snapshots changed the active layer")
				}
				if err := img.Close(); err != nil {
					t.Fatal(err)
				}
				qemuCheck(t, p)
				runQemu(t, "qemu-img", "compare", "-f", "qcow2", "-F", "raw", p, raw)
			})
		}
	}
}

// TestResize grows (with L1 growth) and shrinks images and checks them
// with qemu-img.
func TestResize(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "r.qcow2")
	// 512-byte clusters: one L2 table maps 32 KiB, so 64 MiB needs an L1
	// table of 16 KiB and 256 MiB one of 64 KiB.
	if err := Create(p, CreateOptions{Size: 64 << 20, ClusterSize: 512}); err != nil {
		t.Fatal(err)
	}
	img, err := Open(p, Options{})
	if err != nil {
		t.Fatal(err)
	}
	rng := rand.New(rand.NewSource(9))
	randomWrites(t, img, rng, 30)
	before := readAll(t, img)
	if err := img.Resize(ctx, 256<<20, false, PreallocOff); err != nil {
		t.Fatal(err)
	}
	after := readAll(t, img)
	if !bytes.Equal(after[:len(before)], before) || !bytes.Equal(after[len(before):], make([]byte, len(after)-len(before))) {
		t.Fatal("grown image does not read old data followed by zeros")
	}
	p2 := make([]byte, 1<<20)
	rng.Read(p2)
	if _, err := img.WriteAt(ctx, p2, 200<<20, 0); err != nil {
		t.Fatal(err)
	}
	if err := img.Close(); err != nil {
		t.Fatal(err)
	}
	qemuCheck(t, p)
	if info := runQemu(t, "qemu-img", "info", p); !strings.Contains(info, "256 MiB") {
		t.Fatalf("qemu-img info after grow:\n%s", info)
	}

	img, err = Open(p, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if err := img.Resize(ctx, 32<<20, false, ""); err == nil {
		t.Fatal("shrink without shrink=true succeeded")
	}
	if err := img.Resize(ctx, 32<<20+512, true, ""); err != nil {
		t.Fatal(err)
	}
	got := readAll(t, img)
	if !bytes.Equal(got, before[:len(got)]) {
		t.Fatal("shrunk image lost data below the new end")
	}
	if err := img.Close(); err != nil {
		t.Fatal(err)
	}
	qemuCheck(t, p)
	raw := filepath.Join(dir, "r.raw")
	os.WriteFile(raw, got, 0o644)
	runQemu(t, "qemu-img", "compare", "-f", "qcow2", "-F", "raw", p, raw)

	// Grow with metadata preallocation.
	img, err = Open(p, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if err := img.Resize(ctx, 40<<20, false, PreallocMetadata); err != nil {
		t.Fatal(err)
	}
	if err := img.Close(); err != nil {
		t.Fatal(err)
	}
	qemuCheck(t, p)
}
