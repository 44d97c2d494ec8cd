package qcow2

import (
	"context"
	"encoding/binary"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ovis-storage/ovis/block"
)

// stallFile is a host file whose reads at one offset (or of one file)
// wait until release is closed, so that a request stays in service as
// long as a test needs; entered is closed by the first stalled read.
type stallFile struct {
	block.File
	match   func(off int64) bool
	entered chan struct{}
	once    *sync.Once
	release chan struct{}
}

func (f *stallFile) ReadAt(p []byte, off int64) (int, error) {
	if f.match(off) {
		f.once.Do(func() { close(f.entered) })
		<-f.release
	}
	return f.File.ReadAt(p, off)
}

// stallOpener opens files normally, except that the file whose name ends
// with suffix stalls its reads where match says.
func stallOpener(suffix string, match func(off int64) bool) (func(string, bool) (block.File, error), chan struct{}, chan struct{}) {
	entered, release := make(chan struct{}), make(chan struct{})
	once := &sync.Once{}
	return func(name string, ro bool) (block.File, error) {
		f, err := block.OpenFile(name, ro)
		if err != nil || !strings.HasSuffix(name, suffix) {
			return f, err
		}
		return &stallFile{File: f, match: match, entered: entered, once: once, release: release}, nil
	}, entered, release
}

// cancelledWithin runs fn under a context cancelled after 20 ms and
// fails unless fn returns an error wrapping context.Canceled within a
// second: what a request waiting for another does when its caller gives
// up.
func cancelledWithin(t *testing.T, what string, fn func(ctx context.Context) error) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- fn(ctx) }()
	time.Sleep(20 * time.Millisecond)
	select {
	case err := <-done:
		t.Fatalf("%s returned before it was cancelled: %v", what, err)
	default:
	}
	cancel()
	select {
	case err := <-done:
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("%s after cancel: %v, want context.Canceled", what, err)
		}
	case <-time.After(time.Second):
		t.Fatalf("%s still waits a second after its context was cancelled", what)
	}
}

// TestCancelWhileWaiting: a write waiting for another writer's claim on
// its cluster, an exclusive operation waiting for the I/O in flight to
// drain, and a read waiting for another request's table load all give up
// when their contexts are cancelled, and the image works on afterwards.
func TestCancelWhileWaiting(t *testing.T) {
	dir := t.TempDir()
	base := filepath.Join(dir, "base.raw")
	if err := os.WriteFile(base, make([]byte, 4<<20), 0o644); err != nil {
		t.Fatal(err)
	}
	top := filepath.Join(dir, "top.qcow2")
	if err := Create(top, CreateOptions{BackingFile: base, BackingFormat: "raw"}); err != nil {
		t.Fatal(err)
	}

	t.Run("claim and drain", func(t *testing.T) {
		// Every read of the backing file stalls: the first allocating
		// write into cluster 0 copies the rest of the cluster from it.
		open, entered, release := stallOpener("base.raw", func(int64) bool { return true })
		img, err := Open(top, Options{OpenFile: open})
		if err != nil {
			t.Fatal(err)
		}
		first := make(chan error, 1)
		go func() {
			_, err := img.WriteAt(ctx, make([]byte, 4096), 0, 0)
			first <- err
		}()
		<-entered
		cancelledWithin(t, "write into a claimed cluster", func(ctx context.Context) error {
			_, err := img.WriteAt(ctx, []byte{1}, 8192, 0)
			return err
		})
		cancelledWithin(t, "resize behind a write in flight", func(ctx context.Context) error {
			return img.Resize(ctx, 8<<20, false, "off")
		})
		close(release)
		if err := <-first; err != nil {
			t.Fatalf("the write that held the claim: %v", err)
		}
		if err := img.Resize(ctx, 8<<20, false, "off"); err != nil {
			t.Fatalf("resize once the write is done: %v", err)
		}
		if err := img.Close(); err != nil {
			t.Fatal(err)
		}
	})

	t.Run("table load", func(t *testing.T) {
		// The L2 table of cluster 0 exists now; a read of it stalls.
		l2 := l2TableOffset(t, top)
		open, entered, release := stallOpener("top.qcow2", func(off int64) bool { return off == l2 })
		img, err := Open(top, Options{OpenFile: open, ReadOnly: true})
		if err != nil {
			t.Fatal(err)
		}
		first := make(chan error, 1)
		go func() {
			_, err := img.ReadAt(ctx, make([]byte, 512), 0)
			first <- err
		}()
		<-entered
		cancelledWithin(t, "read behind a table load", func(ctx context.Context) error {
			_, err := img.ReadAt(ctx, make([]byte, 512), 4096)
			return err
		})
		close(release)
		if err := <-first; err != nil {
			t.Fatalf("the read that loaded the table: %v", err)
		}
		if _, err := img.ReadAt(ctx, make([]byte, 512), 4096); err != nil {
			t.Fatalf("read once the table is loaded: %v", err)
		}
		if err := img.Close(); err != nil {
			t.Fatal(err)
		}
	})
}

// l2TableOffset reads the host offset of the first L2 table of the image
// at path from its L1 table.
func l2TableOffset(t *testing.T, path string) int64 {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var hdr [48]byte
	if _, err := f.ReadAt(hdr[:], 0); err != nil {
		t.Fatal(err)
	}
	var e [8]byte
	if _, err := f.ReadAt(e[:], int64(binary.BigEndian.Uint64(hdr[40:]))); err != nil {
		t.Fatal(err)
	}
	off := int64(binary.BigEndian.Uint64(e[:]) & l1OffsetMask)
	if off == 0 {
		t.Fatal("cluster 0 has no L2 table")
	}
	return off
}
