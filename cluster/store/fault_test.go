package store

import (
	"bytes"
	"errors"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ovis-storage/ovis/cluster/object"
	"github.com/ovis-storage/ovis/cluster/store/vfs"
	"github.com/ovis-storage/ovis/cluster/store/vfs/errorfs"
)

// The fault tests put errorfs under the store: an fdatasync that fails
// (and loses the writes it should have made durable, as Linux may),
// ENOSPC, a torn pwrite and a crash. What they pin down: nothing is
// acknowledged that a fault may have lost, and a copy a fault may have
// damaged is suspect, never served as good.

// faultStore opens a store in a new directory over an errorfs with no
// rules yet.
func faultStore(t *testing.T) (*Store, *errorfs.FS, string) {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "s")
	fs := errorfs.New(nil, 1)
	s := openT(t, dir, Options{FS: fs})
	return s, fs, dir
}

// crashReopen simulates the death of the process that held s (its page
// cache survives, nothing more reaches the files) and opens the store
// again on the real file system.
func crashReopen(t *testing.T, s *Store, fs *errorfs.FS, dir string) *Store {
	t.Helper()
	fs.Crash()
	if err := s.Close(); err == nil {
		t.Fatal("Close of a crashed store succeeded")
	}
	return openT(t, dir, Options{})
}

// objFile is a rule's Path: id's object file in the store in dir.
func objFile(dir string, id object.ID) func(string) bool {
	path := objPathIn(dir, id)
	return func(p string) bool { return p == path }
}

func objPathIn(dir string, id object.ID) string {
	return (&Store{objDir: filepath.Join(dir, "objects")}).objPath(id)
}

func wantSuspect(t *testing.T, s *Store, id object.ID) {
	t.Helper()
	if info, err := s.Stat(id); err != nil || !info.Suspect {
		t.Fatalf("object %s: %+v, %v; want suspect", id, info, err)
	}
	if _, err := s.ReadAt(id, make([]byte, 10), 0); !errors.Is(err, ErrSuspect) {
		t.Fatalf("read of suspect %s: %v, want ErrSuspect", id, err)
	}
}

func wantContent(t *testing.T, s *Store, id object.ID, want []byte) {
	t.Helper()
	p := make([]byte, len(want))
	if _, err := s.ReadAt(id, p, 0); err != nil || !bytes.Equal(p, want) {
		t.Fatalf("object %s: %v, content equal %v", id, err, bytes.Equal(p, want))
	}
}

var tok1 = Stamp{Token: 1, Epoch: 1}

// A sync (FUA) write whose fdatasync fails is not acknowledged, the copy
// becomes suspect, and so does every later Flush of the VDI fail while
// the buffered writes that fdatasync should have covered may be lost,
// though a retried fdatasync "succeeds" (Linux reports the error once).
func TestFaultSyncWriteFdatasync(t *testing.T) {
	s, fs, dir := faultStore(t)
	a, b := object.Make(1, 0), object.Make(1, 1)
	d1, d2 := bytes.Repeat([]byte{1}, 8192), bytes.Repeat([]byte{2}, 4096)
	for _, id := range []object.ID{a, b} {
		if _, err := s.WriteAt(id, tok1, d1, 0, false); err != nil {
			t.Fatal(err)
		}
	}
	fs.Add(&errorfs.Rule{Kinds: []errorfs.Kind{errorfs.Sync}, Path: objFile(dir, a), Times: 1, Lose: true})
	if _, err := s.WriteAt(a, tok1, d2, 0, true); !errors.Is(err, unix.EIO) {
		t.Fatalf("sync write whose fdatasync failed: %v, want EIO", err)
	}
	wantSuspect(t, s, a)
	if _, err := s.WriteAt(a, tok1, d2, 0, true); !errors.Is(err, ErrSuspect) {
		t.Fatalf("write to a suspect copy: %v", err)
	}
	// The buffered write to a was acknowledged and may be lost: no Flush
	// of the VDI may succeed, not the first, not a retry.
	for i := range 3 {
		if err := s.Flush(1); err == nil {
			t.Fatalf("Flush %d after a failed fdatasync of an object with buffered writes succeeded", i)
		}
	}
	if err := s.Flush(0); err == nil {
		t.Fatal("Flush(0) succeeded")
	}
	wantContent(t, s, b, d1) // b's copy is fine
	// Recovery replaces the copy; the VDI flushes again.
	if err := s.Put(a, Version(1, 9), d2); err != nil {
		t.Fatal(err)
	}
	if err := s.Flush(1); err != nil {
		t.Fatalf("Flush after the copy was replaced: %v", err)
	}
	wantContent(t, s, a, d2)
}

