package img

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"math/rand"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ovis-storage/ovis/internal/testutil"
)

// check -r, snapshot and amend on damaged and hostile images (issue 14,
// cases 2, 3 and 8, and what the fuzz tests below found), each against a
// twin image handled by qemu-img: the verb runs in process (runVerb), on
// o.qcow2, and qemu-img on q.qcow2 beside it.

// pokeBE writes v big-endian, in n bytes, at off in the file at path.
func pokeBE(t testing.TB, path string, off int64, n int, v uint64) {
	t.Helper()
	var b [8]byte
	binary.BigEndian.PutUint64(b[:], v)
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.WriteAt(b[8-n:], off); err != nil {
		t.Fatal(err)
	}
}

// peekBE reads n big-endian bytes at off.
func peekBE(t testing.TB, path string, off int64, n int) uint64 {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var b [8]byte
	if _, err := f.ReadAt(b[8-n:], off); err != nil {
		t.Fatal(err)
	}
	return binary.BigEndian.Uint64(b[:])
}

// fixCounts is what qemu-img check --output=json counts on path; ok is
// false when qemu-img could not check it at all.
type fixCounts struct {
	Corruptions int `json:"corruptions"`
	Leaks       int `json:"leaks"`
	CheckErrors int `json:"check-errors"`
	ok          bool
}

func qemuCheckCounts(t testing.TB, path string) fixCounts {
	t.Helper()
	out, _, _ := testutil.RunIn(t, "", "qemu-img", "check", "-U", "--output=json", path)
	var c fixCounts
	if json.Unmarshal([]byte(out), &c) == nil && strings.Contains(out, "filename") {
		c.ok = true
	}
	return c
}

// readsPattern reports whether qemu-io reads pattern p at [off, off+n).
func readsPattern(t testing.TB, path string, p byte, off, n int64) bool {
	t.Helper()
	out, code := testutil.QemuIOExit(t, path, "qcow2", fmt.Sprintf("read -P %#x %d %d", p, off, n))
	return code == 0 && !strings.Contains(out, "failed")
}

// twins makes q.qcow2 and o.qcow2 in a new directory, each built by build.
func twins(t *testing.T, build func(path string)) (dir, q, o string) {
	t.Helper()
	dir = t.TempDir()
	q, o = filepath.Join(dir, "q.qcow2"), filepath.Join(dir, "o.qcow2")
	build(q)
	copyFile(t, q, o)
	return dir, q, o
}

func sameFile(t *testing.T, what, a, b string) {
	t.Helper()
	x, err := os.ReadFile(a)
	if err != nil {
		t.Fatal(err)
	}
	y, err := os.ReadFile(b)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(x, y) {
		t.Errorf("%s: ovis's image differs from qemu-img's (%d and %d bytes)", what, len(y), len(x))
	}
}

// TestReproCheckRefcountOverflow: check -r all on an image with a cluster
// referenced more often than the refcount width holds must not write the
// count modulo the width (case 2: refcount_bits=1 stored 2 as 0, and the
// next write overwrote the guest data). qemu-img counts up to the largest
// refcount and reports each further reference as an overflow.
func TestReproCheckRefcountOverflow(t *testing.T) {
	t.Parallel()
	for _, bits := range []int{1, 2, 4, 8} {
		t.Run(fmt.Sprintf("refcount_bits=%d", bits), func(t *testing.T) {
			dir, q, o := twins(t, func(p string) {
				testutil.QemuImg(t, "create", "-q", "-f", "qcow2", "-o", fmt.Sprintf("refcount_bits=%d", bits), p, "64M")
				testutil.QemuIO(t, p, "qcow2", "write -q -P 0x5a 0 64k")
				// L2 at 0x40000 maps guest cluster 0 to 0x50000; 2^bits
				// more entries map the same cluster.
				for i := 1; i <= 1<<bits; i++ {
					pokeBE(t, p, 0x40000+int64(i)*8, 8, 0x8000000000050000)
				}
			})
			testutil.SameOutput(t, "check -r all", qemuImg(t, dir, "check", "-r", "all", "q.qcow2"), ovisCheck(o, "all"))
			sameFile(t, "after check -r all", q, o)
			testutil.QemuIO(t, o, "qcow2", "write -q -P 0x77 1M 64k")
			if !readsPattern(t, o, 0x5a, 0, 64<<10) {
				t.Errorf("guest data at 0 lost after check -r all and a write")
			}
		})
	}
}

