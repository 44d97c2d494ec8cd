package store

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/ovis-storage/ovis/cluster/object"
)

// snapshot copies a live store's directory, as a crash would leave it
// (page cache included): the copy has no clean marker.
func snapshot(t *testing.T, from string) string {
	t.Helper()
	to := filepath.Join(t.TempDir(), "copy")
	if out, err := exec.CommandContext(ctx, "cp", "-a", "--sparse=always", from, to).CombinedOutput(); err != nil {
		t.Fatalf("cp: %v: %s", err, out)
	}
	return to
}

func TestSuspect(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "s")
	s := openT(t, dir, Options{})
	defer s.Close()
	var (
		flushed  = object.Make(1, 0) // buffered write, then Flush
		dirty    = object.Make(1, 1) // buffered write, no Flush
		synced   = object.Make(2, 0) // sync write only, then Flush(2)
		other    = object.Make(2, 1) // buffered write on VDI 2, covered by Flush(2)
		removed  = object.Make(1, 2) // buffered write, then Remove
		putAfter = object.Make(1, 3) // buffered write, then Put
	)
	data := bytes.Repeat([]byte{7}, 5000)
	for _, id := range []object.ID{flushed, dirty, other, removed, putAfter} {
		if _, err := s.WriteAt(id, Stamp{Token: 1}, data, 10, false); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := s.WriteAt(synced, Stamp{Token: 1}, data, 10, true); err != nil {
		t.Fatal(err)
	}
	if err := s.Flush(2); err != nil {
		t.Fatal(err)
	}
	if _, err := s.WriteAt(flushed, Stamp{Token: 1}, data, 0, false); err != nil {
		t.Fatal(err)
	}
	if err := s.Flush(1); err != nil { // flushed and dirty are clean now…
		t.Fatal(err)
	}
	if _, err := s.WriteAt(dirty, Stamp{Token: 1}, data, 20000, false); err != nil { // …and dirty is dirty again
		t.Fatal(err)
	}
	if err := s.Remove(removed, Stamp{Token: 1}); err != nil {
		t.Fatal(err)
	}
	if err := s.Put(putAfter, 42, data); err != nil {
		t.Fatal(err)
	}

	crashed := snapshot(t, dir)
	c := openT(t, crashed, Options{})
	want := map[object.ID]bool{flushed: false, dirty: true, synced: false, other: false, putAfter: false}
	for id, suspect := range want {
		info, err := c.Stat(id)
		if err != nil || info.Suspect != suspect {
			t.Errorf("object %s: %+v %v, want suspect %v", id, info, err, suspect)
		}
	}
	if info, err := c.Stat(removed); err != nil || !info.Tombstone || info.Suspect || info.Version != 2 {
		t.Errorf("removed object: %+v %v, want a tombstone at version 2", info, err)
	}
	if _, err := c.ReadAt(removed, make([]byte, 10), 0); !errors.Is(err, ErrNotFound) {
		t.Errorf("read of a tombstone: %v", err)
	}
	if info, _ := c.Stat(putAfter); info.Version != 42 {
		t.Errorf("put object has version %d, want 42", info.Version)
	}
	if _, err := c.ReadAt(dirty, make([]byte, 10), 0); !errors.Is(err, ErrSuspect) {
		t.Errorf("read of suspect: %v", err)
	}
	if _, err := c.WriteAt(dirty, Stamp{Token: 1}, data, 0, true); !errors.Is(err, ErrSuspect) {
		t.Errorf("write of suspect: %v", err)
	}
	if _, _, err := c.Checksum(dirty); !errors.Is(err, ErrSuspect) {
		t.Errorf("checksum of suspect: %v", err)
	}
	// Last-resort recovery reads the suspect's bytes, with the version
	// its header has: the Flush's, older than the unflushed write's.
	got := make([]byte, 25000)
	if v, err := c.ReadSuspect(dirty, got, 0); err != nil || v != 1 || !bytes.Equal(got[20000:], data) || !bytes.Equal(got[10:5010], data) {
		t.Errorf("ReadSuspect of suspect: v%d %v, want v1 and both writes' bytes", v, err)
	}
	if v, err := c.ReadSuspect(removed, got, 0); !errors.Is(err, ErrNotFound) || v != 2 {
		t.Errorf("ReadSuspect of a tombstone: v%d %v, want ErrNotFound and v2", v, err)
	}
	infos, err := c.List(0)
	if err != nil || len(infos) != 6 {
		t.Fatalf("List: %+v %v", infos, err)
	}

	// A second crash before repair: still suspect.
	again := snapshot(t, crashed)
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	c = openT(t, again, Options{})
	if info, _ := c.Stat(dirty); !info.Suspect {
		t.Fatalf("suspicion lost in a second crash")
	}
	// Repair, then a third crash: clean.
	if err := c.Put(dirty, 9, data); err != nil {
		t.Fatal(err)
	}
	third := snapshot(t, again)
	c.Close()
	c = openT(t, third, Options{})
	defer c.Close()
	if info, err := c.Stat(dirty); err != nil || info.Suspect || info.Version != 9 {
		t.Fatalf("after Put and a crash: %+v %v", info, err)
	}
	got = make([]byte, len(data))
	if _, err := c.ReadAt(dirty, got, 0); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("after Put: %v", err)
	}
}

