package qcow2

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/ovis-storage/ovis/block"
	"github.com/ovis-storage/ovis/internal/testutil"
)

// emptyWholeCases are images MakeEmpty rebuilds afresh: created and
// written by QEMU's tools, some grown so that their L1 table moved, some
// larger than one refcount block covers, so that the temporary tables
// need blocks of their own.
var emptyWholeCases = []struct {
	name, opts string
	size       string
	io         []string // qemu-io commands on the top
	grow       string   // qemu-img resize after the writes, "" for none
}{
	{"64k", "", "64M", []string{"write -P 7 0 3M", "write -P 8 40M 1M"}, ""},
	{"4k rc1", "cluster_size=4096,refcount_bits=1", "32M", []string{"write -P 7 0 1M", "write -c -P 9 8M 64k"}, ""},
	{"512 past one block", "cluster_size=512", "16M", []string{"write -P 7 0 2M", "write -P 8 15M 512k"}, ""},
	{"512 grown L1 moved", "cluster_size=512", "1M", []string{"write -P 7 0 256k"}, "40M"},
	{"lazy rc64", "lazy_refcounts=on,refcount_bits=64", "64M", []string{"write -P 7 1M 1M"}, ""},
	{"extended L2", "extended_l2=on", "64M", []string{"write -P 7 4k 8k", "write -z 2M 1M"}, ""},
	{"2M clusters", "cluster_size=2M", "1G", []string{"write -P 7 0 4M"}, "3G"},
}

// TestMakeEmptyWholeMatchesQemu empties twin tops, one with qemu-img
// commit (QEMU's make_completely_empty), one with MakeEmpty; the files
// must be byte for byte the same, and the one MakeEmpty left must check
// clean and read as its backing file.
func TestMakeEmptyWholeMatchesQemu(t *testing.T) {
	for _, tt := range emptyWholeCases {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			dirs := [2]string{t.TempDir(), t.TempDir()}
			q, o := dirs[0], dirs[1]
			testutil.QemuImg(t, "create", "-q", "-f", "qcow2", filepath.Join(q, "base.qcow2"), tt.size)
			testutil.QemuIO(t, filepath.Join(q, "base.qcow2"), "qcow2", "write -P 3 0 512k")
			top := filepath.Join(q, "top.qcow2")
			args := []string{"create", "-q", "-f", "qcow2", "-b", "base.qcow2", "-F", "qcow2"}
			if tt.opts != "" {
				args = append(args, "-o", tt.opts)
			}
			testutil.QemuImg(t, append(args, top, tt.size)...)
			testutil.QemuIO(t, top, "qcow2", tt.io...)
			if tt.grow != "" {
				testutil.QemuImg(t, "resize", "-q", top, tt.grow)
			}
			for _, n := range []string{"base.qcow2", "top.qcow2"} {
				b, err := os.ReadFile(filepath.Join(q, n))
				if err != nil {
					t.Fatal(err)
				}
				if err := os.WriteFile(filepath.Join(o, n), b, 0o644); err != nil {
					t.Fatal(err)
				}
			}
			testutil.QemuImg(t, "commit", "-q", top)

			otop := filepath.Join(o, "top.qcow2")
			img, err := Open(otop, Options{})
			if err != nil {
				t.Fatal(err)
			}
			if err := img.MakeEmpty(context.Background()); err != nil {
				t.Fatal(err)
			}
			// The open image goes on working on its new tables.
			h := img.Header()
			if h.L1TableOffset != uint64(3*img.ClusterSize()) || h.RefcountTableOffset != uint64(img.ClusterSize()) {
				t.Errorf("not rebuilt afresh: L1 at %#x, refcount table at %#x", h.L1TableOffset, h.RefcountTableOffset)
			}
			if err := img.Close(); err != nil {
				t.Fatal(err)
			}
			want, err := os.ReadFile(top)
			if err != nil {
				t.Fatal(err)
			}
			got, err := os.ReadFile(otop)
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, want) {
				i := 0
				for i < min(len(got), len(want)) && got[i] == want[i] {
					i++
				}
				t.Errorf("emptied top differs from qemu-img commit's: %d bytes against %d, first difference at %#x", len(got), len(want), i)
			}
			testutil.CheckImage(t, otop)
			if out, code := testutil.QemuImgExit(t, "compare", otop, filepath.Join(o, "base.qcow2")); code != 0 {
				t.Errorf("emptied top does not read as its backing file: exit %d\n%s", code, out)
			}
		})
	}
}