// A Flush whose fdatasync of one object fails returns an error, and so
// does every retry, although the retried fdatasync succeeds; the copy is
// suspect now and after a crash.
func TestFaultFlushFdatasync(t *testing.T) {
	s, fs, dir := faultStore(t)
	a, b := object.Make(1, 0), object.Make(1, 1)
	d := bytes.Repeat([]byte{7}, 5000)
	for _, id := range []object.ID{a, b} {
		if _, err := s.WriteAt(id, tok1, d, 0, false); err != nil {
			t.Fatal(err)
		}
	}
	fs.Add(&errorfs.Rule{Kinds: []errorfs.Kind{errorfs.Sync}, Path: objFile(dir, a), Times: 1, Lose: true})
	if err := s.Flush(1); !errors.Is(err, unix.EIO) {
		t.Fatalf("Flush whose fdatasync failed: %v, want EIO", err)
	}
	if len(fs.Events()) != 1 {
		t.Fatalf("events %v", fs.Events())
	}
	wantSuspect(t, s, a)
	for i := range 3 {
		if err := s.Flush(1); err == nil {
			t.Fatalf("retry %d of the Flush succeeded though a's writes were lost", i)
		}
	}
	wantContent(t, s, b, d)
	s = crashReopen(t, s, fs, dir)
	wantSuspect(t, s, a)
	wantContent(t, s, b, d) // flushed by the first Flush
	s.Close()
}

// ClearSuspect of a copy whose fdatasync failed writes it anew (Put's
// way) instead of syncing pages the disk may no longer match: the copy
// it declares good is durable as it was read.
func TestFaultClearSuspectAfterFailedSync(t *testing.T) {
	s, fs, dir := faultStore(t)
	a := object.Make(1, 0)
	d := bytes.Repeat([]byte{7}, 5000)
	if _, err := s.WriteAt(a, tok1, d, 0, false); err != nil {
		t.Fatal(err)
	}
	fs.Add(&errorfs.Rule{Kinds: []errorfs.Kind{errorfs.Sync}, Path: objFile(dir, a), Times: 1})
	if err := s.Flush(1); err == nil {
		t.Fatal("Flush succeeded")
	}
	if err := s.ClearSuspect(a); err != nil {
		t.Fatalf("ClearSuspect of a copy whose fdatasync failed: %v", err)
	}
	if err := s.Flush(1); err != nil {
		t.Fatalf("Flush after ClearSuspect: %v", err)
	}
	wantContent(t, s, a, d)
	s = crashReopen(t, s, fs, dir)
	defer s.Close()
	wantContent(t, s, a, d)
}

// Two fdatasyncs of one file overlap; the first fails, the second
// "succeeds" because the kernel reported the error to the first (one
// report per error on a shared fd). The second writer must not be
// acknowledged either.
func TestFaultOverlappingFdatasyncs(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "s")
	rfs := &raceFS{FS: vfs.Default, path: objPathIn(dir, object.Make(1, 0)), entered: make(chan struct{}), second: make(chan struct{})}
	s := openT(t, dir, Options{FS: rfs})
	defer s.Close()
	a := object.Make(1, 0)
	if _, err := s.WriteAt(a, tok1, []byte("buffered"), 0, false); err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	var err1, err2 error
	wg.Go(func() { _, err1 = s.WriteAt(a, tok1, []byte("one"), 0, true) })
	<-rfs.entered
	wg.Go(func() { _, err2 = s.WriteAt(a, tok1, []byte("two"), 4096, true) })
	wg.Wait()
	if err1 == nil || err2 == nil {
		t.Fatalf("overlapping sync writes, the first fdatasync failed: %v and %v; want two errors", err1, err2)
	}
	wantSuspect(t, s, a)
}

// raceFS fails the first fdatasync of path with EIO once a second one
// has returned (or after a second).
type raceFS struct {
	vfs.FS
	path    string
	mu      sync.Mutex
	n       int
	entered chan struct{}
	second  chan struct{}
}

