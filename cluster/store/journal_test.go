package store

import (
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/ovis-storage/ovis/cluster/object"
	"github.com/ovis-storage/ovis/cluster/store/vfs"
)

// The journal stays small under churn (compaction), and a torn tail is
// cut off at Open.
func TestJournalCompactionAndTornTail(t *testing.T) {
	old := compactAt
	compactAt = 2048
	defer func() { compactAt = old }()
	dir := filepath.Join(t.TempDir(), "s")
	s := openT(t, dir, Options{})
	defer s.Close()
	for i := range 300 {
		id := object.Make(1, uint32(i%7))
		if _, err := s.WriteAt(id, Stamp{Token: uint64(i / 50)}, []byte{byte(i)}, int64(i), false); err != nil {
			t.Fatal(err)
		}
		if i%3 == 0 {
			if err := s.Flush(1); err != nil {
				t.Fatal(err)
			}
		}
	}
	dirty := object.Make(1, 99)
	if _, err := s.WriteAt(dirty, Stamp{Token: 5}, []byte{1}, 0, false); err != nil {
		t.Fatal(err)
	}
	st, err := os.Stat(filepath.Join(dir, "journal"))
	if err != nil {
		t.Fatal(err)
	}
	if st.Size() > 2*compactAt {
		t.Fatalf("journal of %d bytes after churn, compaction at %d", st.Size(), compactAt)
	}
	crashed := snapshot(t, dir)
	f, err := os.OpenFile(filepath.Join(crashed, "journal"), os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		t.Fatal(err)
	}
	f.Write([]byte("torn record\x00\x01"))
	f.Close()
	c := openT(t, crashed, Options{})
	defer c.Close()
	if c.Token(1) != 5 {
		t.Fatalf("token %d after compaction and a crash, want 5", c.Token(1))
	}
	if info, err := c.Stat(dirty); err != nil || !info.Suspect {
		t.Fatalf("dirty object after compaction and a crash: %+v %v", info, err)
	}
	if info, err := c.Stat(object.Make(1, 0)); err != nil || info.Suspect {
		t.Fatalf("flushed object after a crash: %+v %v", info, err)
	}
	if _, err := c.WriteAt(object.Make(1, 1), Stamp{Token: 5}, []byte{1}, 0, true); err != nil {
		t.Fatalf("write after a torn journal tail: %v", err)
	}
}

// A batch that ENOSPC cut off fails for every caller in it, even after a
// later batch succeeds, and the journal goes on.
func TestJournalNoSpaceBatch(t *testing.T) {
	j, err := openJournal(vfs.Default, t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	defer j.close()
	seq := j.enqueue(record{key: 1, op: recDirty})
	good := j.fd
	j.fd = -1 // the write fails with EBADF: sticky
	if err := j.wait(seq); err == nil {
		t.Fatal("write to a bad fd succeeded")
	}
	j.err, j.fd = nil, good
	j.mu.Lock()
	j.failed = map[uint64]error{seq: ErrNoSpace}
	j.mu.Unlock()
	later := j.enqueue(record{key: 2, op: recDirty})
	if err := j.wait(later); err != nil {
		t.Fatal(err)
	}
	if err := j.wait(seq); !errors.Is(err, ErrNoSpace) {
		t.Fatalf("waiter of the failed batch: %v", err)
	}
}