// TestReproCheckRefcountTableHostile: check -r all repairs a refcount
// table entry past the largest offset (it panicked) and a refcount table
// of 0 clusters (refused at open) as qemu-img does (case 8).
func TestReproCheckRefcountTableHostile(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		off  int64
		n    int
		v    uint64
	}{
		{"entry 0xffffffffffff0000", 0x10000, 8, 0xffffffffffff0000},
		{"entry 1 TiB past the end", 0x10000, 8, 1 << 40},
		{"table of 0 clusters", 56, 4, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir, q, o := twins(t, func(p string) {
				testutil.QemuImg(t, "create", "-q", "-f", "qcow2", p, "64M")
				testutil.QemuIO(t, p, "qcow2", "write -q -P 0x5a 0 64k")
				pokeBE(t, p, tc.off, tc.n, tc.v)
			})
			testutil.SameOutput(t, "check", qemuImg(t, dir, "check", "q.qcow2"), ovisCheck(o, ""))
			testutil.SameOutput(t, "check -r all", qemuImg(t, dir, "check", "-r", "all", "q.qcow2"), ovisCheck(o, "all"))
			if c := qemuCheckCounts(t, o); !c.ok || c.Corruptions != 0 || c.CheckErrors != 0 {
				t.Errorf("qemu-img check after ovis's repair: %+v", c)
			}
			if !readsPattern(t, o, 0x5a, 0, 64<<10) {
				t.Errorf("guest data lost by the repair")
			}
			if tc.v != 1<<40 { // qemu-img grows that file to 1 TiB too
				sameFile(t, "after check -r all", q, o)
			}
		})
	}
}