func (r *raceFS) Fdatasync(fd int) error {
	st, _ := r.FS.Fstat(fd)
	pst, _ := r.FS.Stat(r.path)
	if st.Ino != pst.Ino {
		return r.FS.Fdatasync(fd)
	}
	r.mu.Lock()
	r.n++
	n := r.n
	r.mu.Unlock()
	switch n {
	case 1:
		close(r.entered)
		select {
		case <-r.second:
			time.Sleep(20 * time.Millisecond) // let the second writer return, if it would
		case <-time.After(time.Second):
		}
		return unix.EIO
	case 2:
		err := r.FS.Fdatasync(fd)
		close(r.second)
		return err
	}
	return r.FS.Fdatasync(fd)
}

// A failed fdatasync of the journal is sticky: no call that needs the
// journal succeeds after it, and nothing is acknowledged that relies on
// a record it may have lost.
func TestFaultJournalFdatasync(t *testing.T) {
	s, fs, dir := faultStore(t)
	a, b, c := object.Make(1, 0), object.Make(1, 1), object.Make(1, 2)
	d := bytes.Repeat([]byte{3}, 4096)
	if _, err := s.WriteAt(a, tok1, d, 0, true); err != nil {
		t.Fatal(err)
	}
	fs.Add(&errorfs.Rule{Kinds: []errorfs.Kind{errorfs.Sync}, Path: errorfs.Contains("/journal"), Times: 1, Lose: true})
	if _, err := s.WriteAt(b, tok1, d, 0, true); !errors.Is(err, unix.EIO) {
		t.Fatalf("first write to an object whose dirty record was lost: %v", err)
	}
	// The failure was once; the journal's fdatasyncs would succeed again.
	if _, err := s.WriteAt(c, tok1, d, 0, false); err == nil {
		t.Fatal("write needing a dirty record acknowledged after the journal failed")
	}
	if err := s.Flush(1); err == nil {
		t.Fatal("Flush acknowledged after the journal failed")
	}
	if err := s.Fence(1, 2); err == nil {
		t.Fatal("Fence acknowledged after the journal failed")
	}
	if _, err := s.WriteAt(a, tok1, d, 0, true); err == nil {
		t.Fatal("sync write acknowledged after the journal failed")
	}
	if err := s.Put(b, Version(1, 5), d); err == nil {
		t.Fatal("Put acknowledged after the journal failed")
	}
	if err := s.Err(); !errors.Is(err, unix.EIO) {
		t.Fatalf("Err after the journal failed: %v", err)
	}
	wantContent(t, s, a, d) // reads of good copies go on
	s = crashReopen(t, s, fs, dir)
	defer s.Close()
	for _, id := range []object.ID{b, c} {
		if info, err := s.Stat(id); err == nil && !info.Suspect {
			t.Errorf("object %s, whose write failed, is served: %+v", id, info)
		}
	}
	if got := s.Token(1); got != 1 {
		t.Errorf("token %d after a failed Fence; want 1", got)
	}
	checkOldOrSuspect(t, s, a, d) // never flushed: suspect, by its dirty record
}

// ENOSPC from a pwrite: the write is refused with ErrNoSpace, and the
// copy is either its old self or suspect, never a mix served as good.
func TestFaultNoSpaceWrite(t *testing.T) {
	for _, tear := range []bool{false, true} {
		s, fs, dir := faultStore(t)
		a, b := object.Make(1, 0), object.Make(1, 1)
		old := bytes.Repeat([]byte{5}, 3*4096)
		for _, id := range []object.ID{a, b} {
			if _, err := s.WriteAt(id, tok1, old, 0, true); err != nil {
				t.Fatal(err)
			}
		}
		fs.Add(&errorfs.Rule{Kinds: []errorfs.Kind{errorfs.Write}, Path: objFile(dir, a), Times: 1, Err: unix.ENOSPC, Tear: tear})
		_, err := s.WriteAt(a, tok1, bytes.Repeat([]byte{6}, 2*4096), 2048, false)
		if !errors.Is(err, ErrNoSpace) || !errors.Is(err, unix.ENOSPC) {
			t.Fatalf("tear %v: write on a full disk: %v, want ErrNoSpace", tear, err)
		}
		checkOldOrSuspect(t, s, a, old)
		if err := s.Flush(1); err != nil {
			t.Fatalf("tear %v: Flush after ENOSPC (no fdatasync failed): %v", tear, err)
		}
		wantContent(t, s, b, old)
		s = crashReopen(t, s, fs, dir)
		checkOldOrSuspect(t, s, a, old)
		wantContent(t, s, b, old)
		s.Close()
	}
}

