package main

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"

	"github.com/ovis-storage/ovis/internal/testutil"
)

// TestNBDDiscardUnmapFreesHostSpace: under --discard=unmap a TRIM of a
// qcow2 image gives the host space back, as qemu-nbd's does (discard=unmap
// turns on qcow2's pass-discard-request); under the default discard=ignore
// neither server frees it. Both servers get the same requests on twin
// images, and the images' maps and space are compared.
func TestNBDDiscardUnmapFreesHostSpace(t *testing.T) {
	const size = 8 << 20
	for _, mode := range []string{"unmap", "ignore"} {
		t.Run(mode, func(t *testing.T) {
			dir := t.TempDir()
			paths := map[string]string{}
			for _, who := range []string{"qemu", "ovis"} {
				p := filepath.Join(dir, who+".qcow2")
				testutil.QemuImg(t, "create", "-q", "-f", "qcow2", p, fmt.Sprint(size))
				testutil.QemuIO(t, p, "qcow2", "write -q -P 0x5a 0 8M")
				paths[who] = p
			}
			before := testutil.AllocatedBytes(t, paths["ovis"])

			// ovis nbd.
			s := startNBD(t, nbdRun{args: []string{"-t", "-f", "qcow2", "--discard=" + mode, paths["ovis"]}})
			qemuIONBD(t, s.uri, "discard 1M 4M", "flush")
			s.stop(syscall.SIGTERM)

			// qemu-nbd on the twin.
			sock := filepath.Join(shortTempDir(t), "q.sock")
			q := exec.Command("qemu-nbd", "-t", "-k", sock, "-f", "qcow2", "--discard="+mode, paths["qemu"])
			stop := testutil.StartUntil(t, q, func() bool { return fileExists(sock) })
			qemuIONBD(t, "nbd+unix:///?socket="+sock, "discard 1M 4M", "flush")
			stop()

			oMap, qMap := testutil.Map(t, paths["ovis"]), testutil.Map(t, paths["qemu"])
			if fmt.Sprint(mapFlags(oMap)) != fmt.Sprint(mapFlags(qMap)) {
				t.Errorf("map after discard:\n ovis %v\nqemu %v", mapFlags(oMap), mapFlags(qMap))
			}
			o, qa := testutil.AllocatedBytes(t, paths["ovis"]), testutil.AllocatedBytes(t, paths["qemu"])
			if d := o - qa; d > 64<<10 || d < -64<<10 {
				t.Errorf("host space after discard: ovis %d bytes, qemu-nbd %d (before: %d)", o, qa, before)
			}
			freed := before - o
			if mode == "unmap" && freed < 3<<20 {
				t.Errorf("discard=unmap freed %d bytes of the 4 MiB trimmed (before %d, after %d)", freed, before, o)
			}
			if mode == "ignore" && freed > 64<<10 {
				t.Errorf("discard=ignore freed %d bytes", freed)
			}
			testutil.CheckImage(t, paths["ovis"])
		})
	}
}

// mapFlags is a map without host offsets: the ranges and their flags.
func mapFlags(m []testutil.MapEntry) []string {
	var out []string
	for _, e := range m {
		out = append(out, fmt.Sprintf("%d+%d d%d z%v data%v", e.Start, e.Length, e.Depth, e.Zero, e.Data))
	}
	return out
}

// fileExists says whether path names something.
func fileExists(path string) bool {
	_, err := os.Stat(path)
	return err == nil
}