func TestClearSuspectAndRemove(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "s")
	s := openT(t, dir, Options{})
	defer s.Close()
	a, b, lost := object.Make(3, 0), object.Make(3, 1), object.Make(3, 2)
	for _, id := range []object.ID{a, b, lost} {
		if _, err := s.WriteAt(id, Stamp{Token: 0}, []byte("x"), 0, false); err != nil {
			t.Fatal(err)
		}
	}
	crashed := snapshot(t, dir)
	// The crash lost lost's directory entry.
	if err := os.Remove(filepath.Join(crashed, "objects", "00000003", "00000002")); err != nil {
		t.Fatal(err)
	}
	c := openT(t, crashed, Options{})
	defer c.Close()
	if info, err := c.Stat(lost); err != nil || !info.Suspect {
		t.Fatalf("stat of a suspect without a file: %+v %v", info, err)
	}
	if _, err := c.ReadAt(lost, make([]byte, 1), 0); !errors.Is(err, ErrSuspect) {
		t.Fatalf("read of a suspect without a file: %v", err)
	}
	if infos, err := c.List(3); err != nil || len(infos) != 3 || !infos[2].Suspect {
		t.Fatalf("List: %+v %v", infos, err)
	}
	if err := c.ClearSuspect(a); err != nil {
		t.Fatal(err)
	}
	if _, err := c.ReadAt(a, make([]byte, 1), 0); err != nil {
		t.Fatalf("read after ClearSuspect: %v", err)
	}
	if err := c.Remove(b, Stamp{Token: 0}); err != nil {
		t.Fatal(err)
	}
	// b's header still had the version of its creation (0): its plain
	// write was never flushed, so the tombstone comes one after that.
	if info, err := c.Stat(b); err != nil || info.Suspect || !info.Tombstone || info.Version != 1 {
		t.Fatalf("stat after Remove of a suspect: %+v %v, want a tombstone at v1", info, err)
	}
	if err := c.Put(lost, 5, nil); err != nil {
		t.Fatal(err)
	}
	if info, err := c.Stat(lost); err != nil || info.Suspect || info.Version != 5 {
		t.Fatalf("after Put: %+v %v", info, err)
	}
}

// A damaged or misplaced object file is a suspect copy, not data; a
// store of another format is refused.
func TestHostileFiles(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "s")
	s := openT(t, dir, Options{})
	ids := []object.ID{object.Make(1, 0), object.Make(1, 1), object.Make(1, 2), object.Make(1, 3)}
	for _, id := range ids {
		if _, err := s.WriteAt(id, Stamp{Token: 0}, []byte("data"), 0, true); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	path := func(id object.ID) string {
		return filepath.Join(dir, "objects", "00000001", fmt.Sprintf("%08x", id.Index()))
	}
	f, _ := os.OpenFile(path(ids[0]), os.O_WRONLY, 0)
	f.WriteAt([]byte{0xff}, 25) // version byte: CRC fails
	f.Close()
	os.Truncate(path(ids[1]), 10) // short header
	b, _ := os.ReadFile(path(ids[3]))
	os.WriteFile(path(ids[2]), b, 0o644) // another object's file
	s = openT(t, dir, Options{})
	for _, id := range ids[:3] {
		if _, err := s.ReadAt(id, make([]byte, 4), 0); !errors.Is(err, ErrSuspect) {
			t.Errorf("object %s with a bad header: %v", id, err)
		}
		if info, err := s.Stat(id); err != nil || !info.Suspect {
			t.Errorf("object %s with a bad header: %+v %v", id, info, err)
		}
	}
	if _, err := s.ReadAt(ids[3], make([]byte, 4), 0); err != nil {
		t.Errorf("intact object: %v", err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	// Suspicion found at load survives a clean Close.
	s = openT(t, dir, Options{})
	if info, _ := s.Stat(ids[0]); !info.Suspect {
		t.Error("suspicion of a bad header lost across Close")
	}
	s.Close()
	os.WriteFile(filepath.Join(dir, "FORMAT"), []byte("ovis store 2\n"), 0o644)
	if _, err := Open(dir, Options{}); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("Open of another format: %v", err)
	}
	if _, err := Open(dir, Options{MaxOpenFiles: -1}); err == nil {
		t.Fatal("Open with MaxOpenFiles -1 succeeded")
	}
}

// A read running during a Flush does not keep the object journaled.
func TestFlushDuringRead(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "s")
	s := openT(t, dir, Options{})
	defer s.Close()
	id := object.Make(1, 0)
	if _, err := s.WriteAt(id, Stamp{Token: 0}, []byte("x"), 0, false); err != nil {
		t.Fatal(err)
	}
	a, err := s.begin(s.obj(id), forRead, 0) // a read in progress
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Flush(1); err != nil {
		t.Fatal(err)
	}
	s.end(a)
	c := openT(t, snapshot(t, dir), Options{})
	defer c.Close()
	if info, err := c.Stat(id); err != nil || info.Suspect {
		t.Fatalf("flushed object read during the Flush: %+v %v", info, err)
	}
}

