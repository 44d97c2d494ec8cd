package errorfs

import (
	"bytes"
	"errors"
	"path/filepath"
	"slices"
	"testing"

	"golang.org/x/sys/unix"
)

func open(t *testing.T, f *FS, path string) int {
	t.Helper()
	fd, err := f.Open(path, unix.O_RDWR|unix.O_CREAT|unix.O_CLOEXEC, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close(fd) })
	return fd
}

func read(t *testing.T, f *FS, fd int) []byte {
	t.Helper()
	st, err := f.Fstat(fd)
	if err != nil {
		t.Fatal(err)
	}
	b := make([]byte, st.Size)
	if _, err := f.Pread(fd, b, 0); err != nil {
		t.Fatal(err)
	}
	return b
}

func TestAfterTimesAndErr(t *testing.T) {
	f := New(nil, 1)
	fd := open(t, f, filepath.Join(t.TempDir(), "a"))
	f.Add(&Rule{Kinds: []Kind{Write}, After: 2, Times: 1, Err: unix.ENOSPC})
	for i := range 4 {
		_, err := f.Pwrite(fd, []byte("x"), int64(i))
		if fail := i == 2; fail != (err != nil) {
			t.Fatalf("write %d: %v", i, err)
		}
		if err != nil && (!errors.Is(err, unix.ENOSPC) || !errors.Is(err, ErrInjected)) {
			t.Fatalf("write %d: %v, want an injected ENOSPC", i, err)
		}
	}
	if got := read(t, f, fd); string(got) != "xx\x00x" {
		t.Fatalf("file holds %q", got)
	}
	if ev := f.Events(); len(ev) != 1 || ev[0].Op.Off != 2 {
		t.Fatalf("events %v", ev)
	}
}

func TestTearLoseCrash(t *testing.T) {
	dir := t.TempDir()
	f := New(nil, 7)
	fd := open(t, f, filepath.Join(dir, "a"))
	if _, err := f.Pwrite(fd, []byte("durable"), 0); err != nil {
		t.Fatal(err)
	}
	if err := f.Fdatasync(fd); err != nil {
		t.Fatal(err)
	}
	f.Add(&Rule{Kinds: []Kind{Write}, Path: Contains("/a"), Times: 1, Tear: true})
	p := bytes.Repeat([]byte("N"), 100)
	n, err := f.Pwrite(fd, p, 3)
	if !errors.Is(err, unix.EIO) || n <= 0 || n >= len(p) {
		t.Fatalf("torn write: %d, %v", n, err)
	}
	if got := read(t, f, fd); !bytes.Equal(got, append([]byte("dur"), p[:n]...)) {
		t.Fatalf("after a torn write the file holds %q", got)
	}
	// A failing sync that loses the writes puts back the synced bytes, and
	// the next sync "succeeds".
	f.Add(&Rule{Kinds: []Kind{Sync}, Times: 1, Lose: true})
	if err := f.Fdatasync(fd); !errors.Is(err, ErrInjected) {
		t.Fatalf("sync: %v", err)
	}
	if got := read(t, f, fd); string(got) != "durable" {
		t.Fatalf("after a lost sync the file holds %q", got)
	}
	if err := f.Fdatasync(fd); err != nil {
		t.Fatal(err)
	}
	f.Add(&Rule{Kinds: []Kind{Write}, Crash: true})
	if _, err := f.Pwrite(fd, []byte("x"), 0); !errors.Is(err, ErrInjected) {
		t.Fatalf("write: %v", err)
	}
	if _, err := f.Pread(fd, make([]byte, 1), 0); !errors.Is(err, ErrCrashed) || !f.Crashed() {
		t.Fatalf("read after the crash: %v", err)
	}
}

// The same seed draws the same faults.
func TestSeedReplays(t *testing.T) {
	run := func(seed uint64) []int64 {
		f := New(nil, seed)
		fd := open(t, f, filepath.Join(t.TempDir(), "a"))
		f.Add(&Rule{Kinds: []Kind{Write}, Prob: 0.3, Tear: true})
		var out []int64
		for i := range 50 {
			if n, err := f.Pwrite(fd, make([]byte, 64), int64(i)*64); err != nil {
				out = append(out, int64(i)<<8|int64(n))
			}
		}
		return out
	}
	a, b := run(42), run(42)
	if len(a) == 0 || len(a) == 50 || !slices.Equal(a, b) {
		t.Fatalf("seed 42 gave %v then %v", a, b)
	}
}
