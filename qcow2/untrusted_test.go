package qcow2

import (
	"errors"
	"os"
	"path/filepath"
	"testing"
)

func TestUntrusted(t *testing.T) {
	root := t.TempDir()
	imgDir := filepath.Join(root, "images")
	os.Mkdir(imgDir, 0o755)
	secret := filepath.Join(root, "secret.raw")
	os.WriteFile(secret, []byte("top secret data, 512 bytes of it"+string(make([]byte, 480))), 0o600)
	os.WriteFile(filepath.Join(imgDir, "ok.raw"), make([]byte, 1<<20), 0o644)
	os.Symlink(secret, filepath.Join(imgDir, "link.raw"))
	os.Symlink("ok.raw", filepath.Join(imgDir, "inside-link.raw"))

	cases := []struct {
		name, backing string
		refused       bool
	}{
		{"inside", "ok.raw", false},
		{"symlink-inside", "inside-link.raw", false},
		{"absolute-outside", secret, true},
		{"relative-escape", "../secret.raw", true},
		{"symlink-out", "link.raw", true},
		{"device", "/dev/zero", true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			p := filepath.Join(imgDir, tc.name+".qcow2")
			if err := Create(p, CreateOptions{Size: 512, BackingFile: tc.backing, BackingFormat: "raw"}); err != nil {
				t.Fatal(err)
			}
			img, err := Open(p, Options{ReadOnly: true, Untrusted: true})
			if tc.refused {
				if !errors.Is(err, ErrUntrusted) {
					t.Fatalf("opened with backing %s: err %v", tc.backing, err)
				}
				// QEMU's default behaviour stays: without Untrusted it opens.
				if tc.name != "device" {
					img, err := Open(p, Options{ReadOnly: true})
					if err != nil {
						t.Fatalf("trusted open: %v", err)
					}
					img.Close()
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			img.Close()
		})
	}
	// External data file outside the folder.
	p := filepath.Join(imgDir, "df.qcow2")
	if err := Create(p, CreateOptions{Size: 1 << 20, DataFile: filepath.Join(imgDir, "df.data")}); err != nil {
		t.Fatal(err)
	}
	img, err := Open(p, Options{ReadOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	img.Close()
	f, _ := os.OpenFile(p, os.O_RDWR, 0)
	h := readHeader(t, p)
	h.DataFile = secret
	buf, err := h.Encode()
	if err != nil {
		t.Fatal(err)
	}
	f.WriteAt(buf, 0)
	f.Close()
	if _, err := Open(p, Options{ReadOnly: true, Untrusted: true}); !errors.Is(err, ErrUntrusted) {
		t.Fatalf("data file outside the folder: %v", err)
	}
}
