package store

import (
	"bytes"
	"errors"
	"hash/crc32"
	"math"
	"slices"
	"testing"

	"pgregory.net/rapid"

	"github.com/ovis-storage/ovis/cluster/object"
)

const pageSize = 4096

// model is the store as the tests expect it: sparse bytes, versions,
// tombstones and tokens.
type model struct {
	objs   map[object.ID]*mobj // tombstones included
	tokens map[object.VDI]uint64
	epoch  uint64 // the highest epoch stamped so far

	checkUsage bool // compare Usage with the model after this step
}

type mobj struct {
	version uint64
	tomb    bool
	pages   map[int64][]byte // page index → 4 KiB
}

func newModel() *model {
	return &model{objs: map[object.ID]*mobj{}, tokens: map[object.VDI]uint64{}}
}

// modelNext is the version rule, stated apart from nextVersion: one
// more than the old version, at least the first of the epoch, and a
// count that saturates within its epoch.
func modelNext(old, epoch uint64) uint64 {
	if uint32(old) == math.MaxUint32 && old>>32 >= epoch {
		return old
	}
	return max(old+1, epoch<<32|1)
}

// live returns id's object, (re)created empty when missing or a
// tombstone; its version continues from the tombstone's.
func (m *model) live(id object.ID) *mobj {
	o := m.objs[id]
	if o == nil {
		o = &mobj{pages: map[int64][]byte{}}
		m.objs[id] = o
	}
	if o.tomb {
		o.tomb, o.pages = false, map[int64][]byte{}
	}
	return o
}

// mutate applies a write of p at off stamped with epoch.
func (m *model) mutate(id object.ID, epoch uint64, p []byte, off int64) {
	o := m.live(id)
	o.version = modelNext(o.version, epoch)
	m.write(id, p, off)
}

// write stores p at off in id's pages, leaving the version alone.
func (m *model) write(id object.ID, p []byte, off int64) {
	o := m.live(id)
	for i := range p {
		x := off + int64(i)
		pg := o.pages[x/pageSize]
		if pg == nil {
			if p[i] == 0 {
				continue
			}
			pg = make([]byte, pageSize)
			o.pages[x/pageSize] = pg
		}
		pg[x%pageSize] = p[i]
	}
}

func (o *mobj) read(p []byte, off int64) {
	for i := 0; i < len(p); { // a page at a time: the fault model reads 96 KiB per check
		x := off + int64(i)
		at := int(x % pageSize)
		n := min(len(p)-i, pageSize-at)
		if pg := o.pages[x/pageSize]; pg != nil {
			copy(p[i:i+n], pg[at:])
		} else {
			clear(p[i : i+n])
		}
		i += n
	}
}

// crc is the model's Checksum: CRC32C of the content, trailing zeros
// trimmed.
func (o *mobj) crc() uint32 {
	idx := make([]int64, 0, len(o.pages))
	for i := range o.pages {
		idx = append(idx, i)
	}
	slices.Sort(idx)
	var content []byte
	var zeros int64
	var crc uint32
	next := int64(0)
	for _, i := range idx {
		zeros += (i - next) * pageSize
		next = i + 1
		pg := o.pages[i]
		k := trimZeros(pg)
		if k == 0 {
			zeros += pageSize
			continue
		}
		crc = crc32.Update(crc, castagnoli, make([]byte, zeros))
		crc = crc32.Update(crc, castagnoli, pg[:k])
		zeros = int64(pageSize - k)
		_ = content
	}
	return crc
}

func genRange(t *rapid.T) (off, n int64) {
	n = int64(rapid.IntRange(0, 3*pageSize).Draw(t, "n"))
	if rapid.IntRange(0, 9).Draw(t, "end") == 0 {
		return MaxObjectSize - n - int64(rapid.IntRange(0, 100).Draw(t, "back")), n
	}
	return int64(rapid.IntRange(0, 16*pageSize).Draw(t, "off")), n
}

// genEpoch picks the current epoch, the next one, or (sometimes) an
// older one: a request admitted before the node learned of a change.
func genEpoch(t *rapid.T, m *model) uint64 {
	switch rapid.IntRange(0, 9).Draw(t, "epoch") {
	case 0:
		m.epoch++
	case 1:
		if m.epoch > 0 {
			return m.epoch - 1
		}
	}
	return m.epoch
}

