package store

import (
	"bytes"
	"errors"
	"hash/crc32"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ovis-storage/ovis/cluster/object"
)

// Writers to disjoint ranges of the same objects, readers, flushes and
// a small fd cache, all at once; every range then holds its last write
// and the version counts every write.
func TestConcurrentDisjoint(t *testing.T) {
	s := openT(t, t.TempDir(), Options{MaxOpenFiles: 2})
	defer s.Close()
	const writers, rounds, chunk = 8, 40, 3000
	ids := []object.ID{object.Make(1, 0), object.Make(1, 1), object.Make(2, 0)}
	var wg sync.WaitGroup
	errc := make(chan error, writers+4)
	for w := range writers {
		wg.Go(func() {
			for r := range rounds {
				for _, id := range ids {
					p := bytes.Repeat([]byte{byte(w*rounds + r + 1)}, chunk)
					if _, err := s.WriteAt(id, Stamp{Token: 1}, p, int64(w*chunk), r%3 == 0); err != nil {
						errc <- err
						return
					}
				}
			}
		})
	}
	stop := make(chan struct{})
	var bg sync.WaitGroup
	for range 2 {
		bg.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
				}
				for _, id := range ids {
					if _, err := s.ReadAt(id, make([]byte, writers*chunk), 0); err != nil && !errors.Is(err, ErrNotFound) {
						errc <- err
						return
					}
					if _, err := s.Extents(id, 0, writers*chunk, nil); err != nil && !errors.Is(err, ErrNotFound) {
						errc <- err
						return
					}
				}
				if err := s.Flush(0); err != nil {
					errc <- err
					return
				}
			}
		})
	}
	wg.Wait()
	close(stop)
	bg.Wait()
	close(errc)
	for err := range errc {
		t.Fatal(err)
	}
	for _, id := range ids {
		p := make([]byte, writers*chunk)
		v, err := s.ReadAt(id, p, 0)
		if err != nil {
			t.Fatal(err)
		}
		if v != writers*rounds {
			t.Errorf("object %s version %d, want %d", id, v, writers*rounds)
		}
		for w := range writers {
			want := bytes.Repeat([]byte{byte(w*rounds + rounds)}, chunk)
			if !bytes.Equal(p[w*chunk:(w+1)*chunk], want) {
				t.Errorf("object %s range of writer %d lost its last write", id, w)
			}
		}
	}
}

// After Fence returns, writers with the old token change nothing.
func TestFenceDrains(t *testing.T) {
	s := openT(t, t.TempDir(), Options{})
	defer s.Close()
	id := object.Make(5, 0)
	var wg sync.WaitGroup
	started := make(chan struct{})
	var once sync.Once
	for w := range 4 {
		wg.Go(func() {
			for i := 0; ; i++ {
				_, err := s.WriteAt(id, Stamp{Token: 3}, bytes.Repeat([]byte{byte(w + i)}, 8192), int64(w)*8192, false)
				once.Do(func() { close(started) })
				if errors.Is(err, ErrStaleToken) {
					return
				}
				if err != nil {
					t.Error(err)
					return
				}
			}
		})
	}
	<-started
	if err := s.Fence(5, 4); err != nil {
		t.Fatal(err)
	}
	before := make([]byte, 4*8192)
	if _, err := s.ReadAt(id, before, 0); err != nil {
		t.Fatal(err)
	}
	wg.Wait()
	after := make([]byte, 4*8192)
	if _, err := s.ReadAt(id, after, 0); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(before, after) {
		t.Fatal("a write with a fenced token landed after Fence returned")
	}
	if err := s.Fence(5, 3); !errors.Is(err, ErrStaleToken) {
		t.Fatalf("Fence lower: %v", err)
	}
	for _, call := range []func() error{
		func() error { _, err := s.WriteAt(id, Stamp{Token: 3}, []byte{1}, 0, true); return err },
		func() error { _, err := s.WriteZeroes(id, Stamp{Token: 0}, 0, 1, true, false); return err },
		func() error { _, err := s.Discard(id, Stamp{Token: 2}, 0, 1, false); return err },
		func() error { return s.Remove(id, Stamp{Token: 1}) },
	} {
		if err := call(); !errors.Is(err, ErrStaleToken) {
			t.Errorf("stale call: %v", err)
		}
	}
	if _, err := s.ReadAt(id, after, 0); err != nil || !bytes.Equal(before, after) {
		t.Fatal("a refused call changed the object")
	}
	if s.Token(5) != 4 || s.Token(6) != 0 {
		t.Fatalf("tokens %d %d", s.Token(5), s.Token(6))
	}
}