// TestMakeEmptyWholeKeepsWorking writes to an image after MakeEmpty
// rebuilt it, without reopening: the new tables are the ones in use.
func TestMakeEmptyWholeKeepsWorking(t *testing.T) {
	path := filepath.Join(t.TempDir(), "a.qcow2")
	if err := Create(path, CreateOptions{Size: 64 << 20, ClusterSize: 4096}); err != nil {
		t.Fatal(err)
	}
	img, err := Open(path, Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer img.Close()
	ctx := context.Background()
	old := bytes.Repeat([]byte{0x5a}, 3<<20)
	if _, err := img.WriteAt(ctx, old, 1<<20, 0); err != nil {
		t.Fatal(err)
	}
	if err := img.MakeEmpty(ctx); err != nil {
		t.Fatal(err)
	}
	fresh := bytes.Repeat([]byte{0xa5}, 1<<20)
	if _, err := img.WriteAt(ctx, fresh, 2<<20, 0); err != nil {
		t.Fatal(err)
	}
	if err := img.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	raw := filepath.Join(t.TempDir(), "want.raw")
	want := make([]byte, 64<<20)
	copy(want[2<<20:], fresh)
	if err := os.WriteFile(raw, want, 0o644); err != nil {
		t.Fatal(err)
	}
	if !testutil.CompareDeviceWithRaw(t, block.ReaderAt(ctx, img), img.Size(), raw) {
		t.Error("the open image does not read as written after MakeEmpty")
	}
	if err := img.Close(); err != nil {
		t.Fatal(err)
	}
	testutil.CheckImage(t, path)
	if out, code := testutil.QemuImgExit(t, "compare", "-f", "qcow2", "-F", "raw", path, raw); code != 0 {
		t.Errorf("qemu-img compare after writing into the emptied image: exit %d\n%s", code, out)
	}
}

// emptyRec records the writes, syncs and truncations made to a file.
type emptyRec struct {
	mu  sync.Mutex
	cur []byte
	ops []emptyOp
}

type emptyOp struct {
	kind byte // 'w'rite, 's'ync, 't'runcate
	off  int64
	data []byte
}

func (r *emptyRec) ReadAt(p []byte, off int64) (int, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	clear(p)
	if off < int64(len(r.cur)) {
		copy(p, r.cur[off:])
	}
	return len(p), nil
}

func (r *emptyRec) WriteAt(p []byte, off int64) (int, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.cur = emptyApply(r.cur, emptyOp{kind: 'w', off: off, data: p})
	r.ops = append(r.ops, emptyOp{kind: 'w', off: off, data: append([]byte(nil), p...)})
	return len(p), nil
}

func (r *emptyRec) Sync() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.ops = append(r.ops, emptyOp{kind: 's'})
	return nil
}

func (r *emptyRec) Truncate(size int64) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.cur = emptyApply(r.cur, emptyOp{kind: 't', off: size})
	r.ops = append(r.ops, emptyOp{kind: 't', off: size})
	return nil
}

func (r *emptyRec) Size() (int64, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return int64(len(r.cur)), nil
}

func (r *emptyRec) Close() error { return nil }

func emptyApply(b []byte, o emptyOp) []byte {
	switch o.kind {
	case 'w':
		if end := o.off + int64(len(o.data)); end > int64(len(b)) {
			b = append(b, make([]byte, end-int64(len(b)))...)
		}
		copy(b[o.off:], o.data)
	case 't':
		if o.off < int64(len(b)) {
			return b[:o.off]
		}
		b = append(b, make([]byte, o.off-int64(len(b)))...)
	}
	return b
}

