package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/ovis-storage/ovis/internal/testutil"
)

// TestDDLikeQemu runs qemu-img dd and ovis img dd on the same inputs and
// requires the same messages and exit codes, and outputs with the same
// content, size and allocation (qemu-img map), which ovis's qcow2 outputs
// reach with clean metadata.
func TestDDLikeQemu(t *testing.T) {
	t.Parallel()
	tests := []struct{ name, args string }{
		{"whole raw", "if=a.raw of=out"},
		{"blocks of raw", "bs=4k count=10 skip=3 if=a.raw of=out"},
		{"to qcow2", "-O qcow2 bs=4k count=10 skip=3 if=a.raw of=out"},
		{"odd block size and input", "bs=1000 count=7 skip=2 if=odd.raw of=out"},
		{"count past the end", "bs=64k count=100 if=odd.raw of=out"},
		{"from qcow2", "-O qcow2 bs=64k skip=1 if=s.qcow2 of=out"},
		{"from qcow2 as raw", "-f raw if=s.qcow2 of=out"},
		{"image opts", "--image-opts bs=1M if=driver=qcow2,file.filename=s.qcow2 of=out"},
		{"skip past the end", "skip=5000 if=a.raw of=out"},
		{"bs zero", "bs=0 if=a.raw of=out"},
		{"bs too big", "bs=3G if=a.raw of=out"},
		{"bad count", "count=-1 if=a.raw of=out"},
		{"bad skip", "skip=1X if=a.raw of=out"},
		{"operand without value", "foo if=a.raw of=out"},
		{"unknown operand", "foo=1 if=a.raw of=out"},
		{"no output", "if=a.raw"},
		{"unknown format", "-O foo if=a.raw of=out"},
		{"missing input", "if=nonexist of=out"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			qdir, odir := t.TempDir(), t.TempDir()
			convertInputs(t, qdir)
			convertInputs(t, odir)
			args := append([]string{"dd"}, strings.Fields(tt.args)...)
			q, o := qemuImg(t, qdir, args...), ovisImg(t, odir, args...)
			sameResult(t, strings.Join(args, " "), q, o)
			qo, oo := filepath.Join(qdir, "out"), filepath.Join(odir, "out")
			_, qerr := os.Stat(qo)
			_, oerr := os.Stat(oo)
			if (qerr == nil) != (oerr == nil) {
				t.Fatalf("output made by qemu-img: %v, by ovis: %v", qerr == nil, oerr == nil)
			}
			if qerr != nil {
				return
			}
			testutil.QemuImg(t, "compare", "-q", qo, oo)
			if qm, om := testutil.QemuImg(t, "map", "--output=json", qo), testutil.QemuImg(t, "map", "--output=json", oo); qm != om {
				t.Errorf("map differs\nqemu-img: %s\n    ovis: %s", qm, om)
			}
			if strings.Contains(tt.args, "-O qcow2") {
				testutil.CheckImage(t, oo)
			}
		})
	}
}
