package store

import (
	"bytes"
	"errors"
	"testing"

	"github.com/ovis-storage/ovis/cluster/object"
)

func openT(t testing.TB, dir string, o Options) *Store {
	t.Helper()
	s, err := Open(dir, o)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func TestBasic(t *testing.T) {
	dir := t.TempDir()
	s := openT(t, dir, Options{})
	id := object.Make(7, 3)
	if _, err := s.ReadAt(id, make([]byte, 10), 0); !errors.Is(err, ErrNotFound) {
		t.Fatalf("read of absent object: %v, want ErrNotFound", err)
	}
	v1, err := s.WriteAt(id, Stamp{Token: 1}, []byte("hello"), 100, false)
	if err != nil {
		t.Fatal(err)
	}
	v2, err := s.WriteAt(id, Stamp{Token: 1}, []byte("world"), 1<<20, true)
	if err != nil {
		t.Fatal(err)
	}
	if v2 != v1+1 {
		t.Fatalf("versions %d then %d", v1, v2)
	}
	buf := make([]byte, 110)
	v, err := s.ReadAt(id, buf, 0)
	if err != nil || v != v2 {
		t.Fatalf("read: version %d err %v, want %d", v, err, v2)
	}
	if !bytes.Equal(buf[100:105], []byte("hello")) || !allZero(buf[:100]) || !allZero(buf[105:]) {
		t.Fatalf("read %q", buf)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); !errors.Is(err, ErrClosed) {
		t.Fatalf("second Close: %v", err)
	}
	s = openT(t, dir, Options{})
	defer s.Close()
	info, err := s.Stat(id)
	if err != nil || info.Version != v2 || info.Suspect {
		t.Fatalf("stat after reopen: %+v %v", info, err)
	}
	if s.Token(7) != 1 {
		t.Fatalf("token after reopen %d", s.Token(7))
	}
	if _, err := s.WriteAt(id, Stamp{Token: 0}, []byte("x"), 0, false); !errors.Is(err, ErrStaleToken) {
		t.Fatalf("stale token: %v", err)
	}
}
