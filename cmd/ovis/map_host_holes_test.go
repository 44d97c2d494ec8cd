package main

import (
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/ovis-storage/ovis/internal/testutil"
)

// TestReproMapHostHolesLikeQemu (issue 14): a hole of the host file inside
// an allocated cluster (here punched into the tail of the last one) is
// reported as zeros only where QEMU 7.2 asks the host file, in an image
// it finds metadata-preallocated (more clusters with a refcount than the
// file allocates, as the sparse metadata of a small image); elsewhere it
// is data, as qemu-img map prints it and qemu-nbd's block status says.
func TestReproMapHostHolesLikeQemu(t *testing.T) {
	for _, c := range []struct {
		name   string
		create []string
		write  string
		punch  bool
	}{
		{"small image, punched tail", []string{"1M"}, "write -q -P 1 0 4k", true},
		{"2 MiB written, punched tail", []string{"4M"}, "write -q -P 1 0 2M", true},
		{"2 MiB written", []string{"4M"}, "write -q -P 1 0 2M", false},
		{"preallocation=metadata", []string{"-o", "preallocation=metadata", "4M"}, "write -q -P 1 0 4k", false},
		{"preallocation=metadata, punched tail", []string{"-o", "preallocation=metadata", "4M"}, "write -q -P 1 0 2M", true},
		{"partial cluster", []string{"1M"}, "write -q -P 1 1020k 4k", false},
	} {
		t.Run(c.name, func(t *testing.T) {
			dir := t.TempDir()
			p := filepath.Join(dir, "m.qcow2")
			testutil.QemuImg(t, append([]string{"create", "-q", "-f", "qcow2", p}, c.create...)...)
			testutil.QemuIO(t, p, "qcow2", c.write)
			if c.punch {
				var last int64 = -1
				for _, e := range testutil.Map(t, p) {
					if e.Data && e.Offset != nil {
						last = *e.Offset + e.Length - 65536
					}
				}
				f, err := os.OpenFile(p, os.O_RDWR, 0)
				if err != nil {
					t.Fatal(err)
				}
				err = unix.Fallocate(int(f.Fd()), unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, last+4096, 65536-4096)
				f.Close()
				if err != nil {
					t.Fatal(err)
				}
			}
			for _, out := range []string{"human", "json"} {
				args := []string{"map", "--output=" + out, "m.qcow2"}
				sameResult(t, c.name+" "+out, qemuImg(t, dir, args...), ovisImg(t, dir, args...))
			}
			// Block status over NBD: ovis nbd as qemu-nbd.
			sameNBDMap(t, p)
		})
	}
}
