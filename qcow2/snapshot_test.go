package qcow2

import (
	"bytes"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
)

// Layout of the in-memory images the snapshot tests parse.
const (
	snapTestCluster  = 512
	snapTestTableOff = 0x2000
	snapTestFileSize = 0x10000
)

// snapTestFile returns a snapTestFileSize-byte file holding table at
// snapTestTableOff.
func snapTestFile(table []byte) []byte {
	f := make([]byte, max(snapTestFileSize, snapTestTableOff+len(table)))
	copy(f[snapTestTableOff:], table)
	return f
}

func parseSnapTestFile(file []byte, n uint32) ([]Snapshot, error) {
	return parseSnapshotTable(bytes.NewReader(file), snapTestTableOff, n, snapTestCluster, int64(len(file)))
}

func unhex(t testing.TB, s string) []byte {
	t.Helper()
	b, err := hex.DecodeString(strings.Join(strings.Fields(s), ""))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// TestSnapshotTableLayout checks encoding and parsing against entries laid
// out by hand from the specification.
func TestSnapshotTableLayout(t *testing.T) {
	tests := []struct {
		name    string
		version uint32
		snap    Snapshot
		// parsed is snap as parseSnapshotTable returns it.
		parsed Snapshot
		hex    string
	}{
		{
			name:    "v3 with icount",
			version: 3,
			snap: Snapshot{
				L1TableOffset: 0x1000, L1Size: 2, ID: "7", Name: "ab",
				DateSec: 0x01020304, DateNsec: 0x05060708, VMClockNsec: 0x1122334455667788,
				VMStateSize: 0x99, DiskSize: 0x4000000, HasDiskSize: true, ICount: 5,
			},
			hex: `
				0000000000001000 00000002 0001 0002
				01020304 05060708 1122334455667788
				00000099 00000018
				0000000000000099 0000000004000000 0000000000000005
				37 6162 0000000000`,
		},
		{
			name:    "v3 without icount",
			version: 3,
			snap: Snapshot{
				L1TableOffset: 0x1000, L1Size: 1, ID: "1", Name: "",
				DiskSize: 1 << 20, HasDiskSize: true, ICount: -1,
			},
			hex: `
				0000000000001000 00000001 0001 0000
				00000000 00000000 0000000000000000
				00000000 00000010
				0000000000000000 0000000000100000
				31 00000000000000`,
		},
		{
			name:    "v2 plain",
			version: 2,
			snap:    Snapshot{L1TableOffset: 0x1200, L1Size: 3, ID: "10", Name: "x", VMStateSize: 7, ICount: -1},
			hex: `
				0000000000001200 00000003 0002 0001
				00000000 00000000 0000000000000000
				00000007 00000000
				3130 78 0000000000`,
		},
		{
			// A VM state over 4 GiB needs the 64-bit field; the 32-bit
			// one reads 0 so that old readers see a disk-only snapshot.
			name:    "v2 large VM state",
			version: 2,
			snap:    Snapshot{L1TableOffset: 0x1200, ID: "2", Name: "big", VMStateSize: 5 << 32, ICount: -1},
			hex: `
				0000000000001200 00000000 0001 0003
				00000000 00000000 0000000000000000
				00000000 00000008
				0000000500000000
				32 626967 00000000`,
		},
		{
			// Unknown fields after the icount survive, and the known
			// fields overwrite their stale bytes in Extra.
			name:    "v3 unknown extra data",
			version: 3,
			snap: Snapshot{
				L1TableOffset: 0x1000, L1Size: 1, ID: "3", Name: "u",
				VMStateSize: 1, DiskSize: 2, HasDiskSize: true, ICount: 3,
				Extra: unhex(t, `ffffffffffffffff ffffffffffffffff ffffffffffffffff cafef00d`),
			},
			hex: `
				0000000000001000 00000001 0001 0001
				00000000 00000000 0000000000000000
				00000001 0000001c
				0000000000000001 0000000000000002 0000000000000003 cafef00d
				33 75 0000`,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			want := unhex(t, tt.hex)
			got := encodeSnapshotTable([]Snapshot{tt.snap}, tt.version)
			if !bytes.Equal(got, want) {
				t.Fatalf("encoded\n%x\nwant\n%x", got, want)
			}
			snaps, err := parseSnapTestFile(snapTestFile(want), 1)
			if err != nil {
				t.Fatal(err)
			}
			wantSnap := tt.snap
			if n := binary.BigEndian.Uint32(want[36:]); n > 0 {
				wantSnap.Extra = want[40 : 40+n]
			}
			if !reflect.DeepEqual(snaps, []Snapshot{wantSnap}) {
				t.Fatalf("parsed\n%+v\nwant\n%+v", snaps[0], wantSnap)
			}
			if l := snapshotTableLen(snaps); l > int64(len(want)) || l <= int64(len(want))-8 {
				t.Fatalf("snapshotTableLen = %d for a %d-byte padded table", l, len(want))
			}
		})
	}
}

