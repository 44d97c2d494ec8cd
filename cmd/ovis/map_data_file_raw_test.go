package main

import (
	"path/filepath"
	"strings"
	"testing"

	"github.com/ovis-storage/ovis/internal/testutil"
)

// TestReproMapDataFileRawLikeQemu: an image with data_file_raw=on maps
// the holes of its raw data file as data, as qemu-img map and qemu-nbd's
// block status do (only its zero clusters read as zeros), whichever tool
// created it.
func TestReproMapDataFileRawLikeQemu(t *testing.T) {
	t.Parallel()
	writes := []string{"write -q -P 1 64k 64k", "write -q -z 256k 64k", "write -q -P 2 512k 4k", "discard -q 768k 64k", "write -q -P 3 1000k 1k"}
	for _, creator := range []string{"qemu-img", "ovis"} {
		for _, opts := range []string{"", ",cluster_size=4096", ",extended_l2=on", ",preallocation=metadata", ",preallocation=falloc"} {
			// No comma in the name: it goes into t.TempDir()'s, and so into -o.
			name := creator + strings.ReplaceAll(opts, ",", "-")
			t.Run(name, func(t *testing.T) {
				dir := t.TempDir()
				args := []string{"create", "-q", "-f", "qcow2", "-o", "data_file=" + filepath.Join(dir, "d.raw") + ",data_file_raw=on" + opts, "x.qcow2", "1M"}
				if creator == "ovis" {
					mustOvisImg(t, dir, args...)
				} else if r := qemuImg(t, dir, args...); r.code != 0 {
					t.Fatalf("qemu-img create: %s", r.stderr)
				}
				p := filepath.Join(dir, "x.qcow2")
				for i := 0; i <= len(writes); i++ {
					if i > 0 {
						testutil.QemuIO(t, p, "qcow2", writes[i-1])
					}
					for _, out := range []string{"human", "json"} {
						args := []string{"map", "--output=" + out, "x.qcow2"}
						sameResult(t, name+" "+out, qemuImg(t, dir, args...), ovisImg(t, dir, args...))
					}
				}
				sameNBDMap(t, p)
			})
		}
	}
}
