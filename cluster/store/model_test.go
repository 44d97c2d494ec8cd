package store

import (
	"bytes"
	"errors"
	"hash/crc32"
	"slices"
	"testing"

	"pgregory.net/rapid"

	"github.com/ovis-storage/ovis/cluster/object"
)

const pageSize = 4096

// model is the store as the tests expect it: sparse bytes, versions and
// tokens.
type model struct {
	objs   map[object.ID]*mobj
	tokens map[object.VDI]uint64
}

type mobj struct {
	version uint64
	pages   map[int64][]byte // page index → 4 KiB
}

func newModel() *model {
	return &model{objs: map[object.ID]*mobj{}, tokens: map[object.VDI]uint64{}}
}

func (m *model) write(id object.ID, p []byte, off int64) {
	o := m.objs[id]
	if o == nil {
		o = &mobj{pages: map[int64][]byte{}}
		m.objs[id] = o
	}
	o.version++
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
	for i := range p {
		x := off + int64(i)
		if pg := o.pages[x/pageSize]; pg != nil {
			p[i] = pg[x%pageSize]
		} else {
			p[i] = 0
		}
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
				v, err := s.WriteAt(id, Stamp{Token: tok}, p, off, rapid.Bool().Draw(t, "sync"))
				if checkStale(t, m.admit(id.VDI(), tok), err) {
					m.write(id, p, off)
					if v != m.objs[id].version {
						t.Fatalf("version %d, want %d", v, m.objs[id].version)
					}
				}
			},
			"zeroes": func(t *rapid.T) {
				id := genID(t)
				off, n := genRange(t)
				tok := genToken(t, m, id.VDI())
				var v uint64
				var err error
				if rapid.Bool().Draw(t, "discard") {
					v, err = s.Discard(id, Stamp{Token: tok}, off, n, false)
				} else {
					v, err = s.WriteZeroes(id, Stamp{Token: tok}, off, n, rapid.Bool().Draw(t, "allocate"), rapid.Bool().Draw(t, "sync"))
				}
				if checkStale(t, m.admit(id.VDI(), tok), err) {
					m.write(id, make([]byte, n), off)
					if v != m.objs[id].version {
						t.Fatalf("version %d, want %d", v, m.objs[id].version)
					}
				}
			},
			"remove": func(t *rapid.T) {
				id := genID(t)
				tok := genToken(t, m, id.VDI())
				if checkStale(t, m.admit(id.VDI(), tok), s.Remove(id, Stamp{Token: tok})) {
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
				ver := rapid.Uint64Range(1, 1000).Draw(t, "version")
				if err := s.Put(id, ver, p); err != nil {
					t.Fatal(err)
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
				v, err := s.ReadAt(id, p, off)
				o := m.objs[id]
				if o == nil {
					if !errors.Is(err, ErrNotFound) {
						t.Fatalf("read of absent %s: %v", id, err)
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
				if o == nil {
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
				if o == nil {
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
				for _, in := range infos {
					o := m.objs[in.ID]
					if o == nil || in.Version != o.version || in.Suspect {
						t.Fatalf("List: %+v, model %v", in, o)
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