// TestSnapshotTableRoundTrip encodes tables, parses them back and checks
// that a second encoding is identical.
func TestSnapshotTableRoundTrip(t *testing.T) {
	long := strings.Repeat("n", maxSnapshotString)
	tests := []struct {
		name    string
		version uint32
		snaps   []Snapshot
	}{
		{"v3 several", 3, []Snapshot{
			{L1TableOffset: 0x1000, L1Size: 1, ID: "1", Name: "snap1", DateSec: 1700000000, DateNsec: 999999999, DiskSize: 64 << 20, HasDiskSize: true, ICount: -1},
			{L1TableOffset: 0x1200, L1Size: 1, ID: "2", Name: "second one", VMClockNsec: 12345678901, ICount: 0},
			{L1TableOffset: 0x1400, L1Size: 64, ID: "30", Name: "with state", VMStateSize: 1 << 33, DiskSize: 1 << 40, HasDiskSize: true, ICount: 1 << 50},
		}},
		{"v2 no extra", 2, []Snapshot{
			{L1TableOffset: 0x1000, L1Size: 1, ID: "1", Name: "a", ICount: -1},
			{L1TableOffset: 0x1000, L1Size: 1, ID: "2", Name: "bb", ICount: -1},
		}},
		{"unicode and empty strings", 3, []Snapshot{
			{L1TableOffset: 0x1000, ID: "", Name: "", ICount: -1},
			{L1TableOffset: 0x1000, ID: "é", Name: "日本語 snapshot", ICount: -1},
		}},
		{"longest name", 3, []Snapshot{
			{L1TableOffset: 0x1000, L1Size: 1, ID: "1", Name: long, ICount: -1},
			{L1TableOffset: 0x1000, L1Size: 1, ID: long, Name: "x", ICount: -1},
		}},
		{"largest extra data", 3, []Snapshot{
			{L1TableOffset: 0x1000, L1Size: 1, ID: "1", Name: "x", ICount: 9, Extra: bytes.Repeat([]byte{0xab}, maxSnapshotExtra)},
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			enc := encodeSnapshotTable(tt.snaps, tt.version)
			if len(enc)%8 != 0 {
				t.Fatalf("table of %d bytes is not padded to 8", len(enc))
			}
			snaps, err := parseSnapTestFile(snapTestFile(enc), uint32(len(tt.snaps)))
			if err != nil {
				t.Fatal(err)
			}
			if len(snaps) != len(tt.snaps) {
				t.Fatalf("parsed %d snapshots, want %d", len(snaps), len(tt.snaps))
			}
			for i, s := range snaps {
				w := tt.snaps[i]
				if s.L1TableOffset != w.L1TableOffset || s.L1Size != w.L1Size || s.ID != w.ID || s.Name != w.Name ||
					s.DateSec != w.DateSec || s.DateNsec != w.DateNsec || s.VMClockNsec != w.VMClockNsec ||
					s.VMStateSize != w.VMStateSize || s.ICount != w.ICount {
					t.Errorf("snapshot %d: parsed %+v, want %+v", i, s, w)
				}
				if w.HasDiskSize && (!s.HasDiskSize || s.DiskSize != w.DiskSize) {
					t.Errorf("snapshot %d: disk size %d (%v), want %d", i, s.DiskSize, s.HasDiskSize, w.DiskSize)
				}
				if tt.version >= 3 && len(s.Extra) < snapshotExtraV3 {
					t.Errorf("snapshot %d: %d bytes of extra data in a v3 table", i, len(s.Extra))
				}
				if len(w.Extra) > extraICount+8 && !bytes.Equal(s.Extra[extraICount+8:], w.Extra[extraICount+8:]) {
					t.Errorf("snapshot %d: unknown extra data not kept", i)
				}
			}
			if again := encodeSnapshotTable(snaps, tt.version); !bytes.Equal(again, enc) {
				t.Fatal("re-encoding the parsed table changed it")
			}
			if l := snapshotTableLen(snaps); l > int64(len(enc)) || l <= int64(len(enc))-8 {
				t.Fatalf("snapshotTableLen = %d for a %d-byte padded table", l, len(enc))
			}
		})
	}
}

