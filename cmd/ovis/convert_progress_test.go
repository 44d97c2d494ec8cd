package main

import (
	"path/filepath"
	"strings"
	"testing"

	"github.com/ovis-storage/ovis/internal/testutil"
)

// TestReproConvertProgressLines: convert -p with stdout not a terminal
// prints qemu-img's progress lines on stdout byte for byte (the first
// "    (0.00/100%)\r", a line per 2 MiB buffer of data (a cluster with -c)
// counted from each extent's start as QEMU's block status cuts extents,
// the final "    (100.00/100%)\r" and the newline), which vdsm, imageio
// and virt-v2v parse. A failure after qemu-img started its progress still
// prints the first line and the newline.
func TestReproConvertProgressLines(t *testing.T) {
	t.Parallel()
	setup := func(t *testing.T, dir string) {
		p := func(name string) string { return filepath.Join(dir, name) }
		// Whole clusters: ovis, unlike QEMU 7.2, reports the unwritten
		// tail of a partly written last cluster as zeros (a host hole).
		testutil.QemuImg(t, "create", "-q", "-f", "qcow2", p("s.qcow2"), "64M")
		testutil.QemuIO(t, p("s.qcow2"), "qcow2", "write -q -P 1 0 20M", "write -q -P 2 40M 5M", "write -q -P 3 63M 640k")
		testutil.QemuImg(t, "create", "-q", "-f", "raw", p("r.raw"), "30M")
		testutil.QemuIO(t, p("r.raw"), "raw", "write -q -P 1 1M 3M", "write -q -P 2 10M 9M", "write -q -P 3 29M 100k")
		// Guest-contiguous data in host clusters out of order.
		testutil.QemuImg(t, "create", "-q", "-f", "qcow2", p("h.qcow2"), "16M")
		testutil.QemuIO(t, p("h.qcow2"), "qcow2", "write -q -P 1 1M 1M", "write -q -P 2 0 1M", "write -q -P 2 2M 3M")
		testutil.QemuImg(t, "convert", "-c", "-O", "qcow2", p("h.qcow2"), p("hc.qcow2"))
		testutil.QemuImg(t, "create", "-q", "-f", "qcow2", "-b", "hc.qcow2", "-F", "qcow2", p("t.qcow2"))
		testutil.QemuIO(t, p("t.qcow2"), "qcow2", "write -q -P 5 1536k 1M")
		testutil.QemuImg(t, "create", "-q", "-f", "qcow2", p("e.qcow2"), "10M")
	}
	for _, args := range []string{
		"-O raw s.qcow2 o",
		"-O qcow2 s.qcow2 o",
		"-O qcow2 -c s.qcow2 o",
		"-O raw -S 0 s.qcow2 o",
		"-O raw -W s.qcow2 o",
		"-O qcow2 -o cluster_size=4k s.qcow2 o",
		"-O raw r.raw o",
		"-O raw -S 64k r.raw o",
		"-O qcow2 -c r.raw o",
		"-O raw s.qcow2 r.raw o",
		"-O raw h.qcow2 o",
		"-O raw hc.qcow2 o",
		"-O raw t.qcow2 o",
		"-O qcow2 -B hc.qcow2 -F qcow2 t.qcow2 o",
		"-O raw e.qcow2 o",
		"-q -O raw s.qcow2 o",
		"-O raw nonexist o",
		"-f foo -O raw s.qcow2 o",
		"-t foo s.qcow2 o",
		"-T foo s.qcow2 o",
		"-o foo=bar s.qcow2 o",
		"-O raw -l foo s.qcow2 o",
		"-O qcow2 -B x s.qcow2 o",
		"-m 0 s.qcow2 o",
	} {
		t.Run(args, func(t *testing.T) {
			argv := append([]string{"convert", "-p"}, strings.Fields(args)...)
			qdir, odir := t.TempDir(), t.TempDir()
			fromFixture(t, "convert-progress", setup, qdir, odir)
			q, o := qemuImg(t, qdir, argv...), ovisImg(t, odir, argv...)
			sameResult(t, args, q, o)
		})
	}
}
