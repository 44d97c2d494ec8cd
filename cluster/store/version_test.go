package store

import (
	"encoding/binary"
	"hash/crc32"
	"math"
	"os"
	"path/filepath"
	"testing"

	"github.com/ovis-storage/ovis/cluster/object"
)

func TestVersion(t *testing.T) {
	for _, c := range []struct {
		name       string
		old, epoch uint64
		want       uint64
	}{
		{"first write of epoch 0", 0, 0, Version(0, 1)},
		{"format-1 counter goes on", 41, 0, 42},
		{"first write of a new epoch", Version(3, 17), 5, Version(5, 1)},
		{"same epoch counts up", Version(5, 1), 5, Version(5, 2)},
		{"an older epoch's request counts up", Version(5, 7), 4, Version(5, 8)},
		{"count 0 (a Put's) in its epoch", Version(5, 0), 5, Version(5, 1)},
		{"saturated count stays", Version(5, math.MaxUint32), 5, Version(5, math.MaxUint32)},
		{"saturated, older request", Version(5, math.MaxUint32), 2, Version(5, math.MaxUint32)},
		{"saturated, newer epoch", Version(5, math.MaxUint32), 6, Version(6, 1)},
		{"highest epoch", Version(MaxEpoch, math.MaxUint32), MaxEpoch, math.MaxUint64},
	} {
		t.Run(c.name, func(t *testing.T) {
			got := nextVersion(c.old, c.epoch)
			if got != c.want {
				t.Fatalf("nextVersion(%#x, %d) = %#x, want %#x", c.old, c.epoch, got, c.want)
			}
			if got < c.old {
				t.Fatalf("version went down: %#x after %#x", got, c.old)
			}
			if e := VersionEpoch(got); e < c.epoch || e < VersionEpoch(c.old) {
				t.Fatalf("epoch %d of %#x, want at least %d and %d", e, got, c.epoch, VersionEpoch(c.old))
			}
		})
	}
	if v := Version(7, 9); VersionEpoch(v) != 7 || VersionCount(v) != 9 {
		t.Fatalf("Version(7, 9) = %#x splits into %d, %d", v, VersionEpoch(v), VersionCount(v))
	}
}

// A file written before versions carried epochs (format 1, flags 0, a
// plain counter) opens with a version of epoch 0, and its next write
// goes on from it, or jumps to its epoch.
func TestFormat1Versions(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "s")
	s := openT(t, dir, Options{})
	id := object.Make(4, 2)
	if _, err := s.WriteAt(object.Make(4, 0), Stamp{}, []byte("x"), 0, true); err != nil { // makes the VDI's directory
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	// The header as the first release wrote it, byte by byte.
	b := make([]byte, HeaderSize+3)
	copy(b, "OVISOBJ\x00")
	binary.LittleEndian.PutUint32(b[8:], 1)
	binary.LittleEndian.PutUint64(b[16:], uint64(id))
	binary.LittleEndian.PutUint64(b[24:], 17)
	binary.LittleEndian.PutUint32(b[32:], crc32.Checksum(b[:32], crc32.MakeTable(crc32.Castagnoli)))
	copy(b[HeaderSize:], "old")
	if err := os.WriteFile(filepath.Join(dir, "objects", "00000004", "00000002"), b, 0o644); err != nil {
		t.Fatal(err)
	}
	s = openT(t, dir, Options{})
	defer s.Close()
	p := make([]byte, 3)
	if v, err := s.ReadAt(id, p, 0); err != nil || v != 17 || VersionEpoch(v) != 0 || string(p) != "old" {
		t.Fatalf("format-1 copy: v%#x %q %v, want v17 of epoch 0", v, p, err)
	}
	if v, err := s.WriteAt(id, Stamp{}, []byte("a"), 0, true); err != nil || v != 18 {
		t.Fatalf("write at epoch 0: v%#x %v, want 18", v, err)
	}
	if v, err := s.WriteAt(id, Stamp{Epoch: 3}, []byte("b"), 0, false); err != nil || v != Version(3, 1) {
		t.Fatalf("write at epoch 3: v%#x %v, want %#x", v, err, Version(3, 1))
	}
}