func TestSnapshotEncodePanics(t *testing.T) {
	tests := []struct {
		name string
		snap Snapshot
	}{
		{"long ID", Snapshot{ID: strings.Repeat("i", maxSnapshotString+1)}},
		{"long name", Snapshot{Name: strings.Repeat("n", maxSnapshotString+1)}},
		{"extra data", Snapshot{Extra: make([]byte, maxSnapshotExtra+1)}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if err := tt.snap.checkEncodable(); err == nil {
				t.Fatal("checkEncodable accepted the snapshot")
			}
			defer func() {
				if recover() == nil {
					t.Fatal("encodeSnapshotTable did not panic")
				}
			}()
			encodeSnapshotTable([]Snapshot{tt.snap}, 3)
		})
	}
}

// repeatReader is an endless file whose bytes from base on repeat entry.
type repeatReader struct {
	base  int64
	entry []byte
}

func (r repeatReader) ReadAt(p []byte, off int64) (int, error) {
	for i := range p {
		if o := off + int64(i); o >= r.base {
			p[i] = r.entry[(o-r.base)%int64(len(r.entry))]
		} else {
			p[i] = 0
		}
	}
	return len(p), nil
}

func ptr[T any](v T) *T { return &v }

type errReader struct{ err error }

func (r errReader) ReadAt(p []byte, off int64) (int, error) { return 0, r.err }

