package guest

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
)

// TestCPIOUnpack writes an archive and unpacks it with GNU cpio: the
// names, modes, contents and link targets must come out as written.
func TestCPIOUnpack(t *testing.T) {
	var buf bytes.Buffer
	w := newCPIOWriter(&buf)
	files := []struct {
		name string
		data string
	}{
		{"a/b/c.txt", "hello"},
		{"a/odd", "123"},       // data not a multiple of 4
		{"a/empty", ""},        // no data
		{"a/longer-name", "x"}, // name padding
	}
	for _, d := range []string{"a", "a/b"} {
		if err := w.Dir(d); err != nil {
			t.Fatal(err)
		}
	}
	for _, f := range files {
		if err := w.File("/"+f.name, 0o640, []byte(f.data)); err != nil {
			t.Fatal(err)
		}
	}
	if err := w.Symlink("a/link", "b/c.txt"); err != nil {
		t.Fatal(err)
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	if buf.Len()%4 != 0 {
		t.Errorf("archive of %d bytes: not a multiple of 4", buf.Len())
	}
	dir := t.TempDir()
	cmd := exec.Command("cpio", "-idm", "--quiet", "--no-absolute-filenames")
	cmd.Dir = dir
	cmd.Stdin = &buf
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("cpio -id: %v\n%s", err, out)
	}
	for _, f := range files {
		p := filepath.Join(dir, f.name)
		b, err := os.ReadFile(p)
		if err != nil {
			t.Errorf("%s: %v", f.name, err)
			continue
		}
		if string(b) != f.data {
			t.Errorf("%s: %q, want %q", f.name, b, f.data)
		}
		if fi, _ := os.Stat(p); fi.Mode().Perm() != 0o640 {
			t.Errorf("%s: mode %v, want 0640", f.name, fi.Mode().Perm())
		}
	}
	if l, err := os.Readlink(filepath.Join(dir, "a/link")); err != nil || l != "b/c.txt" {
		t.Errorf("a/link: %q, %v; want b/c.txt", l, err)
	}
}

// TestModuleOrder resolves modules from a modules.dep of its own: every
// dependency comes before its users, once; built-in modules are left out;
// an unknown one is an error.
func TestModuleOrder(t *testing.T) {
	dir := t.TempDir()
	dep := "kernel/a/virtio_pci.ko: kernel/a/virtio_pci_legacy_dev.ko kernel/a/virtio_pci_modern_dev.ko kernel/a/virtio.ko kernel/a/virtio_ring.ko\n" +
		"kernel/a/virtio_pci_legacy_dev.ko:\n" +
		"kernel/a/virtio_pci_modern_dev.ko:\n" +
		"kernel/a/virtio.ko: kernel/a/virtio_ring.ko\n" +
		"kernel/a/virtio_ring.ko:\n" +
		"kernel/b/virtio_blk.ko: kernel/a/virtio.ko kernel/a/virtio_ring.ko\n" +
		"kernel/c/zmod.ko.xz:\n"
	if err := os.WriteFile(filepath.Join(dir, "modules.dep"), []byte(dep), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "modules.builtin"), []byte("kernel/fs/ext4/ext4.ko\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		names   []string
		want    []string
		wantErr bool
	}{
		{[]string{"virtio_pci", "virtio_blk", "ext4"}, []string{
			"kernel/a/virtio_pci_legacy_dev.ko", "kernel/a/virtio_pci_modern_dev.ko",
			"kernel/a/virtio_ring.ko", "kernel/a/virtio.ko", "kernel/a/virtio_pci.ko", "kernel/b/virtio_blk.ko",
		}, false},
		{[]string{"virtio-blk"}, []string{"kernel/a/virtio_ring.ko", "kernel/a/virtio.ko", "kernel/b/virtio_blk.ko"}, false},
		{[]string{"nosuch"}, nil, true},
		{[]string{"zmod"}, nil, true}, // compressed
	} {
		got, err := moduleOrder(dir, c.names)
		if (err != nil) != c.wantErr {
			t.Errorf("%v: error %v, want error %v", c.names, err, c.wantErr)
			continue
		}
		if c.wantErr {
			continue
		}
		if len(got) != len(c.want) {
			t.Errorf("%v: %v, want %v", c.names, got, c.want)
			continue
		}
		for i := range got {
			if got[i] != c.want[i] {
				t.Errorf("%v: %v, want %v", c.names, got, c.want)
				break
			}
		}
	}
}