// TestReproSnapshotFailureLeavesImage: a snapshot create, apply or delete
// that fails fails as qemu-img's does, and leaves the image as it was or
// leaked at worst: never COPIED errors (case 3) and never a file grown by
// what a corrupt entry names (case 8, an L2 entry 1 TiB past the end).
func TestReproSnapshotFailureLeavesImage(t *testing.T) {
	t.Parallel()
	create := func(bits int) func(p string) {
		return func(p string) {
			testutil.QemuImg(t, "create", "-q", "-f", "qcow2", "-o", fmt.Sprintf("refcount_bits=%d", bits), p, "64M")
			testutil.QemuIO(t, p, "qcow2", "write -q -P 0x5a 0 128k")
		}
	}
	for _, tc := range []struct {
		name  string
		build func(p string)
		args  []string
	}{
		{"create, refcount_bits=1", create(1), []string{"-c", "s1"}},
		{"create, refcount_bits=2, third snapshot", func(p string) {
			create(2)(p)
			testutil.QemuImg(t, "snapshot", "-c", "a", p)
			testutil.QemuImg(t, "snapshot", "-c", "b", p)
		}, []string{"-c", "s1"}},
		{"apply, refcount_bits=2", func(p string) {
			create(2)(p)
			testutil.QemuImg(t, "snapshot", "-c", "a", p)
			testutil.QemuImg(t, "snapshot", "-c", "b", p)
		}, []string{"-a", "a"}},
		{"create, refcount_bits=64, refcount at its maximum", func(p string) {
			create(64)(p)
			pokeBE(t, p, 0x20000+5*8, 8, ^uint64(0))
		}, []string{"-c", "s1"}},
		{"create, L2 entry 1 TiB past the end", func(p string) {
			create(16)(p)
			pokeBE(t, p, 0x40008, 8, 0x8000010000050000)
		}, []string{"-c", "s1"}},
		{"apply, snapshot L2 entry 1 TiB past the end", func(p string) {
			create(16)(p)
			testutil.QemuImg(t, "snapshot", "-c", "a", p)
			testutil.QemuIO(t, p, "qcow2", "write -q -P 0x77 0 64k")
			pokeBE(t, p, 0x40008, 8, 0x0000010000050000)
		}, []string{"-a", "a"}},
		{"delete, snapshot L2 entry 1 TiB past the end", func(p string) {
			create(16)(p)
			testutil.QemuImg(t, "snapshot", "-c", "a", p)
			testutil.QemuIO(t, p, "qcow2", "write -q -P 0x77 0 64k")
			pokeBE(t, p, 0x40008, 8, 0x0000010000050000)
		}, []string{"-d", "a"}},
		// Found by TestSnapshotFuzzLikeQemu:
		{"create, refcount block 1 TiB past the end", func(p string) {
			testutil.QemuImg(t, "create", "-q", "-f", "qcow2", "-o", "cluster_size=4096,refcount_bits=1", p, "2M")
			testutil.QemuIO(t, p, "qcow2", "write -q -P 0x11 0 8k", "write -q -P 0x22 512k 4k")
			pokeBE(t, p, 0x1000, 8, 1<<40)
		}, []string{"-c", "s1"}},
		{"create, unaligned cluster", func(p string) {
			testutil.QemuImg(t, "create", "-q", "-f", "qcow2", "-o", "cluster_size=4096", p, "2M")
			testutil.QemuIO(t, p, "qcow2", "write -q -P 0x11 0 12k")
			pokeBE(t, p, 0x4008, 8, 0x8000000000006200)
		}, []string{"-c", "s1"}},
		{"create, refcount block counted free", func(p string) {
			create(16)(p)
			pokeBE(t, p, 0x20004, 2, 0)
		}, []string{"-c", "s1"}},
		{"create, refcount table used as a refcount block", func(p string) {
			create(16)(p)
			pokeBE(t, p, 0x10000, 8, 0x10000)
		}, []string{"-c", "s1"}},
		{"delete, active L2 table on the refcount table", func(p string) {
			testutil.QemuImg(t, "create", "-q", "-f", "qcow2", "-o", "cluster_size=4096", p, "2M")
			testutil.QemuIO(t, p, "qcow2", "write -q -P 0x11 0 8k")
			testutil.QemuImg(t, "snapshot", "-c", "s", p)
			testutil.QemuIO(t, p, "qcow2", "write -q -P 0x44 4k 4k")
			l1 := int64(peekBE(t, p, 40, 8))
			pokeBE(t, p, l1, 8, 0x8000000000001000)
		}, []string{"-d", "s"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir, _, o := twins(t, tc.build)
			before := qemuCheckCounts(t, o)
			beforeRaw, rawOK := convertRaw(t, o)
			st, err := os.Stat(o)
			if err != nil {
				t.Fatal(err)
			}
			qr := qemuImg(t, dir, append(append([]string{"snapshot"}, tc.args...), "q.qcow2")...)
			or := runVerb(snapshotVerb(o, tc.args))
			testutil.SameOutput(t, "snapshot", qr, or)
			if or.Code == 0 {
				t.Fatalf("snapshot %v succeeded", tc.args)
			}
			after := qemuCheckCounts(t, o)
			if !after.ok || after.Corruptions > before.Corruptions || after.CheckErrors > before.CheckErrors {
				t.Errorf("qemu-img check after the failed snapshot: %+v, before %+v", after, before)
			}
			// A corruption event marks the image corrupt, as QEMU
			// marks it; the twins agree on that bit.
			if qb, ob := peekBE(t, filepath.Join(dir, "q.qcow2"), 72, 8)&2, peekBE(t, o, 72, 8)&2; qb != ob {
				t.Errorf("corrupt bit %d, qemu-img's %d", ob>>1, qb>>1)
			}
			if got, ok := convertRaw(t, o); rawOK && (!ok || !bytes.Equal(got, beforeRaw)) {
				t.Errorf("guest data changed by the failed snapshot")
			}
			st2, err := os.Stat(o)
			if err != nil {
				t.Fatal(err)
			}
			if st2.Size() > st.Size()+4<<16 {
				t.Errorf("file grew from %d to %d bytes", st.Size(), st2.Size())
			}
		})
	}
}

// snapshotEntry returns the first snapshot table entry's bytes (fixed
// part, extra data, ID and name) with its date zeroed.
func snapshotEntry(t *testing.T, path string, i int) []byte {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	off := binary.BigEndian.Uint64(b[64:])
	for ; ; i-- {
		fixed := b[off : off+40]
		n := 40 + uint64(binary.BigEndian.Uint32(fixed[36:])) + uint64(binary.BigEndian.Uint16(fixed[12:])) + uint64(binary.BigEndian.Uint16(fixed[14:]))
		if i == 0 {
			e := append([]byte(nil), b[off:off+n]...)
			clear(e[16:24]) // date
			return e
		}
		off = (off + n + 7) &^ 7
	}
}