func TestParseSnapshotTableErrors(t *testing.T) {
	base := encodeSnapshotTable([]Snapshot{
		{L1TableOffset: 0x1000, L1Size: 2, ID: "1", Name: "first", DiskSize: 1 << 20, HasDiskSize: true, ICount: -1},
		{L1TableOffset: 0x1200, L1Size: 2, ID: "2", Name: "second", DiskSize: 1 << 20, HasDiskSize: true, ICount: -1},
	}, 3)
	entry1 := int64(40 + 16 + 1 + 5 + 2) // second entry's offset in the table
	be := binary.BigEndian

	tests := []struct {
		name string
		// edit changes the table; off, n and fileSize are the arguments
		// to parseSnapshotTable, 0 meaning the defaults.
		edit     func(b []byte)
		off      *uint64
		n        uint32
		fileSize int64
		want     string
	}{
		{name: "too many snapshots", n: maxSnapshots + 1, want: "65537 snapshots exceed 65536"},
		{name: "entries past the end of the file", n: (snapTestFileSize-snapTestTableOff)/40 + 1, want: "1434 entries at 0x2000 run past the end of the file (65536 bytes)"},
		{name: "table offset not aligned", off: ptr[uint64](snapTestTableOff + 8), want: "offset 0x2008 is not cluster aligned"},
		{name: "table offset 0", off: ptr[uint64](0), want: "overlaps the image header"},
		{name: "table past the end of the file", off: ptr[uint64](snapTestFileSize), want: "2 entries at 0x10000 run past the end of the file"},
		{name: "table at the end of the file", n: 1, fileSize: snapTestTableOff + 50, want: "snapshot 0 at 0x2028: entry runs past the end of the file"},
		{name: "second entry cut", fileSize: snapTestTableOff + entry1 + 39, want: "snapshot 1 at 0x2040: entry runs past the end of the file"},
		{name: "second name cut", fileSize: snapTestTableOff + entry1 + 40 + 16 + 1 + 5, want: "snapshot 1 at 0x2068: entry runs past the end of the file"},
		{name: "extra data over 1024", edit: func(b []byte) { be.PutUint32(b[36:], 1025) }, want: "snapshot 0 at 0x2000: 1025 bytes of extra data exceed 1024"},
		{name: "extra data 4 GiB", edit: func(b []byte) { be.PutUint32(b[entry1+36:], 0xffffffff) }, want: "snapshot 1 at 0x2040: 4294967295 bytes of extra data exceed 1024"},
		{name: "ID past the end of the file", edit: func(b []byte) { be.PutUint16(b[entry1+12:], 0xffff) }, want: "snapshot 1 at 0x2068: entry runs past the end of the file"},
		{name: "name past the end of the file", edit: func(b []byte) { be.PutUint16(b[14:], 0xffff) }, want: "snapshot 0 at 0x2028: entry runs past the end of the file"},
		{name: "L1 not aligned", edit: func(b []byte) { be.PutUint64(b[entry1:], 0x1208) }, want: "snapshot 1 at 0x2040: L1 table offset 0x1208 is not cluster aligned"},
		{name: "L1 at offset 0", edit: func(b []byte) { be.PutUint64(b[0:], 0) }, want: "snapshot 0 at 0x2000: L1 table at 0x0 (16 bytes) is outside the file"},
		{name: "L1 past the end of the file", edit: func(b []byte) { be.PutUint64(b[0:], snapTestFileSize) }, want: "L1 table at 0x10000 (16 bytes) is outside the file (65536 bytes)"},
		{name: "L1 runs past the end of the file", edit: func(b []byte) { be.PutUint32(b[8:], (snapTestFileSize-0x1000)/8+1) }, want: "L1 table at 0x1000 (61448 bytes) is outside the file"},
		{name: "L1 over 32 MiB", edit: func(b []byte) { be.PutUint32(b[entry1+8:], maxL1Bytes/8+1) }, want: "snapshot 1 at 0x2040: L1 table of 4194305 entries exceeds 33554432 bytes"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			file := snapTestFile(base)
			if tt.edit != nil {
				tt.edit(file[snapTestTableOff:])
			}
			off, n, fileSize := uint64(snapTestTableOff), uint32(2), int64(len(file))
			if tt.off != nil {
				off = *tt.off
			}
			if tt.n != 0 {
				n = tt.n
			}
			if tt.fileSize != 0 {
				fileSize = tt.fileSize
				file = file[:fileSize]
			}
			snaps, err := parseSnapshotTable(bytes.NewReader(file), off, n, snapTestCluster, fileSize)
			if err == nil {
				t.Fatalf("parsed %d snapshots, want an error", len(snaps))
			}
			if !IsCorrupt(err) {
				t.Fatalf("error is not a *CorruptError: %v", err)
			}
			if !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("error %q does not contain %q", err, tt.want)
			}
		})
	}

	t.Run("table over 64 MiB", func(t *testing.T) {
		// Entries with the longest ID and name, 131112 bytes each, in a
		// file of 1 TiB: entry 511 crosses QEMU's 64 MiB limit.
		e := make([]byte, 40+2*maxSnapshotString+2)
		be.PutUint16(e[12:], maxSnapshotString)
		be.PutUint16(e[14:], maxSnapshotString)
		r := repeatReader{base: 1 << 20, entry: e}
		_, err := parseSnapshotTable(r, 1<<20, 600, 1<<16, 1<<40)
		if !IsCorrupt(err) || !strings.Contains(err.Error(), "snapshot 511 at ") || !strings.Contains(err.Error(), "table exceeds 67108864 bytes") {
			t.Fatalf("got %v, want the 64 MiB limit at snapshot 511", err)
		}
	})
	t.Run("read error", func(t *testing.T) {
		boom := errors.New("boom")
		_, err := parseSnapshotTable(errReader{boom}, 0x10000, 1, 0x10000, 1<<20)
		if !errors.Is(err, boom) || IsCorrupt(err) || !strings.Contains(err.Error(), "snapshot 0 at 0x10000") {
			t.Fatalf("got %v, want the read error wrapped with the entry", err)
		}
	})
	t.Run("file shorter than its size", func(t *testing.T) {
		file := snapTestFile(base)[:snapTestTableOff+50]
		_, err := parseSnapshotTable(bytes.NewReader(file), snapTestTableOff, 2, snapTestCluster, snapTestFileSize)
		if !errors.Is(err, io.ErrUnexpectedEOF) || IsCorrupt(err) {
			t.Fatalf("got %v, want io.ErrUnexpectedEOF", err)
		}
	})
	t.Run("no snapshots", func(t *testing.T) {
		// With no snapshots, the offset is not looked at.
		snaps, err := parseSnapshotTable(errReader{io.EOF}, 12345, 0, snapTestCluster, 0)
		if snaps != nil || err != nil {
			t.Fatalf("got %v, %v", snaps, err)
		}
	})
}

