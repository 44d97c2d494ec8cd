package block

import (
	"errors"
	"path/filepath"
	"slices"
	"testing"

	"github.com/ovis-storage/ovis/internal/testutil"
)

const (
	qcow2RW = PermConsistentRead | PermWrite | PermResize
	qcow2Un = PermWrite | PermResize
)

func lockedImage(t *testing.T) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "a.qcow2")
	testutil.QemuImg(t, "create", "-f", "qcow2", p, "1M")
	return p
}

func openLocked(t *testing.T, p string, perm, unshared Perm) (*OSFile, error) {
	t.Helper()
	f, err := OpenFile(p, perm&PermWrite == 0)
	if err != nil {
		t.Fatal(err)
	}
	if err := f.LockImage(p, perm, unshared); err != nil {
		f.Close()
		return nil, err
	}
	return f, nil
}

// TestLockBytes: a holder takes byte 100+i for each permission bit and
// 200+i for each it refuses to share; holders in one process share one
// set of bytes, which stays until the last closes.
func TestLockBytes(t *testing.T) {
	p := lockedImage(t)
	a, err := openLocked(t, p, qcow2RW, qcow2Un)
	if err != nil {
		t.Fatal(err)
	}
	want := []int64{100, 101, 103, 201, 203}
	if got := testutil.LockedBytes(t, p); !slices.Equal(got, want) {
		t.Fatalf("locked bytes %v, want %v", got, want)
	}
	// A second holder in this process, read-only and sharing all: no
	// conflict with the first, and no change in the bytes.
	b, err := openLocked(t, p, PermConsistentRead, 0)
	if err != nil {
		t.Fatalf("second holder in one process: %v", err)
	}
	a.Close()
	if got := testutil.LockedBytes(t, p); !slices.Equal(got, []int64{100}) {
		t.Fatalf("after the writer closed: locked bytes %v, want [100]", got)
	}
	b.Close()
	if got := testutil.LockedBytes(t, p); len(got) != 0 {
		t.Fatalf("after both closed: locked bytes %v, want none", got)
	}
}

// TestLockConflicts: against a qemu-io holding the image, a lock fails
// with the permission QEMU would name, and leaves no bytes behind.
func TestLockConflicts(t *testing.T) {
	for _, c := range []struct {
		name           string
		holder         []string
		perm, unshared Perm
		fail           Perm // 0: no conflict
		shared         bool
	}{
		{"writer blocks reader", []string{"-f", "qcow2"}, PermConsistentRead, qcow2Un, PermWrite, true},
		{"writer allows -U reader", []string{"-f", "qcow2"}, PermConsistentRead, 0, 0, false},
		{"reader blocks writer", []string{"-r", "-f", "qcow2"}, qcow2RW, qcow2Un, PermWrite, false},
		{"reader allows reader", []string{"-r", "-f", "qcow2"}, PermConsistentRead, qcow2Un, 0, false},
		{"-U reader allows writer", []string{"-r", "-U", "-f", "qcow2"}, qcow2RW, qcow2Un, 0, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			p := lockedImage(t)
			testutil.HoldWithQemuIO(t, p, c.holder...)
			held := testutil.LockedBytes(t, p)
			f, err := openLocked(t, p, c.perm, c.unshared)
			if c.fail == 0 {
				if err != nil {
					t.Fatalf("lock: %v", err)
				}
				f.Close()
				return
			}
			var le *LockError
			if !errors.As(err, &le) || le.Perm != c.fail || le.Shared != c.shared || le.Path != p {
				t.Fatalf("lock: %v, want a LockError for %v (shared %v) on %s", err, c.fail, c.shared, p)
			}
			if got := testutil.LockedBytes(t, p); !slices.Equal(got, held) {
				t.Errorf("after the failed lock: bytes %v, want the holder's %v", got, held)
			}
		})
	}
}

// TestLockInProcess: holders in one process conflict as QEMU's nodes do
// (each as if it were another process), except a reopen (LockReopen) and
// the holders after a yielding one (LockYield); a refused holder leaves
// the bytes as they were.
func TestLockInProcess(t *testing.T) {
	qcow2RO := PermConsistentRead
	for _, c := range []struct {
		name             string
		firstP, firstU   Perm
		secondP, secondU Perm
		fail             Perm // 0: no conflict
		shared           bool
	}{
		{"reader blocks writer", qcow2RO, qcow2Un, qcow2RW, qcow2Un, PermWrite, false},
		{"writer blocks reader", qcow2RW, qcow2Un, qcow2RO, qcow2Un, PermWrite, true},
		{"reader allows reader", qcow2RO, qcow2Un, qcow2RO, qcow2Un, 0, false},
		{"writer allows sharing reader", qcow2RW, qcow2Un, qcow2RO, 0, 0, false},
		{"raw writer blocked by resize refusal", PermConsistentRead, PermResize, PermConsistentRead | PermWrite | PermResize, 0, PermResize, false},
		{"reopen of a reader for writing", qcow2RO, qcow2Un, qcow2RW | LockReopen, qcow2Un, 0, false},
		{"writer after a yielding creator", qcow2RW | LockYield, qcow2Un, qcow2RW, qcow2Un, 0, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			p := lockedImage(t)
			a, err := openLocked(t, p, c.firstP, c.firstU)
			if err != nil {
				t.Fatal(err)
			}
			defer a.Close()
			held := testutil.LockedBytes(t, p)
			b, err := openLocked(t, p, c.secondP, c.secondU)
			if c.fail == 0 {
				if err != nil {
					t.Fatalf("second holder: %v", err)
				}
				b.Close()
				return
			}
			var le *LockError
			if !errors.As(err, &le) || le.Perm != c.fail || le.Shared != c.shared {
				t.Fatalf("second holder: %v, want a LockError for %v (shared %v)", err, c.fail, c.shared)
			}
			if got := testutil.LockedBytes(t, p); !slices.Equal(got, held) {
				t.Errorf("after the refused holder: bytes %v, want %v", got, held)
			}
		})
	}
}
