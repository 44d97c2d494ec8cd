package testutil

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// recorder is a testing.TB that records Errorf instead of failing.
type recorder struct {
	testing.TB
	errs []string
}

func (r *recorder) Errorf(format string, args ...any) {
	r.errs = append(r.errs, fmt.Sprintf(format, args...))
}

func TestConvertAndCompare(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	img := filepath.Join(dir, "a.qcow2")
	QemuImg(t, "create", "-f", "qcow2", "-o", "cluster_size=4096", img, "3M")
	QemuIO(t, img, "qcow2", "write -P 0x5a 1000 7000", "write -z 4096 512")
	CheckImage(t, img)
	if got := VirtualSize(t, img); got != 3<<20 {
		t.Fatalf("VirtualSize = %d", got)
	}

	want := make([]byte, 3<<20)
	for i := 1000; i < 8000; i++ {
		want[i] = 0x5a
	}
	clear(want[4096 : 4096+512])
	raw := ConvertToRaw(t, img)
	if !bytes.Equal(raw, want) {
		t.Fatalf("ConvertToRaw differs from the written pattern")
	}
	rawPath := ConvertToRawFile(t, img)
	if !CompareDeviceWithRaw(t, bytes.NewReader(want), int64(len(want)), rawPath) {
		t.Fatal("equal contents compared unequal")
	}

	// A flipped byte is reported at its offset.
	bad := bytes.Clone(want)
	bad[5000] = 1
	r := &recorder{TB: t}
	if CompareDeviceWithRaw(r, bytes.NewReader(bad), int64(len(bad)), rawPath) {
		t.Fatal("difference not found")
	}
	if len(r.errs) != 1 || !strings.Contains(r.errs[0], "offset 5000 ") {
		t.Fatalf("report = %q", r.errs)
	}
	// So is a byte inside a hole of the raw file.
	bad = bytes.Clone(want)
	bad[2<<20+3] = 9
	r = &recorder{TB: t}
	if CompareDeviceWithRaw(r, bytes.NewReader(bad), int64(len(bad)), rawPath) {
		t.Fatal("difference in a hole not found")
	}
	if len(r.errs) != 1 || !strings.Contains(r.errs[0], fmt.Sprintf("offset %d ", 2<<20+3)) {
		t.Fatalf("report = %q", r.errs)
	}
}

func TestCompareLargeSparse(t *testing.T) {
	t.Parallel()
	// A 1 TiB sparse raw file compared with itself must take no time.
	path := filepath.Join(t.TempDir(), "big.raw")
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	const size = 1 << 40
	if err := f.Truncate(size); err != nil {
		t.Fatal(err)
	}
	for _, off := range []int64{0, 300<<30 + 12345, size - 4096} {
		if _, err := f.WriteAt(bytes.Repeat([]byte{7}, 4096), off); err != nil {
			t.Fatal(err)
		}
	}
	if !CompareDeviceWithRaw(t, f, size, path) {
		t.Fatal("file differs from itself")
	}
	r := &recorder{TB: t}
	if CompareDeviceWithRaw(r, f, size-512, path) || len(r.errs) == 0 || !strings.Contains(r.errs[0], "raw file is") {
		t.Fatalf("size mismatch not reported: %q", r.errs)
	}
}

func TestQemuImgExit(t *testing.T) {
	t.Parallel()
	out, code := QemuImgExit(t, "info", filepath.Join(t.TempDir(), "missing.qcow2"))
	if code == 0 || !strings.Contains(out, "missing.qcow2") {
		t.Fatalf("qemu-img info of a missing file: exit %d, %q", code, out)
	}
}