// qemuSnapshotInfo is one element of "snapshots" in qemu-img info's JSON.
type qemuSnapshotInfo struct {
	ID          string `json:"id"`
	Name        string `json:"name"`
	VMStateSize uint64 `json:"vm-state-size"`
	DateSec     uint32 `json:"date-sec"`
	DateNsec    uint32 `json:"date-nsec"`
	VMClockSec  uint64 `json:"vm-clock-sec"`
	VMClockNsec uint64 `json:"vm-clock-nsec"`
	ICount      *int64 `json:"icount"`
}

func qemuSnapshots(t *testing.T, qimg, path string) []qemuSnapshotInfo {
	t.Helper()
	var info struct {
		Snapshots []qemuSnapshotInfo `json:"snapshots"`
	}
	out := mustRun(t, qimg, "info", "--output=json", "-f", "qcow2", path)
	if err := json.Unmarshal([]byte(out), &info); err != nil {
		t.Fatalf("qemu-img info: %v\n%s", err, out)
	}
	return info.Snapshots
}

// readSnapshotsOf parses the header and snapshot table of the image at
// path.
func readSnapshotsOf(t *testing.T, path string) (*Header, []Snapshot, []byte) {
	t.Helper()
	file, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	h, err := ParseHeader(file, int64(len(file)))
	if err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	snaps, err := parseSnapshotTable(f, h.SnapshotsOffset, h.NbSnapshots, h.ClusterSize(), int64(len(file)))
	if err != nil {
		t.Fatal(err)
	}
	return h, snaps, file
}

func compareWithQemu(t *testing.T, snaps []Snapshot, want []qemuSnapshotInfo) {
	t.Helper()
	if len(snaps) != len(want) {
		t.Fatalf("parsed %d snapshots, qemu-img lists %d", len(snaps), len(want))
	}
	for i, s := range snaps {
		w := want[i]
		icount := int64(-1)
		if w.ICount != nil {
			icount = *w.ICount
		}
		got := fmt.Sprintf("%s %q state %d date %d.%09d clock %d icount %d", s.ID, s.Name, s.VMStateSize, s.DateSec, s.DateNsec, s.VMClockNsec, s.ICount)
		exp := fmt.Sprintf("%s %q state %d date %d.%09d clock %d icount %d", w.ID, w.Name, w.VMStateSize, w.DateSec, w.DateNsec, w.VMClockSec*1e9+w.VMClockNsec, icount)
		if got != exp {
			t.Errorf("snapshot %d:\n got %s\nwant %s", i, got, exp)
		}
	}
}