// TestSnapshotTableEntryLikeQemu: the entries ovis writes match qemu-img
// 7.2's byte for byte but for the date: 24 bytes of extra data, and an
// entry read with 16 bytes rewritten with 24, its unknown icount all ones.
func TestSnapshotTableEntryLikeQemu(t *testing.T) {
	t.Parallel()
	for _, compat := range []string{"1.1", "0.10"} {
		t.Run("compat="+compat, func(t *testing.T) {
			_, q, o := twins(t, func(p string) {
				testutil.QemuImg(t, "create", "-q", "-f", "qcow2", "-o", "compat="+compat, p, "64M")
			})
			testutil.QemuImg(t, "snapshot", "-c", "s1", q)
			mustRun(t, snapshotVerb(o, []string{"-c", "s1"}))
			if a, b := snapshotEntry(t, q, 0), snapshotEntry(t, o, 0); !bytes.Equal(a, b) {
				t.Errorf("new entry:\nqemu-img % x\n    ovis % x", a, b)
			}
			if a, b := peekSize(t, q), peekSize(t, o); a != b {
				t.Errorf("file is %d bytes, qemu-img's %d", b, a)
			}
			// Cut the first entry's extra data to 16 bytes, then add a
			// snapshot: the table is rewritten.
			for _, p := range []string{q, o} {
				off := int64(peekBE(t, p, 64, 8))
				pokeBE(t, p, off+36, 4, 16)
				b, err := os.ReadFile(p)
				if err != nil {
					t.Fatal(err)
				}
				copy(b[off+56:], "1s1")
				if err := os.WriteFile(p, b[:off+59], 0o644); err != nil {
					t.Fatal(err)
				}
			}
			testutil.QemuImg(t, "snapshot", "-c", "s2", q)
			mustRun(t, snapshotVerb(o, []string{"-c", "s2"}))
			for i := range 2 {
				if a, b := snapshotEntry(t, q, i), snapshotEntry(t, o, i); !bytes.Equal(a, b) {
					t.Errorf("rewritten entry %d:\nqemu-img % x\n    ovis % x", i, a, b)
				}
			}
			testutil.CheckImage(t, o)
		})
	}
}

func peekSize(t *testing.T, p string) int64 {
	t.Helper()
	st, err := os.Stat(p)
	if err != nil {
		t.Fatal(err)
	}
	return st.Size()
}

// TestAmendDirtyImageLikeQemu: amend of an image left dirty with lazy
// refcounts prints the repair QEMU's open makes, and leaves the same file.
func TestAmendDirtyImageLikeQemu(t *testing.T) {
	t.Parallel()
	for _, opt := range []string{"compat=0.10", "lazy_refcounts=off", "refcount_bits=8", "cluster_size=4096"} {
		t.Run(opt, func(t *testing.T) {
			dir, q, o := twins(t, func(p string) {
				testutil.QemuImg(t, "create", "-q", "-f", "qcow2", "-o", "lazy_refcounts=on", p, "64M")
				testutil.QemuIOExit(t, p, "qcow2", "write -q -P 0x5a 0 128k", "sigraise 9")
				if peekBE(t, p, 72, 8)&1 == 0 {
					t.Fatal("image not dirty")
				}
			})
			testutil.SameOutput(t, "amend", qemuImg(t, dir, "amend", "-o", opt, "q.qcow2"), runVerb(func(ctx context.Context, e *Env) error {
				return e.Amend(ctx, AmendConfig{Options: []string{opt}, Filenames: []string{o}})
			}))
			// ovis lays out a new refcount width its own way.
			if !strings.HasPrefix(opt, "refcount_bits") {
				sameFile(t, "after amend", q, o)
			}
			if c := qemuCheckCounts(t, o); !c.ok || c.Corruptions+c.Leaks+c.CheckErrors != 0 {
				t.Errorf("qemu-img check after amend: %+v", c)
			}
			if !readsPattern(t, o, 0x5a, 0, 128<<10) {
				t.Errorf("guest data lost")
			}
		})
	}
}