// genVersion picks a version for Put around the current epoch, counts
// near saturation included.
func genVersion(t *rapid.T, m *model) uint64 {
	e := m.epoch + uint64(rapid.IntRange(0, 2).Draw(t, "vepoch"))
	if e > 0 {
		e-- // the epoch before, this one, or the next
	}
	n := rapid.SampledFrom([]uint32{0, 1, 2, 3, 7, math.MaxUint32 - 1, math.MaxUint32}).Draw(t, "vcount")
	return Version(e, n)
}

func genID(t *rapid.T) object.ID {
	return object.Make(object.VDI(rapid.IntRange(1, 2).Draw(t, "vdi")), uint32(rapid.IntRange(0, 2).Draw(t, "index")))
}

// genToken picks the current token, a higher one, or (sometimes) a stale
// one.
func genToken(t *rapid.T, m *model, v object.VDI) uint64 {
	cur := m.tokens[v]
	switch rapid.IntRange(0, 5).Draw(t, "tok") {
	case 0:
		return cur + 1
	case 1:
		if cur > 0 {
			return cur - 1
		}
	}
	return cur
}

// admit applies the token rule to the model; false means stale.
func (m *model) admit(v object.VDI, tok uint64) bool {
	if tok < m.tokens[v] {
		return false
	}
	m.tokens[v] = tok
	return true
}

func checkStale(t *rapid.T, ok bool, err error) bool {
	if !ok {
		if !errors.Is(err, ErrStaleToken) {
			t.Fatalf("stale token accepted: %v", err)
		}
		return false
	}
	if err != nil {
		t.Fatal(err)
	}
	return true
}