// A tombstone being recreated by a plain write when the node crashed is
// suspect, and its header still says removed; declared good, it is a
// tombstone, and the write that recreates it next must not expose the
// bytes of the write lost in the crash.
func TestTombstoneRecreatedAfterCrash(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "s")
	s := openT(t, dir, Options{})
	defer s.Close()
	id := object.Make(1, 0)
	if _, err := s.WriteAt(id, Stamp{Epoch: 2}, []byte("live"), 0, true); err != nil {
		t.Fatal(err)
	}
	if err := s.Remove(id, Stamp{Epoch: 2}); err != nil {
		t.Fatal(err)
	}
	v, err := s.WriteAt(id, Stamp{Epoch: 2}, []byte("lost"), 0, false)
	if err != nil || v != Version(2, 3) {
		t.Fatalf("write over the tombstone: v%#x %v, want %#x", v, err, Version(2, 3))
	}
	c := openT(t, snapshot(t, dir), Options{})
	defer c.Close()
	if info, err := c.Stat(id); err != nil || !info.Suspect || !info.Tombstone || info.Version != Version(2, 2) {
		t.Fatalf("after the crash: %+v %v, want a suspect tombstone at %#x", info, err, Version(2, 2))
	}
	if err := c.ClearSuspect(id); err != nil {
		t.Fatal(err)
	}
	if _, err := c.ReadAt(id, make([]byte, 4), 0); !errors.Is(err, ErrNotFound) {
		t.Fatalf("read of the tombstone: %v", err)
	}
	if v, err := c.WriteAt(id, Stamp{Epoch: 3}, []byte("new"), 100, true); err != nil || v != Version(3, 1) {
		t.Fatalf("recreate: v%#x %v", v, err)
	}
	p := make([]byte, 4)
	if _, err := c.ReadAt(id, p, 0); err != nil || !bytes.Equal(p, make([]byte, 4)) {
		t.Fatalf("recreated object reads %q at 0 (%v), want zeros", p, err)
	}
}

// A suspect copy is replaced by Put whatever the versions (its header's
// says nothing of its bytes), and dropped by Drop; once repaired, an
// equal version is not newer.
func TestPutAndDropOverSuspect(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "s")
	s := openT(t, dir, Options{})
	defer s.Close()
	a, b := object.Make(1, 0), object.Make(1, 1)
	for _, id := range []object.ID{a, b} {
		for i := range 3 {
			if _, err := s.WriteAt(id, Stamp{Epoch: 4}, []byte{byte(i + 1)}, int64(i), false); err != nil {
				t.Fatal(err)
			}
		}
	}
	c := openT(t, snapshot(t, dir), Options{})
	defer c.Close()
	for _, id := range []object.ID{a, b} {
		if info, err := c.Stat(id); err != nil || !info.Suspect {
			t.Fatalf("%s after the crash: %+v %v, want suspect", id, info, err)
		}
	}
	if err := c.Put(a, Version(3, 1), []byte("old")); err != nil {
		t.Fatalf("Put of an older version over a suspect: %v", err)
	}
	if err := c.Put(a, Version(3, 1), []byte("again")); !errors.Is(err, ErrNotNewer) {
		t.Fatalf("Put of an equal version over a good copy: %v, want ErrNotNewer", err)
	}
	if err := c.PutTombstone(a, Version(3, 1)); !errors.Is(err, ErrNotNewer) {
		t.Fatalf("PutTombstone of an equal version: %v, want ErrNotNewer", err)
	}
	p := make([]byte, 5)
	if v, err := c.ReadAt(a, p, 0); err != nil || v != Version(3, 1) || string(p) != "old\x00\x00" {
		t.Fatalf("after Put: v%#x %q %v", v, p, err)
	}
	if err := c.Drop(b, 0); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Stat(b); !errors.Is(err, ErrNotFound) {
		t.Fatalf("Stat after Drop of a suspect: %v, want ErrNotFound", err)
	}
	if err := c.Drop(a, Version(3, 0)); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Stat(a); err != nil {
		t.Fatalf("Drop below the copy's version deleted it: %v", err)
	}
}