// TestCheckRepairFuzzLikeQemu damages one field of the L1, L2 or refcount
// table or a refcount block of small images qemu-img made, then repairs
// twins with ovis img check -r all and qemu-img check -r all. ovis must
// not crash or hang, must keep every guest cluster qemu-img's repair
// keeps, and must leave no more corruptions than qemu-img's repair
// leaves. OVIS_CHECK_FUZZ=N runs N cases instead of the bounded default.
func TestCheckRepairFuzzLikeQemu(t *testing.T) {
	t.Parallel()
	n := 20
	if raceEnabled {
		n = 10
	}
	if s := os.Getenv("OVIS_CHECK_FUZZ"); s != "" {
		v, err := strconv.Atoi(s)
		if err != nil {
			t.Fatal(err)
		}
		n = v
	}
	seed := int64(14)
	if s := os.Getenv("OVIS_CHECK_FUZZ_SEED"); s != "" {
		v, err := strconv.ParseInt(s, 10, 64)
		if err != nil {
			t.Fatal(err)
		}
		seed = v
	}
	dir := t.TempDir()
	bases := fuzzBases(t, dir)
	rng := rand.New(rand.NewSource(seed))
	for i := range n {
		b := bases[rng.Intn(len(bases))]
		what, off, size, val := fuzzDamage(t, rng, b.path)
		name := fmt.Sprintf("%d %s: %s at %#x = %#x", i, b.name, what, off, val)
		q, o := filepath.Join(dir, "q.qcow2"), filepath.Join(dir, "o.qcow2")
		copyFile(t, b.path, q)
		pokeBE(t, q, off, size, val)
		copyFile(t, q, o)
		qr := qemuImg(t, dir, "check", "-r", "all", "q.qcow2")
		stderr, ok := runBounded(t, name, func(ctx context.Context, e *Env) error {
			return e.Check(ctx, CheckConfig{Filename: o, Repair: "all", Output: "human"})
		})
		if !ok {
			continue
		}
		if os.Getenv("OVIS_CHECK_FUZZ_LOG") != "" && testutil.NormStderr(qr.Stderr) != testutil.NormStderr(stderr) {
			t.Logf("%s: messages differ\nqemu-img: %s\novis: %s", name, qr.Stderr, stderr)
		}
		qc, oc := qemuCheckCounts(t, q), qemuCheckCounts(t, o)
		if qc.ok && (!oc.ok || oc.Corruptions > qc.Corruptions || oc.CheckErrors > qc.CheckErrors) {
			t.Errorf("%s: qemu-img check after ovis's repair %+v, after qemu-img's %+v\nqemu-img -r all: %s\novis -r all: %s", name, oc, qc, qr.Stderr, stderr)
		}
		if !qc.ok {
			continue
		}
		qraw, qok := convertRaw(t, q)
		oraw, ook := convertRaw(t, o)
		if !qok {
			continue
		}
		if !ook {
			t.Errorf("%s: ovis's repaired image no longer converts", name)
			continue
		}
		const chunk = 4096
		for c := 0; c+chunk <= len(b.raw); c += chunk {
			want := b.raw[c : c+chunk]
			if bytes.Equal(qraw[c:c+chunk], want) && !bytes.Equal(oraw[c:c+chunk], want) {
				t.Errorf("%s: guest data at %#x lost by ovis's repair, kept by qemu-img's", name, c)
				break
			}
		}
	}
}

// fuzzBase is an undamaged image for the fuzz tests, and its guest view.
type fuzzBase struct {
	name, path string
	raw        []byte
	snap       bool // has a snapshot "s"
}

