package store

import (
	"errors"
	"os"
	"testing"

	"github.com/ovis-storage/ovis/cluster/object"
)

func TestRemoveVDI(t *testing.T) {
	dir := t.TempDir()
	s := openT(t, dir, Options{})
	defer s.Close()
	for i := range 5 {
		for _, v := range []object.VDI{1, 2} {
			if _, err := s.WriteAt(object.Make(v, uint32(i)), Stamp{Token: 1}, []byte("data"), 0, i%2 == 0); err != nil {
				t.Fatal(err)
			}
		}
	}
	if err := s.RemoveVDI(1, 0); !errors.Is(err, ErrStaleToken) {
		t.Fatalf("stale RemoveVDI: %v", err)
	}
	if err := s.RemoveVDI(1, 1); err != nil {
		t.Fatal(err)
	}
	if infos, err := s.List(1); err != nil || len(infos) != 0 {
		t.Fatalf("List after RemoveVDI: %+v %v", infos, err)
	}
	if infos, err := s.List(0); err != nil || len(infos) != 5 {
		t.Fatalf("other VDI after RemoveVDI: %+v %v", infos, err)
	}
	if _, err := s.ReadAt(object.Make(1, 0), make([]byte, 1), 0); !errors.Is(err, ErrNotFound) {
		t.Fatalf("read after RemoveVDI: %v", err)
	}
	// A crash now: nothing of VDI 1 comes back, not even as suspect.
	crashed := snapshot(t, dir)
	c := openT(t, crashed, Options{})
	if infos, err := c.List(1); err != nil || len(infos) != 0 {
		t.Fatalf("List of a removed VDI after a crash: %+v %v", infos, err)
	}
	c.Close()
	// The VDI can be written again.
	if _, err := s.WriteAt(object.Make(1, 3), Stamp{Token: 1}, []byte("new"), 0, true); err != nil {
		t.Fatal(err)
	}
	if ents, _ := os.ReadDir(s.tmpDir); len(ents) != 0 {
		t.Fatalf("RemoveVDI left %d entries in tmp", len(ents))
	}
	if err := s.RemoveVDI(9, 1); err != nil {
		t.Fatalf("RemoveVDI of a VDI with no objects: %v", err)
	}
}
