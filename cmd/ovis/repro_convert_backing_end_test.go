package main

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/ovis-storage/ovis/internal/testutil"
)

// TestReproConvertBPastSourceBackingEnd: convert -B with a source whose
// backing file is shorter than it. Past the backing file's end the
// source's unallocated ranges are its own zeros, which QEMU writes as
// zeros into the output; they must not be left to the output's backing
// file, which holds data there (found by TestDifferentialVerbs, seed
// 9739865436502251754).
func TestReproConvertBPastSourceBackingEnd(t *testing.T) {
	t.Parallel()
	for _, tool := range []string{"qemu-img", "ovis"} {
		dir := filepath.Join(t.TempDir(), tool)
		mustQemuImg := func(args ...string) {
			t.Helper()
			if r := qemuImg(t, dir, args...); r.code != 0 {
				t.Fatalf("qemu-img %v: %s", args, r.stderr)
			}
		}
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		mustQemuImg("create", "-q", "-f", "qcow2", "b0.qcow2", "64K")
		mustQemuImg("create", "-q", "-f", "qcow2", "-o", "cluster_size=512", "-b", "b0.qcow2", "-F", "qcow2", "b1.qcow2", "2M")
		mustQemuImg("create", "-q", "-f", "qcow2", "-b", "b1.qcow2", "-F", "qcow2", "b2.qcow2", "2M")
		testutil.QemuIO(t, filepath.Join(dir, "b2.qcow2"), "qcow2", "write -P 0x0d 128k 128k")
		args := []string{"convert", "-q", "-f", "qcow2", "-O", "qcow2", "-B", "b2.qcow2", "-F", "qcow2", "b1.qcow2", "n2.qcow2"}
		var r result
		if tool == "qemu-img" {
			r = qemuImg(t, dir, args...)
		} else {
			r = ovisImg(t, dir, args...)
		}
		if r.code != 0 {
			t.Fatalf("%s convert: %s", tool, r.stderr)
		}
		// Both tools give n2 the guest data of b1: zeros.
		if r := qemuImg(t, dir, "compare", "-f", "qcow2", "-F", "qcow2", "b1.qcow2", "n2.qcow2"); r.code != 0 {
			t.Errorf("%s: n2 differs from its source: %s%s", tool, r.stdout, r.stderr)
		}
	}
}