// fuzzBases makes small images with qemu-img: two cluster sizes, a
// refcount width of 1 and an internal snapshot.
func fuzzBases(t *testing.T, dir string) []fuzzBase {
	t.Helper()
	var bases []fuzzBase
	for i, b := range []struct {
		opts string
		io   []string
		snap bool
	}{
		{"cluster_size=65536", []string{"write -q -P 0x11 0 64k", "write -q -P 0x22 1M 128k"}, false},
		{"cluster_size=4096", []string{"write -q -P 0x11 0 12k", "write -q -P 0x22 64k 8k", "write -q -P 0x33 1M 4k"}, false},
		{"cluster_size=4096,refcount_bits=1", []string{"write -q -P 0x11 0 8k", "write -q -P 0x22 512k 4k"}, false},
		{"cluster_size=4096", []string{"write -q -P 0x11 0 8k", "write -q -P 0x22 64k 4k"}, true},
	} {
		p := filepath.Join(dir, fmt.Sprintf("base%d.qcow2", i))
		testutil.QemuImg(t, "create", "-q", "-f", "qcow2", "-o", b.opts, p, "2M")
		testutil.QemuIO(t, p, "qcow2", b.io...)
		if b.snap {
			testutil.QemuImg(t, "snapshot", "-c", "s", p)
			testutil.QemuIO(t, p, "qcow2", "write -q -P 0x44 4k 4k")
		}
		bases = append(bases, fuzzBase{b.opts, p, testutil.ConvertToRaw(t, p), b.snap})
	}
	return bases
}

// runBounded runs verb in process as runVerb does and returns what it
// printed on stderr, failing the test (and returning false) if it runs
// for a minute or panics.
func runBounded(t *testing.T, name string, verb func(ctx context.Context, e *Env) error) (string, bool) {
	t.Helper()
	type ran struct {
		out   testutil.Output
		panic any
	}
	done := make(chan ran, 1)
	go func() {
		var r ran
		defer func() {
			r.panic = recover()
			done <- r
		}()
		r.out = runVerb(verb)
	}()
	select {
	case r := <-done:
		if r.panic != nil {
			t.Errorf("%s: the verb crashed: %v", name, r.panic)
			return "", false
		}
		return r.out.Stderr, true
	case <-time.After(60 * time.Second):
		t.Errorf("%s: the verb hung", name)
		return "", false
	}
}

// TestSnapshotFuzzLikeQemu damages images as TestCheckRepairFuzzLikeQemu
// does, then creates, applies or deletes a snapshot with ovis and with
// qemu-img on twins. ovis must not crash or hang; whether it succeeds or
// fails, it must leave no more corruptions or check errors than the
// damage made, and the guest data as it was unless a snapshot was
// applied. OVIS_SNAPSHOT_FUZZ=N runs N cases.
func TestSnapshotFuzzLikeQemu(t *testing.T) {
	t.Parallel()
	n := 10
	if raceEnabled {
		n = 5
	}
	if s := os.Getenv("OVIS_SNAPSHOT_FUZZ"); s != "" {
		v, err := strconv.Atoi(s)
		if err != nil {
			t.Fatal(err)
		}
		n = v
	}
	dir := t.TempDir()
	bases := fuzzBases(t, dir)
	rng := rand.New(rand.NewSource(14))
	for i := range n {
		b := bases[rng.Intn(len(bases))]
		what, off, size, val := fuzzDamage(t, rng, b.path)
		verb := [][]string{{"-c", "new"}, {"-a", "s"}, {"-d", "s"}}[rng.Intn(3)]
		if !b.snap {
			verb = []string{"-c", "new"}
		}
		name := fmt.Sprintf("%d %s: %s at %#x = %#x, snapshot %s", i, b.name, what, off, val, strings.Join(verb, " "))
		q, o := filepath.Join(dir, "q.qcow2"), filepath.Join(dir, "o.qcow2")
		copyFile(t, b.path, q)
		pokeBE(t, q, off, size, val)
		copyFile(t, q, o)
		before := qemuCheckCounts(t, o)
		if !before.ok {
			continue
		}
		raw, rawOK := convertRaw(t, o)
		qr := qemuImg(t, dir, append(append([]string{"snapshot"}, verb...), "q.qcow2")...)
		stderr, ok := runBounded(t, name, snapshotVerb(o, verb))
		if !ok {
			continue
		}
		// On a damaged image qemu-img may spread the damage too: ovis
		// must do no worse than the damage or qemu-img, whichever is
		// worse.
		if qr.Code != 0 && qr.Code != 1 {
			// qemu-img crashed (an assertion on a table at offset 0):
			// nothing to compare with.
			continue
		}
		after, qafter := qemuCheckCounts(t, o), qemuCheckCounts(t, q)
		bound := before
		if qafter.ok {
			bound.Corruptions = max(bound.Corruptions, qafter.Corruptions)
			bound.CheckErrors = max(bound.CheckErrors, qafter.CheckErrors)
		}
		if !after.ok || after.Corruptions > bound.Corruptions || after.CheckErrors > bound.CheckErrors {
			t.Errorf("%s: qemu-img check %+v after ovis, %+v before, %+v after qemu-img\nqemu-img: %d %s\novis: %s", name, after, before, qafter, qr.Code, qr.Stderr, stderr)
		}
		if verb[0] == "-a" || !rawOK {
			continue
		}
		if qraw, ok := convertRaw(t, q); !ok || !bytes.Equal(qraw, raw) {
			continue
		}
		if got, ok := convertRaw(t, o); !ok || !bytes.Equal(got, raw) {
			t.Errorf("%s: guest data changed, qemu-img's twin kept it\nqemu-img: %d %s\novis: %s", name, qr.Code, qr.Stderr, stderr)
		}
	}
}