func TestModel(t *testing.T) {
	defer func(old int) { maxIdleObjects = old }(maxIdleObjects)
	rapid.Check(t, func(t *rapid.T) {
		maxIdleObjects = rapid.SampledFrom([]int{1, 4096}).Draw(t, "maxIdleObjects")
		dir, err := osMkdirTemp()
		if err != nil {
			t.Fatal(err)
		}
		defer osRemoveAll(dir)
		s, err := Open(dir, Options{MaxOpenFiles: 2})
		if err != nil {
			t.Fatal(err)
		}
		defer func() { s.Close() }()
		m := newModel()
		t.Repeat(map[string]func(*rapid.T){
			"write": func(t *rapid.T) {
				id := genID(t)
				off, n := genRange(t)
				p := rapid.SliceOfN(rapid.Byte(), int(n), int(n)).Draw(t, "p")
				tok := genToken(t, m, id.VDI())
				ep := genEpoch(t, m)
				v, err := s.WriteAt(id, Stamp{Token: tok, Epoch: ep}, p, off, rapid.Bool().Draw(t, "sync"))
				if checkStale(t, m.admit(id.VDI(), tok), err) {
					m.mutate(id, ep, p, off)
					if v != m.objs[id].version {
						t.Fatalf("version %d, want %d", v, m.objs[id].version)
					}
				}
			},
			"zeroes": func(t *rapid.T) {
				id := genID(t)
				off, n := genRange(t)
				tok := genToken(t, m, id.VDI())
				st := Stamp{Token: tok, Epoch: genEpoch(t, m)}
				var v uint64
				var err error
				if rapid.Bool().Draw(t, "discard") {
					v, err = s.Discard(id, st, off, n, false)
				} else {
					v, err = s.WriteZeroes(id, st, off, n, rapid.Bool().Draw(t, "allocate"), rapid.Bool().Draw(t, "sync"))
				}
				if checkStale(t, m.admit(id.VDI(), tok), err) {
					m.mutate(id, st.Epoch, make([]byte, n), off)
					if v != m.objs[id].version {
						t.Fatalf("version %d, want %d", v, m.objs[id].version)
					}
				}
			},
			"remove": func(t *rapid.T) {
				id := genID(t)
				tok := genToken(t, m, id.VDI())
				ep := genEpoch(t, m)
				if checkStale(t, m.admit(id.VDI(), tok), s.Remove(id, Stamp{Token: tok, Epoch: ep})) {
					o := m.live(id)
					o.version = modelNext(o.version, ep)
					o.tomb, o.pages = true, nil
				}
			},
			"puttomb": func(t *rapid.T) {
				id := genID(t)
				ver := genVersion(t, m)
				err := s.PutTombstone(id, ver)
				if o := m.objs[id]; o != nil && o.version >= ver {
					if !errors.Is(err, ErrNotNewer) {
						t.Fatalf("PutTombstone of %s at %#x over %#x: %v, want ErrNotNewer", id, ver, o.version, err)
					}
					return
				}
				if err != nil {
					t.Fatal(err)
				}
				m.objs[id] = &mobj{version: ver, tomb: true}
			},
			"drop": func(t *rapid.T) {
				id := genID(t)
				var ver uint64
				if o := m.objs[id]; o != nil {
					ver = o.version - uint64(rapid.IntRange(0, 1).Draw(t, "below"))
				}
				if err := s.Drop(id, ver); err != nil {
					t.Fatal(err)
				}
				if o := m.objs[id]; o != nil && o.version <= ver {
					delete(m.objs, id)
				}
			},
			"forget": func(t *rapid.T) {
				id := genID(t)
				var ver uint64
				if o := m.objs[id]; o != nil {
					ver = o.version - uint64(rapid.IntRange(0, 1).Draw(t, "below"))
				}
				if err := s.Forget(id, ver); err != nil {
					t.Fatal(err)
				}
				if o := m.objs[id]; o != nil && o.tomb && o.version <= ver {
					delete(m.objs, id)
				}
			},
			"fence": func(t *rapid.T) {
				v := object.VDI(rapid.IntRange(1, 2).Draw(t, "vdi"))
				tok := genToken(t, m, v)
				checkStale(t, m.admit(v, tok), s.Fence(v, tok))
			},
			"flush": func(t *rapid.T) {
				if err := s.Flush(object.VDI(rapid.IntRange(0, 2).Draw(t, "vdi"))); err != nil {
					t.Fatal(err)
				}
			},
			"put": func(t *rapid.T) {
				id := genID(t)
				n := rapid.IntRange(0, 5*pageSize).Draw(t, "n")
				p := make([]byte, n)
				for i := 0; i < n; i += rapid.IntRange(1, 3000).Draw(t, "gap") {
					p[i] = byte(rapid.IntRange(1, 255).Draw(t, "b"))
				}
				ver := genVersion(t, m)
				if rapid.Bool().Draw(t, "replace") {
					if err := s.Replace(id, ver, p); err != nil {
						t.Fatal(err)
					}
				} else {
					err := s.Put(id, ver, p)
					if o := m.objs[id]; o != nil && o.version >= ver {
						if !errors.Is(err, ErrNotNewer) {
							t.Fatalf("Put of %s at %#x over %#x: %v, want ErrNotNewer", id, ver, o.version, err)
						}
						return
					}
					if err != nil {
						t.Fatal(err)
					}
				}
				o := &mobj{pages: map[int64][]byte{}}
				m.objs[id] = o
				m.write(id, p, 0)
				o.version = ver
			},
			"read": func(t *rapid.T) {
				id := genID(t)
				off, n := genRange(t)
				p := bytes.Repeat([]byte{0xa5}, int(n)) // garbage the read must overwrite
				suspectOK := rapid.Bool().Draw(t, "suspectOK")
				var v uint64
				var err error
				if suspectOK {
					v, err = s.ReadSuspect(id, p, off)
				} else {
					v, err = s.ReadAt(id, p, off)
				}
				o := m.objs[id]
				if o == nil || o.tomb {
					if !errors.Is(err, ErrNotFound) {
						t.Fatalf("read of absent %s: %v", id, err)
					}
					if suspectOK && o != nil && v != o.version {
						t.Fatalf("ReadSuspect of tombstone %s: version %#x, want %#x", id, v, o.version)
					}
					return
				}
				if err != nil {
					t.Fatal(err)
				}
				want := make([]byte, n)
				o.read(want, off)
				if !bytes.Equal(p, want) || v != o.version {
					t.Fatalf("read %s at %d+%d: version %d want %d, bytes differ: %v", id, off, n, v, o.version, !bytes.Equal(p, want))
				}
			},
			"extents": func(t *rapid.T) {
				id := genID(t)
				off, n := genRange(t)
				ext, err := s.Extents(id, off, n, nil)
				o := m.objs[id]
				if o == nil || o.tomb {
					if !errors.Is(err, ErrNotFound) {
						t.Fatalf("extents of absent %s: %v", id, err)
					}
					return
				}
				if err != nil {
					t.Fatal(err)
				}
				pos := off
				for _, e := range ext {
					if e.Offset != pos || e.Length <= 0 {
						t.Fatalf("extents %+v do not tile %d+%d", ext, off, n)
					}
					if e.Hole {
						b := make([]byte, e.Length)
						o.read(b, e.Offset)
						if !allZero(b) {
							t.Fatalf("hole %+v holds data", e)
						}
					}
					pos += e.Length
				}
				if pos != off+n {
					t.Fatalf("extents %+v end at %d, want %d", ext, pos, off+n)
				}
			},
			"checksum": func(t *rapid.T) {
				id := genID(t)
				crc, v, err := s.Checksum(id)
				o := m.objs[id]
				if o == nil || o.tomb {
					if !errors.Is(err, ErrNotFound) {
						t.Fatalf("checksum of absent %s: %v", id, err)
					}
					return
				}
				if err != nil {
					t.Fatal(err)
				}
				if crc != o.crc() || v != o.version {
					t.Fatalf("checksum %s: %#x v%d, want %#x v%d", id, crc, v, o.crc(), o.version)
				}
			},
			"hostile": func(t *rapid.T) {
				id := genID(t)
				off := rapid.SampledFrom([]int64{-1, -1 << 62, MaxObjectSize, MaxObjectSize - 1, 1 << 62}).Draw(t, "off")
				n := rapid.SampledFrom([]int64{-1, 2, MaxObjectSize + 1, 1 << 62}).Draw(t, "n")
				if rapid.Bool().Draw(t, "vdi0") {
					id = object.Make(0, id.Index())
				}
				if checkRange(id, off, n) == nil {
					return
				}
				if _, err := s.WriteZeroes(id, Stamp{Token: m.tokens[id.VDI()]}, off, n, true, false); !errors.Is(err, ErrRange) {
					t.Fatalf("WriteZeroes %d+%d: %v, want ErrRange", off, n, err)
				}
				if id.VDI() != 0 {
					high := Stamp{Token: m.tokens[id.VDI()], Epoch: MaxEpoch + 1}
					if _, err := s.WriteAt(id, high, []byte{1}, 0, false); !errors.Is(err, ErrRange) {
						t.Fatalf("WriteAt at epoch %d: %v, want ErrRange", high.Epoch, err)
					}
					if err := s.Remove(id, high); !errors.Is(err, ErrRange) {
						t.Fatalf("Remove at epoch %d: %v, want ErrRange", high.Epoch, err)
					}
				}
				if id.VDI() == 0 {
					if err := s.Remove(id, Stamp{Token: 0}); !errors.Is(err, ErrRange) {
						t.Fatalf("Remove of vdi 0: %v", err)
					}
					if err := s.Put(id, 1, nil); !errors.Is(err, ErrRange) {
						t.Fatalf("Put of vdi 0: %v", err)
					}
					if err := s.Fence(0, 1); !errors.Is(err, ErrRange) {
						t.Fatalf("Fence of vdi 0: %v", err)
					}
				}
				if _, err := s.Extents(id, off, n, nil); !errors.Is(err, ErrRange) {
					t.Fatalf("Extents %d+%d: %v, want ErrRange", off, n, err)
				}
				if n >= 0 && n < 16 {
					if _, err := s.ReadAt(id, make([]byte, n), off); !errors.Is(err, ErrRange) {
						t.Fatalf("ReadAt %d+%d: %v, want ErrRange", off, n, err)
					}
				}
			},
			"usage": func(t *rapid.T) { m.checkUsage = true }, // checked with List below
			"reopen": func(t *rapid.T) {
				if err := s.Close(); err != nil {
					t.Fatal(err)
				}
				var err error
				if s, err = Open(dir, Options{MaxOpenFiles: 2}); err != nil {
					t.Fatal(err)
				}
			},
			"": func(t *rapid.T) {
				infos, err := s.List(0)
				if err != nil {
					t.Fatal(err)
				}
				if len(infos) != len(m.objs) {
					t.Fatalf("List has %d objects, model %d", len(infos), len(m.objs))
				}
				tombs := 0
				for _, in := range infos {
					o := m.objs[in.ID]
					if o == nil || in.Version != o.version || in.Suspect || in.Tombstone != o.tomb {
						t.Fatalf("List: %+v, model %+v", in, o)
					}
					if o.tomb {
						tombs++
					}
				}
				if m.checkUsage {
					m.checkUsage = false
					u, err := s.Usage()
					if err != nil {
						t.Fatal(err)
					}
					if u.Objects != len(m.objs)-tombs || u.Tombstones != tombs {
						t.Fatalf("Usage: %d objects, %d tombstones; model %d, %d", u.Objects, u.Tombstones, len(m.objs)-tombs, tombs)
					}
				}
				for v, tok := range m.tokens {
					if s.Token(v) != tok {
						t.Fatalf("token of %d: %d, want %d", v, s.Token(v), tok)
					}
				}
			},
		})
	})
}