// TestQEMUSnapshotTable parses snapshot tables written by QEMU, checks
// them against qemu-img info, checks that encodeSnapshotTable reproduces
// QEMU's bytes, and that QEMU reads a table ovis wrote, keeping unknown
// extra data when it rewrites the table.
func TestQEMUSnapshotTable(t *testing.T) {
	qimg := needQemuImg(t)
	qio, err := exec.LookPath("qemu-io")
	if err != nil {
		t.Fatal("qemu-io not installed: run scripts/test.sh, which installs qemu-utils")
	}
	for _, compat := range []string{"0.10", "1.1"} {
		t.Run("compat="+compat, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "x.qcow2")
			mustRun(t, qimg, "create", "-f", "qcow2", "-o", "compat="+compat, path, "64M")
			mustRun(t, qio, "-f", "qcow2", "-c", "write 0 1M", path)
			mustRun(t, qimg, "snapshot", "-c", "snap1", path)
			mustRun(t, qimg, "snapshot", "-c", "second one", path)

			h, snaps, file := readSnapshotsOf(t, path)
			compareWithQemu(t, snaps, qemuSnapshots(t, qimg, path))
			list := mustRun(t, qimg, "snapshot", "-l", path)
			for _, s := range snaps {
				if s.L1Size != h.L1Size {
					t.Errorf("snapshot %s: L1 size %d, image L1 size %d", s.ID, s.L1Size, h.L1Size)
				}
				if !s.HasDiskSize || s.DiskSize != 64<<20 {
					t.Errorf("snapshot %s: disk size %d (%v), want %d", s.ID, s.DiskSize, s.HasDiskSize, 64<<20)
				}
				if !strings.Contains(list, s.Name) {
					t.Errorf("qemu-img snapshot -l does not list %q:\n%s", s.Name, list)
				}
			}

			// Our encoding of QEMU's table is QEMU's table.
			enc := encodeSnapshotTable(snaps, h.Version)
			n := snapshotTableLen(snaps)
			onDisk := file[h.SnapshotsOffset : h.SnapshotsOffset+uint64(n)]
			if !bytes.Equal(enc[:n], onDisk) || bytes.Count(enc[n:], []byte{0}) != len(enc)-int(n) {
				t.Fatalf("encoded table differs from QEMU's:\n got %x\nwant %x", enc, onDisk)
			}

			// Rewrite the table in place with new names, times, an icount
			// and unknown extra data, all within the clusters QEMU
			// allocated for it.
			unknown := []byte("ovis-unknown-ext")
			for i := range snaps {
				s := &snaps[i]
				s.Name = fmt.Sprintf("renamed %d", i)
				s.VMClockNsec = uint64(i)*1e9 + 5e8
				s.DateNsec = 123
				s.ICount = int64(1000 + i)
				s.Extra = append(s.Extra[:extraKnownEnd(s)], unknown...)
			}
			enc = encodeSnapshotTable(snaps, h.Version)
			cs := h.ClusterSize()
			if (int64(len(enc))+cs-1)/cs > (n+cs-1)/cs {
				t.Fatalf("rewritten table of %d bytes needs more clusters than %d bytes", len(enc), n)
			}
			f, err := os.OpenFile(path, os.O_RDWR, 0)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := f.WriteAt(enc, int64(h.SnapshotsOffset)); err != nil {
				t.Fatal(err)
			}
			if err := f.Close(); err != nil {
				t.Fatal(err)
			}
			mustRun(t, qimg, "check", "-f", "qcow2", path)
			compareWithQemu(t, snaps, qemuSnapshots(t, qimg, path))

			// QEMU writes a new table; our unknown extra data survives.
			mustRun(t, qimg, "snapshot", "-c", "third", path)
			mustRun(t, qimg, "check", "-f", "qcow2", path)
			_, again, _ := readSnapshotsOf(t, path)
			compareWithQemu(t, again, qemuSnapshots(t, qimg, path))
			if len(again) != 3 || again[2].Name != "third" {
				t.Fatalf("after qemu-img snapshot -c: %+v", again)
			}
			for i := range 2 {
				if !bytes.HasSuffix(again[i].Extra, unknown) || again[i].Name != snaps[i].Name {
					t.Errorf("snapshot %d after QEMU's rewrite: name %q, extra %x", i, again[i].Name, again[i].Extra)
				}
			}
		})
	}
}

// TestQEMUSnapshotEmptyDisk parses the snapshot of a 0-byte disk, whose L1
// table is empty and at offset 0.
func TestQEMUSnapshotEmptyDisk(t *testing.T) {
	qimg := needQemuImg(t)
	path := filepath.Join(t.TempDir(), "empty.qcow2")
	mustRun(t, qimg, "create", "-f", "qcow2", path, "0")
	mustRun(t, qimg, "snapshot", "-c", "s", path)
	_, snaps, _ := readSnapshotsOf(t, path)
	compareWithQemu(t, snaps, qemuSnapshots(t, qimg, path))
	if len(snaps) != 1 || snaps[0].L1Size != 0 || snaps[0].DiskSize != 0 || !snaps[0].HasDiskSize {
		t.Fatalf("got %+v", snaps)
	}
}

// extraKnownEnd returns how much of s.Extra the known fields take.
func extraKnownEnd(s *Snapshot) int { return min(len(s.Extra), extraICount+8) }

