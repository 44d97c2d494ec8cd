package image

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"pgregory.net/rapid"

	"github.com/ovis-storage/ovis/internal/testutil"
	"github.com/ovis-storage/ovis/qcow2"
)

func TestParseSnapshot(t *testing.T) {
	tests := []struct {
		in   string
		want Snapshot
		bad  string // the option refused
	}{
		{in: "snap1", want: Snapshot{IDOrName: "snap1"}},
		{in: "1", want: Snapshot{IDOrName: "1"}},
		{in: "snapshot.id=2", want: Snapshot{ID: "2"}},
		{in: "snapshot.name=a,,b", want: Snapshot{Name: "a,b"}},
		{in: "snapshot.id=1,snapshot.name=x", want: Snapshot{ID: "1", Name: "x"}},
		{in: "snapshot.id=1,size=3", bad: "size"},
		{in: "snapshot.bogus", bad: "snapshot.bogus"},
	}
	for _, tt := range tests {
		got, err := ParseSnapshot(tt.in)
		if tt.bad != "" {
			var oe *OptError
			if !errors.As(err, &oe) || !errors.Is(err, ErrOptUnsupported) || oe.Name != tt.bad || oe.Driver != "snapshot" {
				t.Errorf("ParseSnapshot(%q) = %v, want %s refused", tt.in, err, tt.bad)
			}
			continue
		}
		if err != nil || got != tt.want {
			t.Errorf("ParseSnapshot(%q) = %+v, %v, want %+v", tt.in, got, err, tt.want)
		}
	}
}

// TestSnapshotStringRoundTrip: String writes what ParseSnapshot reads back.
func TestSnapshotStringRoundTrip(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		var s Snapshot
		chars := rapid.SampledFrom([]rune("ab1,=. "))
		if rapid.Bool().Draw(t, "one") {
			// The one-string form cannot start like the list form.
			s.IDOrName = rapid.StringOfN(chars, 1, 8, -1).Draw(t, "idOrName")
		} else {
			s.ID = rapid.StringOf(chars).Draw(t, "id")
			s.Name = rapid.StringOf(chars).Draw(t, "name")
			if s.ID == "" && s.Name == "" {
				s.ID = "1"
			}
		}
		got, err := ParseSnapshot(s.String())
		if err != nil || got != s {
			t.Fatalf("%+v written %q reads as %+v, %v", s, s.String(), got, err)
		}
	})
}

// TestLoadSnapshot reads an internal snapshot qemu-img made, named each
// way, and compares it with what qemu-img convert -l copies out of it.
func TestLoadSnapshot(t *testing.T) {
	dir := t.TempDir()
	q := filepath.Join(dir, "a.qcow2")
	testutil.QemuImg(t, "create", "-f", "qcow2", q, "1M")
	testutil.QemuIO(t, q, "qcow2", "write -P 0x11 0 64k")
	testutil.QemuImg(t, "snapshot", "-c", "first", q)
	testutil.QemuIO(t, q, "qcow2", "write -P 0x22 0 64k", "write -P 0x33 512k 4k")
	// A snapshot whose name is the other one's ID: the ID is found first.
	testutil.QemuImg(t, "snapshot", "-c", "1", q)
	want := filepath.Join(dir, "first.raw")
	testutil.QemuImg(t, "convert", "-l", "snapshot.name=first", "-O", "raw", q, want)
	wantData, err := os.ReadFile(want)
	if err != nil {
		t.Fatal(err)
	}
	testutil.QemuImg(t, "convert", "-O", "raw", q, filepath.Join(dir, "current.raw"))
	current, err := os.ReadFile(filepath.Join(dir, "current.raw"))
	if err != nil {
		t.Fatal(err)
	}
	if bytes.Equal(wantData, current) {
		t.Fatal("the snapshot holds what the image holds now: the test proves nothing")
	}
	for _, s := range []Snapshot{{Name: "first"}, {ID: "1"}, {ID: "1", Name: "first"}, {IDOrName: "first"}, {IDOrName: "1"}} {
		dev, err := OpenSnapshot(q, "qcow2", Options{}, s)
		if err != nil {
			t.Fatalf("OpenSnapshot(%+v): %v", s, err)
		}
		got := make([]byte, dev.Size())
		if _, err := dev.ReadAt(ctx, got, 0); err != nil {
			t.Fatal(err)
		}
		dev.Close()
		if !bytes.Equal(got, wantData) {
			t.Errorf("snapshot %+v reads other data than qemu-img convert -l copies", s)
		}
	}

	for _, tt := range []struct {
		s    Snapshot
		want error
	}{
		{Snapshot{Name: "none"}, qcow2.ErrSnapshotNotFound},
		{Snapshot{ID: "1", Name: "1"}, qcow2.ErrSnapshotNotFound},
		{Snapshot{IDOrName: "3"}, qcow2.ErrSnapshotNotFound},
	} {
		_, err := OpenSnapshot(q, "qcow2", Options{}, tt.s)
		var se *SnapshotError
		if !errors.Is(err, tt.want) || !errors.As(err, &se) || se.Snapshot != tt.s {
			t.Errorf("OpenSnapshot(%+v) = %v, want %v", tt.s, err, tt.want)
		}
	}
	r := filepath.Join(dir, "b.raw")
	testutil.QemuImg(t, "create", "-f", "raw", r, "1M")
	if _, err := OpenSnapshot(r, "raw", Options{}, Snapshot{IDOrName: "1"}); !errors.Is(err, ErrNoInternalSnapshots) {
		t.Errorf("a snapshot of a raw image = %v, want ErrNoInternalSnapshots", err)
	}
}