// convertRaw is the guest view of path, or false when qemu-img cannot
// read it.
func convertRaw(t *testing.T, path string) ([]byte, bool) {
	t.Helper()
	raw := path + ".raw"
	if _, _, code := testutil.RunIn(t, "", "qemu-img", "convert", "-U", "-O", "raw", path, raw); code != 0 {
		return nil, false
	}
	b, err := os.ReadFile(raw)
	if err != nil {
		t.Fatal(err)
	}
	os.Remove(raw)
	return b, true
}

// fuzzDamage picks one field of the image at path to damage and the value
// to write there: an entry of the L1 table, of the first L2 table, of the
// refcount table or of the first refcount block.
func fuzzDamage(t *testing.T, rng *rand.Rand, path string) (what string, off int64, size int, val uint64) {
	t.Helper()
	cs := int64(1) << peekBE(t, path, 20, 4)
	l1 := int64(peekBE(t, path, 40, 8))
	rt := int64(peekBE(t, path, 48, 8))
	rcBits := 1 << peekBE(t, path, 96, 4)
	fileSize := peekSize(t, path)
	l2 := int64(peekBE(t, path, l1, 8) &^ (1<<63 | 1<<62) &^ 0x1ff)
	rb := int64(peekBE(t, path, rt, 8) &^ 0x1ff)
	size = 8
	var old uint64
	switch rng.Intn(4) {
	case 0:
		what, off = "L1 entry", l1+int64(rng.Intn(2))*8
	case 1:
		what, off = "L2 entry", l2+int64(rng.Intn(6))*8
	case 2:
		what, off = "refcount table entry", rt+int64(rng.Intn(2))*8
	default:
		// A refcount entry of one of the first clusters, written as a
		// whole byte (or more) holding it.
		what = "refcount block entry"
		c := int64(rng.Intn(int(min(fileSize/cs+2, 40))))
		bitOff := c * int64(rcBits)
		off = rb + bitOff/8
		size = max(rcBits/8, 1)
		old = peekBE(t, path, off, size)
		if rcBits < 8 {
			shift := (bitOff % 8)
			v := uint64(rng.Intn(1 << rcBits))
			return what, off, 1, old&^(uint64(1<<rcBits-1)<<shift) | v<<shift
		}
		switch rng.Intn(3) {
		case 0:
			val = 0
		case 1:
			val = old + 1
		default:
			val = rng.Uint64() & (1<<(size*8) - 1)
			if size == 8 {
				val = rng.Uint64()
			}
		}
		return what, off, size, val
	}
	old = peekBE(t, path, off, 8)
	meta := []int64{0, l1, rt, rb, l2}
	switch rng.Intn(9) {
	case 0:
		val = 0
	case 1:
		val = rng.Uint64()
	case 2:
		val = old ^ 1<<rng.Intn(64)
	case 3:
		val = old&(1<<63) | uint64(meta[rng.Intn(len(meta))])
	case 4:
		val = old&(1<<63) | uint64(fileSize+cs*int64(rng.Intn(4)))
	case 5:
		val = old&(1<<63) | 1<<40
	case 6:
		val = 0xffffffffffff0000
	case 7:
		val = old + 0x200
	default:
		// Another entry's value: a second reference to its cluster.
		val = peekBE(t, path, off&^(cs-1)+int64(rng.Intn(4))*8, 8)
	}
	return what, off, size, val
}

