package image

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/ovis-storage/ovis/block"
	"github.com/ovis-storage/ovis/internal/testutil"
	"github.com/ovis-storage/ovis/qcow2"
)

var ctx = context.Background()

// TestProbe checks the formats Probe finds against qemu-img info's, for
// files qemu-img made, a short file and an empty one; and the formats
// file: and json: names give.
func TestProbe(t *testing.T) {
	dir := t.TempDir()
	q := filepath.Join(dir, "a.qcow2")
	r := filepath.Join(dir, "a.raw")
	testutil.QemuImg(t, "create", "-f", "qcow2", q, "1M")
	testutil.QemuImg(t, "create", "-f", "raw", r, "1M")
	short := filepath.Join(dir, "short")
	if err := os.WriteFile(short, []byte{0x51, 0x46}, 0o644); err != nil {
		t.Fatal(err)
	}
	empty := filepath.Join(dir, "empty")
	if err := os.WriteFile(empty, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{q, r, short, empty} {
		got, err := Probe(p)
		if err != nil {
			t.Fatalf("Probe(%s): %v", p, err)
		}
		if want, _ := testutil.ImageInfo(t, p)["format"].(string); got != want {
			t.Errorf("Probe(%s) = %q, qemu-img says %q", filepath.Base(p), got, want)
		}
	}
	names := []struct{ name, want string }{
		{"file:" + q, "qcow2"},
		{`json:{"driver": "raw", "file": {"driver": "file", "filename": "` + q + `"}}`, "raw"},
		{`json:{"driver": "file", "filename": "` + q + `"}`, "raw"},
	}
	for _, n := range names {
		if got, err := Probe(n.name); err != nil || got != n.want {
			t.Errorf("Probe(%s) = %q, %v, want %q", n.name, got, err, n.want)
		}
	}
	if _, err := Probe(filepath.Join(dir, "missing")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("Probe of a missing file = %v, want ErrNotExist", err)
	}
}

// TestOpenFormats opens each format by name and probed, and refuses an
// unknown one.
func TestOpenFormats(t *testing.T) {
	dir := t.TempDir()
	q := filepath.Join(dir, "a.qcow2")
	r := filepath.Join(dir, "a.raw")
	testutil.QemuImg(t, "create", "-f", "qcow2", q, "1M")
	testutil.QemuImg(t, "create", "-f", "raw", r, "2M")
	tests := []struct {
		name, format string
		raw          bool
		size         int64
	}{
		{q, "", false, 1 << 20},
		{q, "qcow2", false, 1 << 20},
		{q, "raw", true, -1}, // the qcow2 file itself, read as raw
		{r, "", true, 2 << 20},
		{"file:" + r, "", true, 2 << 20},
	}
	for _, tt := range tests {
		dev, err := Open(tt.name, tt.format, Options{ReadOnly: true})
		if err != nil {
			t.Fatalf("Open(%s, %q): %v", tt.name, tt.format, err)
		}
		_, isRaw := dev.(*block.Raw)
		_, isQcow2 := dev.(*qcow2.Image)
		if isRaw != tt.raw || isQcow2 == tt.raw {
			t.Errorf("Open(%s, %q) = %T", tt.name, tt.format, dev)
		}
		if st, err := os.Stat(q); tt.size < 0 && err == nil {
			tt.size = st.Size()
		}
		if dev.Size() != tt.size {
			t.Errorf("Open(%s, %q): size %d, want %d", tt.name, tt.format, dev.Size(), tt.size)
		}
		dev.Close()
	}
	if _, err := Open(q, "vmdk", Options{}); !errors.Is(err, ErrUnknownFormat) {
		t.Errorf("Open as vmdk = %v, want ErrUnknownFormat", err)
	}
}

// TestOpenBackingThroughRegistry gives a qcow2 image a backing file of a
// format registered by the test: the chain must open through it and read
// its data, as qemu-io reads the same chain with the backing file raw.
func TestOpenBackingThroughRegistry(t *testing.T) {
	dir := t.TempDir()
	base := filepath.Join(dir, "base.img")
	b := bytes.Repeat([]byte{0xab}, 1<<20)
	if err := os.WriteFile(base, b, 0o644); err != nil {
		t.Fatal(err)
	}
	top := filepath.Join(dir, "top.qcow2")
	testutil.QemuImg(t, "create", "-f", "qcow2", "-b", base, "-F", "raw", top)
	testutil.QemuIO(t, top, "qcow2", "write -P 0xcd 0 4k")
	// The same chain with the base in "testraw": the image records the
	// format, so only the registry can open it.
	opened := 0
	registerFor(t, "testraw", Format{Open: func(path string, o Options) (block.Device, error) {
		opened++
		return openRaw(path, o)
	}})
	top2 := filepath.Join(dir, "top2.qcow2")
	if err := qcow2.Create(top2, qcow2.CreateOptions{BackingFile: base, BackingFormat: "testraw", Size: 1 << 20}); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{top, top2} {
		dev, err := Open(p, "", Options{ReadOnly: true})
		if err != nil {
			t.Fatalf("Open(%s): %v", p, err)
		}
		got := make([]byte, 8<<10)
		if _, err := dev.ReadAt(ctx, got, 0); err != nil {
			t.Fatal(err)
		}
		dev.Close()
		want := append(bytes.Repeat([]byte{0xcd}, 4<<10), b[:4<<10]...)
		if p == top2 {
			want = b[:8<<10] // top2 holds no data of its own
		}
		if !bytes.Equal(got, want) {
			t.Errorf("%s reads other data than its chain holds", filepath.Base(p))
		}
	}
	if opened != 1 {
		t.Errorf("the testraw format opened %d times, want once", opened)
	}
	// qemu-io reads the first chain alike (it fails the test otherwise).
	testutil.QemuIO(t, top, "qcow2", "read -P 0xcd 0 4k", "read -P 0xab 4k 4k")
}

// TestOpenBackingLoop: a chain that comes back to itself is refused when
// every layer opens through the registry, as when qcow2 opens it alone.
func TestOpenBackingLoop(t *testing.T) {
	dir := t.TempDir()
	a, b := filepath.Join(dir, "a.qcow2"), filepath.Join(dir, "b.qcow2")
	testutil.QemuImg(t, "create", "-f", "qcow2", a, "1M")
	testutil.QemuImg(t, "create", "-f", "qcow2", "-b", a, "-F", "qcow2", b)
	testutil.QemuImg(t, "rebase", "-u", "-f", "qcow2", "-b", b, "-F", "qcow2", a)
	_, err := Open(b, "qcow2", Options{ReadOnly: true})
	if err == nil || !strings.Contains(err.Error(), "backing file loop") {
		t.Fatalf("Open of a looping chain = %v, want a backing file loop", err)
	}
	_, err = qcow2.Open(b, qcow2.Options{ReadOnly: true})
	if err == nil || !strings.Contains(err.Error(), "backing file loop") {
		t.Fatalf("qcow2.Open of a looping chain = %v, want a backing file loop", err)
	}
}

// registerFor registers a test format for the rest of the test only,
// so that the examples see the package's own formats.
func registerFor(t *testing.T, name string, f Format) {
	Register(name, f)
	t.Cleanup(func() {
		registry.mu.Lock()
		delete(registry.formats, name)
		registry.mu.Unlock()
	})
}

// TestRegister refuses a second registration and a format without Open,
// and lists what is registered.
func TestRegister(t *testing.T) {
	mustPanic := func(what string, fn func()) {
		t.Helper()
		defer func() {
			if recover() == nil {
				t.Errorf("%s did not panic", what)
			}
		}()
		fn()
	}
	mustPanic("registering qcow2 again", func() { Register("qcow2", Format{Open: openQcow2}) })
	mustPanic("registering without Open", func() { Register("noopen", Format{}) })
	got := strings.Join(Formats(), ",")
	if !strings.Contains(got, "qcow2") || !strings.Contains(got, "raw") || strings.Contains(got, "noopen") {
		t.Errorf("Formats() = %s", got)
	}
}