// ENOSPC from the journal's append refuses the write that needed the
// record; it is not sticky, and the store goes on once space is back.
func TestFaultNoSpaceJournal(t *testing.T) {
	s, fs, _ := faultStore(t)
	defer s.Close()
	a := object.Make(1, 0)
	fs.Add(&errorfs.Rule{Kinds: []errorfs.Kind{errorfs.Write}, Path: errorfs.Contains("/journal"), Times: 1, Err: unix.ENOSPC})
	if _, err := s.WriteAt(a, tok1, []byte("x"), 0, true); !errors.Is(err, ErrNoSpace) {
		t.Fatalf("write whose dirty record found no space: %v", err)
	}
	if _, err := s.Stat(a); !errors.Is(err, ErrNotFound) {
		t.Fatalf("object of a refused first write: %v", err)
	}
	if _, err := s.WriteAt(a, tok1, []byte("y"), 0, true); err != nil {
		t.Fatalf("write once space is back: %v", err)
	}
	wantContent(t, s, a, []byte("y"))
}

func checkOldOrSuspect(t *testing.T, s *Store, id object.ID, old []byte) {
	t.Helper()
	p := make([]byte, len(old))
	_, err := s.ReadAt(id, p, 0)
	if errors.Is(err, ErrSuspect) {
		return
	}
	if err != nil || !bytes.Equal(p, old) {
		t.Fatalf("object %s after a failed write: %v, old content %v; want the old content or ErrSuspect", id, err, bytes.Equal(p, old))
	}
}

// A pwrite torn by a crash (part of it on the file, then the process
// dies): after the reopen the copy is suspect, not served with its torn
// bytes, whether the write was sync or buffered, to a flushed object
// or a new one.
func TestFaultTornWriteCrash(t *testing.T) {
	for _, c := range []struct {
		name          string
		sync, flushed bool
	}{{"sync", true, true}, {"buffered", false, true}, {"new", true, false}} {
		t.Run(c.name, func(t *testing.T) {
			s, fs, dir := faultStore(t)
			a := object.Make(1, 0)
			old := bytes.Repeat([]byte{1}, 16384)
			if c.flushed {
				if _, err := s.WriteAt(a, tok1, old, 0, false); err != nil {
					t.Fatal(err)
				}
				if err := s.Flush(1); err != nil {
					t.Fatal(err)
				}
			}
			after := 0
			if !c.flushed {
				after = 1 // the new file's header is its first write; tear the data's
			}
			fs.Add(&errorfs.Rule{Kinds: []errorfs.Kind{errorfs.Write}, Path: objFile(dir, a), After: after, Times: 1, Tear: true, Crash: true})
			if _, err := s.WriteAt(a, tok1, bytes.Repeat([]byte{2}, 16384), 0, c.sync); err == nil {
				t.Fatal("torn write acknowledged")
			}
			if ev := fs.Events(); len(ev) != 1 || ev[0].Torn == 0 {
				t.Fatalf("events %v, want one torn write", ev)
			}
			s = crashReopen(t, s, fs, dir)
			defer s.Close()
			wantSuspect(t, s, a)
		})
	}
}

// A write that recreates a tombstone, whose dirty record found no space
// in the journal, leaves the object unjournaled: the next write journals
// it again, so that a crash makes its unflushed bytes suspect.
func TestFaultNoSpaceJournalRecreate(t *testing.T) {
	s, fs, dir := faultStore(t)
	a := object.Make(1, 0)
	if err := s.Remove(a, tok1); err != nil {
		t.Fatal(err)
	}
	fs.Add(&errorfs.Rule{Kinds: []errorfs.Kind{errorfs.Write}, Path: errorfs.Contains("/journal"), Times: 1, Err: unix.ENOSPC})
	if _, err := s.WriteAt(a, tok1, []byte("x"), 0, false); !errors.Is(err, ErrNoSpace) {
		t.Fatalf("write whose dirty record found no space: %v", err)
	}
	if _, err := s.WriteAt(a, tok1, []byte("y"), 0, false); err != nil {
		t.Fatal(err)
	}
	s = crashReopen(t, s, fs, dir)
	defer s.Close()
	if info, err := s.Stat(a); err != nil || !info.Suspect {
		t.Fatalf("object with an unflushed write after a crash: %+v, %v; want suspect", info, err)
	}
}