// TestMakeEmptyWholeCrash cuts MakeEmpty short at every point a power
// loss could: after each sync, with every subset of the writes and
// truncations made up to the next, applied in either order. Every state
// must open, check clean (not even a leak, in ovis's check and in
// qemu-img's) and read either as before or as empty.
func TestMakeEmptyWholeCrash(t *testing.T) {
	for _, tt := range []struct {
		name string
		co   CreateOptions
		data int64 // bytes written before emptying
	}{
		{"64k", CreateOptions{Size: 64 << 20}, 4 << 20},
		{"512 past one block", CreateOptions{Size: 16 << 20, ClusterSize: 512}, 3 << 20},
		{"lazy", CreateOptions{Size: 16 << 20, ClusterSize: 4096, LazyRefcounts: true}, 2 << 20},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			dir := t.TempDir()
			path := filepath.Join(dir, "a.qcow2")
			if err := Create(path, tt.co); err != nil {
				t.Fatal(err)
			}
			b, err := os.ReadFile(path)
			if err != nil {
				t.Fatal(err)
			}
			rf := &emptyRec{cur: b}
			img, err := Open(path, Options{OpenFile: func(string, bool) (block.File, error) { return rf, nil }})
			if err != nil {
				t.Fatal(err)
			}
			defer img.Close()
			before := make([]byte, tt.co.Size)
			for i := int64(0); i < tt.data; i++ {
				before[i] = byte(i*7/512 + 1)
			}
			if _, err := img.WriteAt(ctx, before[:tt.data], 0, 0); err != nil {
				t.Fatal(err)
			}
			if err := img.Flush(ctx); err != nil {
				t.Fatal(err)
			}
			rf.mu.Lock()
			base := append([]byte(nil), rf.cur...)
			rf.ops = nil
			rf.mu.Unlock()
			if err := img.MakeEmpty(context.Background()); err != nil {
				t.Fatal(err)
			}
			ops := rf.ops
			if h := img.Header(); h.L1TableOffset != uint64(3*img.ClusterSize()) {
				t.Fatalf("not rebuilt afresh: L1 at %#x", h.L1TableOffset)
			}
			empty := make([]byte, tt.co.Size)
			var segs [][]emptyOp // the ops between syncs
			seg := []emptyOp{}
			for _, o := range ops {
				if o.kind == 's' {
					segs = append(segs, seg)
					seg = []emptyOp{}
				} else {
					seg = append(seg, o)
				}
			}
			segs = append(segs, seg)
			states, sawEmpty := 0, false
			state := base
			for k, seg := range segs {
				for mask := 0; mask < 1<<len(seg); mask++ {
					for _, reverse := range []bool{false, true} {
						s := append([]byte(nil), state...)
						for i := range seg {
							j := i
							if reverse {
								j = len(seg) - 1 - i
							}
							if mask&(1<<j) != 0 {
								s = emptyApply(s, seg[j])
							}
						}
						got := emptyCrashState(t, dir, s)
						switch {
						case bytes.Equal(got, empty):
							sawEmpty = true
						case !bytes.Equal(got, before):
							t.Errorf("after sync %d, ops %b (reversed %v): reads neither as before nor as empty", k, mask, reverse)
						}
						states++
					}
				}
				for _, o := range seg {
					state = emptyApply(state, o)
				}
			}
			if !sawEmpty {
				t.Error("no crash state read as empty")
			}
			t.Logf("%d ops in %d syncs: %d crash states checked", len(ops), len(segs)-1, states)
		})
	}
}

// emptyCrashState checks one crash state and returns what it reads.
func emptyCrashState(t *testing.T, dir string, state []byte) []byte {
	t.Helper()
	p := filepath.Join(dir, "crash.qcow2")
	if err := os.WriteFile(p, state, 0o644); err != nil {
		t.Fatal(err)
	}
	img, err := Open(p, Options{ReadOnly: true})
	if err != nil {
		t.Fatalf("open: %v", err)
	}
	defer img.Close()
	res, err := img.Check(ctx, RepairNone)
	if err != nil {
		t.Fatalf("check: %v", err)
	}
	if res.CheckErrors+res.Corruptions+res.Leaks != 0 {
		t.Errorf("ovis check: %d errors, %d corruptions, %d leaks: %s", res.CheckErrors, res.Corruptions, res.Leaks, strings.Join(res.Messages, "; "))
	}
	if out, code := testutil.QemuImgExit(t, "check", p); code != 0 {
		t.Errorf("qemu-img check: exit %d\n%s", code, out)
	}
	got := make([]byte, img.Size())
	if _, err := img.ReadAt(ctx, got, 0); err != nil {
		t.Fatalf("read: %v", err)
	}
	return got
}