// FuzzSnapshotTable parses arbitrary tables. Parsing must not panic, and a
// table that parses must encode to one that parses to the same snapshots.
func FuzzSnapshotTable(f *testing.F) {
	f.Add(uint32(1), encodeSnapshotTable([]Snapshot{{L1TableOffset: 0x1000, L1Size: 1, ID: "1", Name: "a", ICount: -1}}, 3))
	f.Add(uint32(2), encodeSnapshotTable([]Snapshot{
		{L1TableOffset: 0x1000, L1Size: 1, ID: "1", Name: "a", ICount: 4, Extra: make([]byte, 40)},
		{L1TableOffset: 0x1200, ID: "2", Name: "bb", VMStateSize: 1 << 40, ICount: -1},
	}, 2))
	f.Fuzz(func(t *testing.T, n uint32, table []byte) {
		file := snapTestFile(table)
		snaps, err := parseSnapTestFile(file, n)
		if err != nil {
			if !IsCorrupt(err) {
				t.Fatalf("error is not a *CorruptError: %v", err)
			}
			return
		}
		if uint32(len(snaps)) != n {
			t.Fatalf("parsed %d snapshots, want %d", len(snaps), n)
		}
		if l := snapshotTableLen(snaps); l > int64(len(file)-snapTestTableOff) {
			t.Fatalf("snapshotTableLen %d exceeds the %d bytes available", l, len(file)-snapTestTableOff)
		}
		// Version 2 keeps extra data as it is, so the round trip is exact.
		enc := encodeSnapshotTable(snaps, 2)
		file2 := snapTestFile(enc)
		file2 = append(file2, make([]byte, max(0, len(file)-len(file2)))...)
		again, err := parseSnapTestFile(file2, n)
		if err != nil {
			t.Fatalf("re-encoded table does not parse: %v", err)
		}
		if !reflect.DeepEqual(again, snaps) {
			t.Fatalf("round trip changed the snapshots:\n%+v\n%+v", snaps, again)
		}
	})
}

// TestLoadSnapshot: a read-only image reads as one of its internal
// snapshots after LoadSnapshot, as qemu-nbd -l shows it: the snapshot's
// data, zeros past the snapshot's L1 table, the image's current size.
func TestLoadSnapshot(t *testing.T) {
	qimg := needQemuImg(t)
	path := filepath.Join(t.TempDir(), "s.qcow2")
	mustRun(t, qimg, "create", "-f", "qcow2", path, "1M")
	mustRun(t, "qemu-io", "-f", "qcow2", "-c", "write -P 1 0 64k", path)
	mustRun(t, qimg, "snapshot", "-c", "snap1", path)
	mustRun(t, qimg, "resize", path, "1G") // past the snapshot's L1 table
	mustRun(t, "qemu-io", "-f", "qcow2", "-c", "write -P 2 0 64k", "-c", "write -P 3 600M 64k", path)

	rw, err := Open(path, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if err := rw.LoadSnapshot("1", ""); err == nil {
		t.Error("LoadSnapshot on a read-write image succeeded")
	}
	rw.Close()

	for _, c := range []struct {
		id, name string
		found    bool
	}{
		{"1", "", true}, {"", "snap1", true}, {"1", "snap1", true},
		{"2", "", false}, {"1", "other", false}, {"", "", false},
	} {
		img, err := Open(path, Options{ReadOnly: true})
		if err != nil {
			t.Fatal(err)
		}
		err = img.LoadSnapshot(c.id, c.name)
		if !c.found {
			if !errors.Is(err, ErrSnapshotNotFound) {
				t.Errorf("LoadSnapshot(%q, %q) = %v, want ErrSnapshotNotFound", c.id, c.name, err)
			}
			img.Close()
			continue
		}
		if err != nil {
			t.Fatalf("LoadSnapshot(%q, %q): %v", c.id, c.name, err)
		}
		if img.Size() != 1<<30 {
			t.Errorf("size %d after loading the snapshot, want the image's 1 GiB", img.Size())
		}
		for _, r := range []struct {
			off  int64
			want byte
		}{{0, 1}, {64 << 10, 0}, {600 << 20, 0}} {
			buf := make([]byte, 64<<10)
			if _, err := img.ReadAt(ctx, buf, r.off); err != nil {
				t.Fatal(err)
			}
			if bytes.Count(buf, []byte{r.want}) != len(buf) {
				t.Errorf("snapshot (%q, %q) at %d: want all %d, got %x...", c.id, c.name, r.off, r.want, buf[:8])
			}
		}
		img.Close()
	}
}
