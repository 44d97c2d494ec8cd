package store

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/ovis-storage/ovis/cluster/object"
)

// tinyFS mounts an 8 MiB tmpfs for the test, or skips when it may not.
func tinyFS(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	if err := unix.Mount("tmpfs", dir, "tmpfs", 0, "size=8m"); err != nil {
		t.Skipf("cannot mount a tmpfs (needs root): %v", err)
	}
	t.Cleanup(func() { unix.Unmount(dir, 0) })
	return dir
}

func TestNoSpace(t *testing.T) {
	dir := filepath.Join(tinyFS(t), "s")
	s := openT(t, dir, Options{})
	defer func() {
		if err := s.Close(); err != nil {
			t.Error(err)
		}
	}()
	chunk := bytes.Repeat([]byte{9}, 1<<20)
	var full object.ID
	written := map[object.ID]bool{}
	for i := range 16 {
		id := object.Make(1, uint32(i))
		_, err := s.WriteAt(id, Stamp{Token: 1}, chunk, 0, false)
		if err != nil {
			if !errors.Is(err, ErrNoSpace) || !errors.Is(err, unix.ENOSPC) {
				t.Fatalf("write on a full file system: %v", err)
			}
			full = id
			break
		}
		written[id] = true
	}
	if full == 0 {
		t.Fatal("8 MiB tmpfs never filled")
	}
	// The copy the failed write left behind is not served.
	if _, err := s.ReadAt(full, make([]byte, 1), 0); !errors.Is(err, ErrSuspect) && !errors.Is(err, ErrNotFound) {
		t.Fatalf("read of the object whose write failed: %v", err)
	}
	for id := range written {
		p := make([]byte, len(chunk))
		if _, err := s.ReadAt(id, p, 0); err != nil || !bytes.Equal(p, chunk) {
			t.Fatalf("object %s damaged by ENOSPC elsewhere: %v", id, err)
		}
	}
	if err := s.Flush(0); err != nil {
		t.Fatalf("flush on a full file system: %v", err)
	}
	for id := range written {
		if err := s.Remove(id, Stamp{Token: 1}); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.Remove(full, Stamp{Token: 1}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.WriteAt(full, Stamp{Token: 1}, chunk, 0, true); err != nil {
		t.Fatalf("write after space was freed: %v", err)
	}
}

func TestReserve(t *testing.T) {
	dir := filepath.Join(tinyFS(t), "s")
	s := openT(t, dir, Options{Reserve: 4 << 20})
	defer s.Close()
	chunk := bytes.Repeat([]byte{9}, 1<<20)
	var refused int
	for i := range 8 {
		id := object.Make(1, uint32(i))
		v, err := s.WriteAt(id, Stamp{Token: 1}, chunk, 0, i%2 == 0)
		if errors.Is(err, ErrNoSpace) {
			refused++
			// Refused before anything changed: no object, no suspicion.
			if _, err := s.Stat(id); !errors.Is(err, ErrNotFound) {
				t.Fatalf("refused write left object %s: %v", id, err)
			}
			continue
		}
		if err != nil || v != 1 {
			t.Fatalf("write: v%d %v", v, err)
		}
	}
	if refused == 0 {
		t.Fatal("Reserve never refused a write")
	}
	u, err := s.Usage()
	if err != nil {
		t.Fatal(err)
	}
	if u.Free < u.Reserve || u.Objects != 8-refused || u.Allocated < int64(u.Objects)<<20 {
		t.Fatalf("usage %+v after %d refused", u, refused)
	}
	// Punching needs no space and is allowed below the reserve.
	if _, err := s.Discard(object.Make(1, 0), Stamp{Token: 1}, 0, 1<<20, true); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(dir); err != nil {
		t.Fatal(err)
	}
}