// Fence waits for a call admitted with a lower token.
func TestFenceWaitsForAdmitted(t *testing.T) {
	s := openT(t, t.TempDir(), Options{})
	defer s.Close()
	id := object.Make(5, 0)
	admitted, release := make(chan struct{}), make(chan struct{})
	testHookAdmitted = func(object.ID) { close(admitted); <-release }
	defer func() { testHookAdmitted = nil }()
	var wg sync.WaitGroup
	wg.Go(func() {
		if _, err := s.WriteAt(id, Stamp{Token: 1}, []byte("old"), 0, false); err != nil {
			t.Error(err)
		}
	})
	<-admitted
	testHookAdmitted = nil
	fenced := make(chan error, 1)
	wg.Go(func() { fenced <- s.Fence(5, 2) })
	select {
	case err := <-fenced:
		close(release)
		t.Fatalf("Fence returned (%v) while a write with a lower token was in progress", err)
	case <-time.After(100 * time.Millisecond):
	}
	close(release)
	if err := <-fenced; err != nil {
		t.Fatal(err)
	}
	wg.Wait()
}

func TestChecksumIgnoresHoles(t *testing.T) {
	s := openT(t, t.TempDir(), Options{})
	defer s.Close()
	data := make([]byte, 3<<20)
	data[5] = 1
	data[2<<20+7] = 2 // past the first 1 MiB chunk, after a run of zeros
	a, b, c := object.Make(1, 1), object.Make(1, 2), object.Make(1, 3)
	if err := s.Put(a, 1, data); err != nil { // zeros left as holes
		t.Fatal(err)
	}
	if _, err := s.WriteAt(b, Stamp{Token: 0}, data, 0, false); err != nil { // zeros written
		t.Fatal(err)
	}
	if _, err := s.WriteAt(b, Stamp{Token: 0}, make([]byte, 1<<20), 4<<20, false); err != nil { // trailing zeros
		t.Fatal(err)
	}
	if _, err := s.WriteAt(c, Stamp{Token: 0}, data[:2<<20+8], 0, false); err != nil {
		t.Fatal(err)
	}
	ca, _, err := s.Checksum(a)
	if err != nil {
		t.Fatal(err)
	}
	if want := crc32.Checksum(data[:2<<20+8], castagnoli); ca != want {
		t.Fatalf("checksum %#x, want %#x", ca, want)
	}
	for _, id := range []object.ID{b, c} {
		if cx, _, err := s.Checksum(id); err != nil || cx != ca {
			t.Errorf("object %s checksum %#x, want %#x (%v)", id, cx, ca, err)
		}
	}
	if _, err := s.WriteAt(c, Stamp{Token: 0}, []byte{3}, 1<<20, false); err != nil {
		t.Fatal(err)
	}
	if cx, _, _ := s.Checksum(c); cx == ca {
		t.Error("checksum did not change with the content")
	}
	ua, _ := s.Stat(a)
	ub, _ := s.Stat(b)
	if ua.Allocated >= ub.Allocated {
		t.Errorf("Put kept zeros allocated: %d bytes, written copy %d", ua.Allocated, ub.Allocated)
	}
}