// TestReproCheckFuzzFindings: damage TestCheckRepairFuzzLikeQemu found
// repaired otherwise than qemu-img repairs it: messages, exit code and
// resulting file must match.
func TestReproCheckFuzzFindings(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name, opts string
		off        int64
		v          uint64
	}{
		// The file system refuses the size: QEMU reports it twice.
		{"refcount block past the largest file", "cluster_size=65536", 0x10000, 0x2000000000020000},
		// QEMU counts a compressed cluster from its unaligned offset.
		{"compressed entry past the end", "cluster_size=4096", 0x4010, 0xdc704d0649a08f5d},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir, q, o := twins(t, func(p string) {
				testutil.QemuImg(t, "create", "-q", "-f", "qcow2", "-o", tc.opts, p, "2M")
				testutil.QemuIO(t, p, "qcow2", "write -q -P 0x11 0 12k", "write -q -P 0x22 64k 8k")
				pokeBE(t, p, tc.off, 8, tc.v)
			})
			testutil.SameOutput(t, "check -r all", qemuImg(t, dir, "check", "-r", "all", "q.qcow2"), ovisCheck(o, "all"))
			sameFile(t, "after check -r all", q, o)
			qc, oc := qemuCheckCounts(t, q), qemuCheckCounts(t, o)
			if !oc.ok || oc.Corruptions > qc.Corruptions || oc.CheckErrors > qc.CheckErrors {
				t.Errorf("qemu-img check after ovis's repair %+v, after qemu-img's %+v", oc, qc)
			}
		})
	}
}

// TestReproCheckL2OverlapsMetadata: an L1 entry that places an L2 table on
// the refcount table. check -r all must not write COPIED flags over the
// refcount table (found by TestCheckRepairFuzzLikeQemu): QEMU's overlap
// check refuses the write, marks the image corrupt and fails the check.
func TestReproCheckL2OverlapsMetadata(t *testing.T) {
	t.Parallel()
	dir, q, o := twins(t, func(p string) {
		testutil.QemuImg(t, "create", "-q", "-f", "qcow2", "-o", "cluster_size=4096,refcount_bits=1", p, "2M")
		testutil.QemuIO(t, p, "qcow2", "write -q -P 0x11 0 8k", "write -q -P 0x22 512k 4k")
		pokeBE(t, p, 0x3000, 8, 0x8000000000001000)
	})
	testutil.SameOutput(t, "check -r all", qemuImg(t, dir, "check", "-r", "all", "q.qcow2"), ovisCheck(o, "all"))
	qc, oc := qemuCheckCounts(t, q), qemuCheckCounts(t, o)
	if !oc.ok || oc.CheckErrors > qc.CheckErrors || oc.Corruptions > qc.Corruptions {
		t.Errorf("qemu-img check after ovis's repair %+v, after qemu-img's %+v", oc, qc)
	}
	if peekBE(t, o, 0x1000, 8) != 0x2000 {
		t.Errorf("refcount table entry 0 is %#x, want 0x2000", peekBE(t, o, 0x1000, 8))
	}
}

// ovisCheck is check [-r repair] of the image at path, in process.
func ovisCheck(path, repair string) testutil.Output {
	return runVerb(func(ctx context.Context, e *Env) error {
		return e.Check(ctx, CheckConfig{Filename: path, Repair: repair, Output: "human"})
	})
}

// snapshotVerb is `snapshot ARGS path` for ARGS -c, -a or -d and a name.
func snapshotVerb(path string, args []string) func(ctx context.Context, e *Env) error {
	action := map[string]string{"-c": SnapshotCreate, "-a": SnapshotApply, "-d": SnapshotDelete}[args[0]]
	return func(ctx context.Context, e *Env) error {
		return e.Snapshot(ctx, SnapshotConfig{Filename: path, Action: action, Name: args[1]})
	}
}

// mustRun runs verb as runVerb does and fails the test unless it
// succeeds.
func mustRun(t *testing.T, verb func(ctx context.Context, e *Env) error) {
	t.Helper()
	if r := runVerb(verb); r.Code != 0 {
		t.Fatalf("exit %d\nstderr: %s\nstdout: %s", r.Code, r.Stderr, r.Stdout)
	}
}

func copyFile(t *testing.T, from, to string) {
	t.Helper()
	testutil.CopyFile(t, from, to)
}
