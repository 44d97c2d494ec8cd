package qcow2

import (
	"bytes"
	"math/rand"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
)

// qemuCheck runs qemu-img check and fails on any error or leak.
func qemuCheck(t *testing.T, path string) {
	t.Helper()
	out, err := exec.Command("qemu-img", "check", path).CombinedOutput()
	if err != nil {
		t.Fatalf("qemu-img check %s: %v\n%s", path, err, out)
	}
}

func TestEngineSmoke(t *testing.T) {
	for _, tc := range []struct {
		name string
		o    CreateOptions
	}{
		{"default", CreateOptions{}},
		{"512", CreateOptions{ClusterSize: 512}},
		{"v2", CreateOptions{Compat: "0.10"}},
		{"rc1", CreateOptions{RefcountBits: 1, ClusterSize: 4096}},
		{"rc64", CreateOptions{RefcountBits: 64, ClusterSize: 4096}},
		{"extl2", CreateOptions{ExtendedL2: true}},
		{"lazy", CreateOptions{LazyRefcounts: true}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			path := filepath.Join(dir, "a.qcow2")
			o := tc.o
			o.Size = 16 << 20
			if err := Create(path, o); err != nil {
				t.Fatal(err)
			}
			qemuCheck(t, path)
			img, err := Open(path, Options{})
			if err != nil {
				t.Fatal(err)
			}
			model := make([]byte, o.Size)
			rng := rand.New(rand.NewSource(1))
			for i := 0; i < 300; i++ {
				off := rng.Int63n(o.Size)
				n := rng.Int63n(min(200000, o.Size-off)) + 1
				switch rng.Intn(4) {
				case 0, 1:
					p := make([]byte, n)
					rng.Read(p)
					if _, err := img.WriteAt(p, off, rng.Intn(10) == 0); err != nil {
						t.Fatalf("write %d@%d: %v", n, off, err)
					}
					copy(model[off:], p)
				case 2:
					if err := img.WriteZeroes(off, n, rng.Intn(2) == 0, false); err != nil {
						t.Fatalf("zero %d@%d: %v", n, off, err)
					}
					clear(model[off : off+n])
				case 3:
					if rng.Intn(5) == 0 {
						if err := img.Flush(); err != nil {
							t.Fatal(err)
						}
					}
				}
			}
			got := make([]byte, o.Size)
			if _, err := img.ReadAt(got, 0); err != nil {
				t.Fatal(err)
			}
			if i := firstDiff(got, model); i >= 0 {
				t.Fatalf("differs at %d before close", i)
			}
			if err := img.Close(); err != nil {
				t.Fatal(err)
			}
			qemuCheck(t, path)
			raw := filepath.Join(dir, "a.raw")
			os.WriteFile(raw, model, 0o644)
			if out, err := exec.Command("qemu-img", "compare", "-f", "qcow2", "-F", "raw", path, raw).CombinedOutput(); err != nil {
				t.Fatalf("compare: %v %s", err, out)
			}
		})
	}
}

func firstDiff(a, b []byte) int {
	if bytes.Equal(a, b) {
		return -1
	}
	for i := range a {
		if a[i] != b[i] {
			return i
		}
	}
	return len(a)
}