// Every call at once on a few objects: nothing but ErrNotFound from
// readers, no race, and a clean reopen with nothing suspect.
func TestConcurrentChaos(t *testing.T) {
	dir := t.TempDir()
	s := openT(t, dir, Options{MaxOpenFiles: 1})
	ids := []object.ID{object.Make(1, 0), object.Make(1, 1), object.Make(2, 0)}
	var wg sync.WaitGroup
	for g := range 6 {
		wg.Go(func() {
			for i := range 150 {
				id := ids[(g+i)%len(ids)]
				var err error
				switch (g*7 + i) % 15 {
				case 0, 1:
					_, err = s.WriteAt(id, Stamp{Token: 1}, bytes.Repeat([]byte{byte(i)}, 5000), int64(i*100), i%2 == 0)
				case 2:
					_, err = s.WriteZeroes(id, Stamp{Token: 1}, int64(i*10), 9000, i%2 == 0, i%3 == 0)
				case 3:
					err = s.Remove(id, Stamp{Token: 1})
				case 4:
					err = s.Put(id, uint64(i), bytes.Repeat([]byte{1}, i*50))
				case 5:
					_, err = s.ReadAt(id, make([]byte, 8000), 0)
				case 6:
					_, err = s.Extents(id, 0, 1<<20, nil)
				case 7:
					_, _, err = s.Checksum(id)
				case 8:
					_, err = s.Stat(id)
				case 9:
					_, err = s.List(0)
				case 10:
					err = s.Flush(id.VDI())
				case 11:
					err = s.PutTombstone(id, uint64(i))
				case 12:
					err = s.Forget(id, uint64(i))
				case 13:
					_, err = s.ReadSuspect(id, make([]byte, 100), 4000)
				case 14:
					err = s.Drop(id, uint64(i))
				}
				if err != nil && !errors.Is(err, ErrNotFound) && !errors.Is(err, ErrNotNewer) {
					t.Error(err)
					return
				}
			}
		})
	}
	wg.Wait()
	want, err := s.List(0)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	s = openT(t, dir, Options{})
	defer s.Close()
	got, err := s.List(0)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != len(want) {
		t.Fatalf("after reopen %d objects, before %d", len(got), len(want))
	}
	for i := range got {
		if got[i].ID != want[i].ID || got[i].Version != want[i].Version || got[i].Tombstone != want[i].Tombstone || got[i].Suspect {
			t.Errorf("after reopen %+v, before %+v", got[i], want[i])
		}
	}
}

// With a tiny object cache, idle objects are forgotten and loaded again
// from their headers, under every call at once.
func TestForgetIdleObjects(t *testing.T) {
	old := maxIdleObjects
	maxIdleObjects = 2
	defer func() { maxIdleObjects = old }()
	TestConcurrentChaos(t)
	s := openT(t, t.TempDir(), Options{})
	defer s.Close()
	for i := range 20 {
		if _, err := s.WriteAt(object.Make(1, uint32(i)), Stamp{Token: 1}, []byte{byte(i)}, 0, i%2 == 0); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.Flush(1); err != nil {
		t.Fatal(err)
	}
	for i := range 20 {
		s.Stat(object.Make(1, uint32(i))) // releases let idle objects go
	}
	s.mu.Lock()
	n := len(s.objs)
	s.mu.Unlock()
	if n > maxIdleObjects+1 {
		t.Fatalf("%d objects in memory, bound %d", n, maxIdleObjects)
	}
	for i := range 20 {
		p := make([]byte, 1)
		v, err := s.ReadAt(object.Make(1, uint32(i)), p, 0)
		if err != nil || v != 1 || p[0] != byte(i) {
			t.Fatalf("object %d after being forgotten: v%d %v %v", i, v, p, err)
		}
	}
}

// A read that overlaps a write in flight sees the write whole or not at
// all (issue 26's read model): one writer rewrites two 4 KiB blocks of
// an object with one byte each time, while readers read them, each block
// alone and both at once; every block read is a single byte repeated.
func TestReadsSeeWholeWrites(t *testing.T) {
	s := openT(t, t.TempDir(), Options{})
	defer s.Close()
	id := object.Make(1, 0)
	const block = 4096
	if _, err := s.WriteAt(id, Stamp{Token: 1}, make([]byte, 2*block), 0, false); err != nil {
		t.Fatal(err)
	}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		defer close(stop)
		p := make([]byte, 2*block)
		for i := range 5000 {
			for j := range p {
				p[j] = byte(i)
			}
			// Both blocks at once, or the second alone.
			off, q := int64(0), p
			if i%3 == 0 {
				off, q = block, p[:block]
			}
			if _, err := s.WriteAt(id, Stamp{Token: 1}, q, off, false); err != nil {
				t.Error(err)
				return
			}
		}
	})
	var torn atomic.Int64
	for r := range 2 {
		wg.Go(func() {
			p := make([]byte, 2*block)
			for n := 0; ; n++ {
				select {
				case <-stop:
					return
				default:
				}
				off, q := int64(0), p
				if (n+r)%2 == 0 {
					off, q = block, p[:block]
				}
				if _, err := s.ReadAt(id, q, off); err != nil {
					t.Error(err)
					return
				}
				for b := 0; b < len(q); b += block {
					if c := bytes.Count(q[b:b+block], q[b:b+1]); c != block {
						if torn.Add(1) == 1 {
							t.Errorf("read %d+%d: block at %d torn: %d of %d bytes are %#x", off, len(q), off+int64(b), c, block, q[b])
						}
					}
				}
			}
		})
	}
	wg.Wait()
	if n := torn.Load(); n > 0 {
		t.Errorf("%d torn blocks", n)
	}
}
