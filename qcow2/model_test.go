package qcow2

// Model-based property tests: random operations run against the engine and
// against a flat in-memory copy of the guest disk; the two must never differ,
// and qemu-img check must find neither errors nor leaks.
//
// The number of rapid checks is lowered inside the tests (unless -rapid.checks
// or RAPID_CHECKS is given) so that the default run stays short, also with
// -race; run longer with e.g. -rapid.checks=2000. Reproduce a failure with
// the -rapid.seed=N it prints (TestModel is deterministic for a seed;
// TestModelConcurrent depends on scheduling as well). Failures print the
// image configuration and the last operations.
//
// TestRepro* are minimal reproductions of engine bugs these tests found.

import (
	"bytes"
	"cmp"
	"errors"
	"flag"
	"fmt"
	"math/rand"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ovis-storage/ovis/block"
	"pgregory.net/rapid"
)

// ---------------------------------------------------------------------------
// Limits

// mdlUserFlags lists the rapid flags the user chose (on the command line
// or in the environment). It is computed once, before any test changes a
// flag.
var mdlUserFlags = sync.OnceValue(func() map[string]bool {
	set := map[string]bool{}
	flag.Visit(func(f *flag.Flag) { set[f.Name] = true })
	for name, env := range map[string]string{"rapid.checks": "RAPID_CHECKS", "rapid.nofailfile": "RAPID_NOFAILFILE", "rapid.shrinktime": "RAPID_SHRINKTIME"} {
		if _, ok := os.LookupEnv(env); ok {
			set[name] = true
		}
	}
	return set
})

// mdlSetFlag sets a rapid flag unless the user chose it, and returns a
// function restoring it.
func mdlSetFlag(name, value string) func() {
	fl := flag.Lookup(name)
	if mdlUserFlags()[name] || fl == nil {
		return func() {}
	}
	old := fl.Value.String()
	if err := fl.Value.Set(value); err != nil {
		return func() {}
	}
	return func() { fl.Value.Set(old) }
}

// mdlCheck runs rapid.Check with n checks unless the user chose a number.
// Fail files are not written (they would land in the source tree); the
// failure message names the seed instead. Shrinking is bounded.
func mdlCheck(t *testing.T, n int, prop func(*rapid.T)) {
	t.Helper()
	defer mdlSetFlag("rapid.checks", strconv.Itoa(n))()
	defer mdlSetFlag("rapid.nofailfile", "true")()
	defer mdlSetFlag("rapid.shrinktime", "20s")()
	rapid.Check(t, prop)
}

// ---------------------------------------------------------------------------
// Configuration

type mdlConfig struct {
	ClusterSize   int64
	Compat        string
	RefcountBits  int
	ExtendedL2    bool
	Lazy          bool
	Compression   string
	Size          int64  // virtual size
	ReqSize       int64  // size asked of Create when not Size (rounded up to sectors)
	Backing       string // "", "raw-go", "raw-qemu", "qcow2-go", "qcow2-qemu"
	BackingSize   int64
	BackingFormat string
	BackingAbs    bool
	DataFile      bool
	DataFileRaw   bool
	Prealloc      string
	// QemuCreate creates the image with qemu-img instead of Create.
	QemuCreate bool
}

func (c mdlConfig) String() string {
	s := fmt.Sprintf("cluster_size=%d compat=%s refcount_bits=%d extended_l2=%v lazy_refcounts=%v compression_type=%s size=%d",
		c.ClusterSize, c.Compat, c.RefcountBits, c.ExtendedL2, c.Lazy, c.Compression, c.Size)
	if c.ReqSize != 0 {
		s += fmt.Sprintf(" (created with size=%d)", c.ReqSize)
	}
	if c.Backing != "" {
		s += fmt.Sprintf(" backing=%s(size=%d fmt=%q abs=%v)", c.Backing, c.BackingSize, c.BackingFormat, c.BackingAbs)
	}
	if c.DataFile {
		s += fmt.Sprintf(" data_file=yes data_file_raw=%v", c.DataFileRaw)
	}
	if c.Prealloc != "" {
		s += " preallocation=" + c.Prealloc
	}
	if c.QemuCreate {
		s += " created_by=qemu-img"
	}
	return s
}

// create makes the image under test at path.
func (c mdlConfig) create(path, backing string) error {
	dir := filepath.Dir(path)
	o := c.createOptions(dir, backing)
	if !c.QemuCreate {
		return Create(path, o)
	}
	opts := []string{
		"cluster_size=" + strconv.FormatInt(o.ClusterSize, 10),
		"compat=" + o.Compat,
		"refcount_bits=" + strconv.Itoa(o.RefcountBits),
		"compression_type=" + o.CompressionType,
	}
	if o.ExtendedL2 {
		opts = append(opts, "extended_l2=on")
	}
	if o.LazyRefcounts {
		opts = append(opts, "lazy_refcounts=on")
	}
	if o.Preallocation != "" {
		opts = append(opts, "preallocation="+o.Preallocation)
	}
	if o.DataFile != "" {
		opts = append(opts, "data_file="+o.DataFile)
		if o.DataFileRaw {
			opts = append(opts, "data_file_raw=on")
		}
	}
	args := []string{"create", "-q", "-f", "qcow2", "-o", strings.Join(opts, ",")}
	if o.BackingFile != "" {
		args = append(args, "-b", o.BackingFile, "-F", o.BackingFormat)
	}
	args = append(args, filepath.Base(path), strconv.FormatInt(o.Size, 10))
	// Relative backing and data file names resolve against the image's
	// folder for qemu-img create only when run there.
	cmd := exec.Command("qemu-img", args...)
	cmd.Dir = dir
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("qemu-img %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return nil
}

func (c mdlConfig) v2() bool { return c.Compat == "0.10" }

// createOptions returns the options for the image under test in dir.
func (c mdlConfig) createOptions(dir, backing string) CreateOptions {
	o := CreateOptions{
		Size:            cmp.Or(c.ReqSize, c.Size),
		ClusterSize:     c.ClusterSize,
		Compat:          c.Compat,
		LazyRefcounts:   c.Lazy,
		RefcountBits:    c.RefcountBits,
		ExtendedL2:      c.ExtendedL2,
		CompressionType: c.Compression,
		Preallocation:   c.Prealloc,
	}
	if backing != "" {
		o.BackingFile = filepath.Base(backing)
		if c.BackingAbs {
			o.BackingFile = backing
		}
		o.BackingFormat = c.BackingFormat
	}
	if c.DataFile {
		o.DataFile = "data.raw"
		o.DataFileRaw = c.DataFileRaw
	}
	return o
}

// mdlDrawConfig draws an image configuration. maxSize bounds the virtual
// size.
func mdlDrawConfig(t *rapid.T, maxSize int64) mdlConfig {
	var c mdlConfig
	c.ClusterSize = rapid.SampledFrom([]int64{512, 4096, 65536}).Draw(t, "cluster_size")
	c.Compat = rapid.SampledFrom([]string{"1.1", "0.10", "1.1"}).Draw(t, "compat")
	c.RefcountBits = 16
	c.Compression = "zlib"
	if !c.v2() {
		c.RefcountBits = rapid.SampledFrom([]int{16, 1, 64}).Draw(t, "refcount_bits")
		if c.ClusterSize >= 16384 {
			c.ExtendedL2 = rapid.IntRange(0, 2).Draw(t, "extended_l2") > 0
		}
		c.Lazy = rapid.Bool().Draw(t, "lazy_refcounts")
		c.Compression = rapid.SampledFrom([]string{"zlib", "zstd"}).Draw(t, "compression_type")
	}
	// 256 KiB .. maxSize, in sectors; sometimes cluster aligned.
	sectors := rapid.Int64Range(512, maxSize/512).Draw(t, "size_sectors")
	c.Size = sectors * 512
	switch rapid.IntRange(0, 3).Draw(t, "size_kind") {
	case 0, 1: // sectors
	case 2: // clusters
		c.Size = max(c.ClusterSize, c.Size&^(c.ClusterSize-1))
	case 3: // not even sectors: Create rounds up
		c.ReqSize = c.Size - rapid.Int64Range(1, 511).Draw(t, "size_short")
	}
	c.Backing = rapid.SampledFrom([]string{"", "raw-go", "raw-qemu", "qcow2-go", "qcow2-qemu"}).Draw(t, "backing")
	if c.Backing != "" {
		// Smaller, equal or larger than the image.
		switch rapid.IntRange(0, 2).Draw(t, "backing_size_kind") {
		case 0:
			c.BackingSize = c.Size
		case 1:
			c.BackingSize = rapid.Int64Range(1, c.Size/512).Draw(t, "backing_sectors") * 512
		case 2:
			c.BackingSize = c.Size + rapid.Int64Range(1, 2048).Draw(t, "backing_extra_sectors")*512
		}
		c.BackingFormat = "raw"
		if strings.HasPrefix(c.Backing, "qcow2") {
			c.BackingFormat = rapid.SampledFrom([]string{"qcow2", ""}).Draw(t, "backing_fmt")
		}
		c.BackingAbs = rapid.Bool().Draw(t, "backing_abs")
	}
	if !c.v2() {
		c.DataFile = rapid.IntRange(0, 3).Draw(t, "data_file") == 0
		if c.DataFile && c.Backing == "" {
			c.DataFileRaw = rapid.Bool().Draw(t, "data_file_raw")
		}
	}
	if c.Backing == "" && rapid.IntRange(0, 3).Draw(t, "prealloc") == 0 {
		c.Prealloc = rapid.SampledFrom([]string{PreallocMetadata, PreallocFalloc, PreallocFull}).Draw(t, "preallocation")
	}
	// qemu-img create needs the backing format.
	if c.Backing == "" || c.BackingFormat != "" {
		c.QemuCreate = rapid.IntRange(0, 3).Draw(t, "qemu_create") == 0
	}
	return c
}

// ---------------------------------------------------------------------------
// Helpers

// mdlFills is the number of fill kinds of mdlFill.
const mdlFills = 5

// mdlFill returns n bytes of one of several shapes: random, constant,
// zeros, compressible text-like runs, or a random prefix of random length
// followed by a constant (compressing to about the prefix's size).
func mdlFill(kind int, seed uint64, n int64) []byte {
	p := make([]byte, n)
	r := rand.New(rand.NewSource(int64(seed)))
	switch kind {
	case 0: // random
		r.Read(p)
	case 4: // random prefix
		k := r.Int63n(n + 1)
		r.Read(p[:k])
		for i := k; i < n; i++ {
			p[i] = 0x5a
		}
	case 1: // constant
		b := byte(seed) | 1
		for i := range p {
			p[i] = b
		}
	case 2: // zeros
	default: // compressible: short random runs
		for i := int64(0); i < n; {
			run := int64(r.Intn(64) + 1)
			b := byte(r.Intn(8)) + 'a'
			for j := int64(0); j < run && i < n; j++ {
				p[i] = b
				i++
			}
		}
	}
	return p
}

// mdlDiff describes the first difference between got and want, which
// start at guest offset off.
func mdlDiff(got, want []byte, off, cs int64) string {
	if bytes.Equal(got, want) {
		return ""
	}
	i := 0
	for i < len(got) && i < len(want) && got[i] == want[i] {
		i++
	}
	j := i
	for j < len(got) && j < len(want) && got[j] != want[j] {
		j++
	}
	at := off + int64(i)
	end := min(i+16, len(got), len(want))
	return fmt.Sprintf("first difference at guest offset %d (cluster %d, +%d), %d differing bytes from there; got % x, want % x",
		at, at/cs, at%cs, j-i, got[i:end], want[i:end])
}

// mdlQemuCheck runs qemu-img check and returns an error on errors, leaks
// or failure to check.
func mdlQemuCheck(path string, leaksOK ...bool) error {
	// QEMU 7.2 resolves a relative data-file name against its working
	// directory, the engine against the image's folder: run it there.
	cmd := exec.Command("qemu-img", "check", filepath.Base(path))
	cmd.Dir = filepath.Dir(path)
	out, err := cmd.CombinedOutput()
	var ee *exec.ExitError
	if errors.As(err, &ee) && ee.ExitCode() == 3 && len(leaksOK) > 0 && leaksOK[0] {
		return nil // leaked clusters only
	}
	if err != nil {
		return fmt.Errorf("qemu-img check %s: %v\n%s", filepath.Base(path), err, out)
	}
	return nil
}

func mdlHaveQemu(t *testing.T) {
	t.Helper()
	for _, p := range []string{"qemu-img", "qemu-io"} {
		if _, err := exec.LookPath(p); err != nil {
			t.Skipf("%s not installed (apt-get install -y qemu-utils)", p)
		}
	}
}

func mdlRun(name string, args ...string) error {
	out, err := exec.Command(name, args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
	}
	return nil
}

// mdlMakeBacking creates the backing file of c in dir with random content
// and returns its path and its contents.
func mdlMakeBacking(t *rapid.T, c mdlConfig, dir string) (string, []byte) {
	content := make([]byte, c.BackingSize)
	bs := c.BackingSize
	switch c.Backing {
	case "raw-go":
		path := filepath.Join(dir, "base.raw")
		nw := rapid.IntRange(0, 8).Draw(t, "base_writes")
		for i := 0; i < nw; i++ {
			off := rapid.Int64Range(0, bs-1).Draw(t, "base_off")
			n := rapid.Int64Range(1, min(bs-off, 256<<10)).Draw(t, "base_len")
			copy(content[off:], mdlFill(rapid.IntRange(0, mdlFills-1).Draw(t, "base_fill"), rapid.Uint64().Draw(t, "base_seed"), n))
		}
		if err := os.WriteFile(path, content, 0o644); err != nil {
			t.Fatal(err)
		}
		return path, content
	case "raw-qemu", "qcow2-qemu":
		format, path := "raw", filepath.Join(dir, "base.raw")
		args := []string{"create", "-q", "-f", "raw", path, strconv.FormatInt(bs, 10)}
		var bcs int64 = 512
		if c.Backing == "qcow2-qemu" {
			format, path = "qcow2", filepath.Join(dir, "base.qcow2")
			bcs = rapid.SampledFrom([]int64{512, 4096, 65536}).Draw(t, "base_cluster_size")
			compat := rapid.SampledFrom([]string{"1.1", "0.10"}).Draw(t, "base_compat")
			args = []string{"create", "-q", "-f", "qcow2", "-o", fmt.Sprintf("cluster_size=%d,compat=%s", bcs, compat), path, strconv.FormatInt(bs, 10)}
		}
		if err := mdlRun("qemu-img", args...); err != nil {
			t.Fatal(err)
		}
		// Plain and zero writes first, then compressed writes of whole
		// clusters that nothing else touched: QEMU writes compressed
		// clusters only where nothing is allocated, and QEMU 7.2 corrupts
		// its own images when it zeroes over compressed clusters.
		io := []string{"-f", format}
		touched := map[int64]bool{}
		var compressed []int64
		nw := rapid.IntRange(0, 8).Draw(t, "base_writes")
		for i := 0; i < nw; i++ {
			pat := rapid.IntRange(1, 255).Draw(t, "base_pattern")
			kind := rapid.IntRange(0, 2).Draw(t, "base_kind")
			if kind == 2 && format == "qcow2" && bs >= bcs {
				compressed = append(compressed, rapid.Int64Range(0, bs/bcs-1).Draw(t, "base_cluster"), int64(pat))
				continue
			}
			off := rapid.Int64Range(0, bs/512-1).Draw(t, "base_sector") * 512
			n := rapid.Int64Range(1, min((bs-off)/512, 512)).Draw(t, "base_sectors") * 512
			for c := off / bcs; c <= (off+n-1)/bcs; c++ {
				touched[c] = true
			}
			if kind == 1 {
				io = append(io, "-c", fmt.Sprintf("write -z %d %d", off, n))
				clear(content[off : off+n])
			} else {
				io = append(io, "-c", fmt.Sprintf("write -P %d %d %d", pat, off, n))
				for j := off; j < off+n; j++ {
					content[j] = byte(pat)
				}
			}
		}
		for i := 0; i < len(compressed); i += 2 {
			cl, pat := compressed[i], compressed[i+1]
			if touched[cl] {
				continue
			}
			touched[cl] = true
			off := cl * bcs
			io = append(io, "-c", fmt.Sprintf("write -c -P %d %d %d", pat, off, bcs))
			for j := off; j < off+bcs; j++ {
				content[j] = byte(pat)
			}
		}
		if len(io) > 2 {
			if err := mdlRun("qemu-io", append(io, path)...); err != nil {
				t.Fatal(err)
			}
		}
		if format == "qcow2" {
			if err := mdlQemuCheck(path); err != nil {
				t.Fatalf("base made by qemu-io: %v", err)
			}
		}
		return path, content
	case "qcow2-go":
		path := filepath.Join(dir, "base.qcow2")
		o := CreateOptions{
			Size:        bs,
			ClusterSize: rapid.SampledFrom([]int64{512, 4096, 65536}).Draw(t, "base_cluster_size"),
			Compat:      rapid.SampledFrom([]string{"1.1", "0.10"}).Draw(t, "base_compat"),
		}
		if err := Create(path, o); err != nil {
			t.Fatalf("creating base: %v", err)
		}
		img, err := Open(path, Options{})
		if err != nil {
			t.Fatalf("opening base: %v", err)
		}
		nw := rapid.IntRange(0, 8).Draw(t, "base_writes")
		for i := 0; i < nw; i++ {
			off := rapid.Int64Range(0, bs-1).Draw(t, "base_off")
			n := rapid.Int64Range(1, min(bs-off, 256<<10)).Draw(t, "base_len")
			if rapid.IntRange(0, 3).Draw(t, "base_kind") == 0 {
				if err := img.WriteZeroes(ctx, off, n, 0); err != nil {
					t.Fatalf("base zero: %v", err)
				}
				clear(content[off : off+n])
				continue
			}
			p := mdlFill(rapid.IntRange(0, mdlFills-1).Draw(t, "base_fill"), rapid.Uint64().Draw(t, "base_seed"), n)
			if _, err := img.WriteAt(ctx, p, off, 0); err != nil {
				t.Fatalf("base write: %v", err)
			}
			copy(content[off:], p)
		}
		if err := img.Close(); err != nil {
			t.Fatalf("closing base: %v", err)
		}
		return path, content
	}
	t.Fatalf("unknown backing kind %q", c.Backing)
	return "", nil
}

// ---------------------------------------------------------------------------
// The model

type mdlModel struct {
	cfg  mdlConfig
	disk []byte // expected guest contents
	base []byte // backing contents over the virtual size (zeros beyond the backing file)
}

func newMdlModel(c mdlConfig, backing []byte) *mdlModel {
	m := &mdlModel{cfg: c, disk: make([]byte, c.Size), base: make([]byte, c.Size)}
	copy(m.base, backing)
	copy(m.disk, m.base)
	return m
}

func (m *mdlModel) write(p []byte, off int64) { copy(m.disk[off:], p) }

func (m *mdlModel) zero(off, n int64) { clear(m.disk[off : off+n]) }

// discardRange returns the guest clusters [first, last) that Discard(off,
// n) drops: the whole clusters inside the range, where the range reaching
// the end of the disk covers the last (partial) cluster.
func mdlDiscardRange(off, n, size, cs int64) (int64, int64) {
	end := off + n
	first := (off + cs - 1) / cs
	last := end / cs
	if end == size {
		last = (end + cs - 1) / cs
	}
	return first, last
}

func (m *mdlModel) discard(off, n int64) {
	if m.cfg.DataFile {
		return
	}
	cs := m.cfg.ClusterSize
	if m.cfg.v2() && m.cfg.Backing != "" {
		return // QEMU ignores it: it would expose the backing file
	}
	first, last := mdlDiscardRange(off, n, m.cfg.Size, cs)
	for c := first; c < last; c++ {
		clear(m.disk[c*cs : min((c+1)*cs, m.cfg.Size)])
	}
}

// ---------------------------------------------------------------------------
// Drawing ranges

// mdlDrawRange draws a non-empty range inside a disk of the given size:
// sub-cluster, cross-cluster, whole clusters, sector aligned, arbitrary or
// reaching the end of the disk.
func mdlDrawRange(t *rapid.T, label string, size, cs int64) (int64, int64) {
	nclusters := (size + cs - 1) / cs
	maxLen := max(4*cs, 64<<10)
	var off, n int64
	switch rapid.IntRange(0, 5).Draw(t, label+"_kind") {
	case 0: // inside one cluster
		c := rapid.Int64Range(0, nclusters-1).Draw(t, label+"_cluster")
		in := rapid.Int64Range(0, cs-1).Draw(t, label+"_in")
		off = min(c*cs+in, size-1)
		n = rapid.Int64Range(1, cs-off%cs).Draw(t, label+"_len")
	case 1: // across a cluster boundary
		if nclusters < 2 {
			off = 0
			n = size
			break
		}
		b := rapid.Int64Range(1, nclusters-1).Draw(t, label+"_boundary") * cs
		off = b - rapid.Int64Range(1, min(cs, b)).Draw(t, label+"_before")
		n = b - off + rapid.Int64Range(1, 2*cs).Draw(t, label+"_after")
	case 2: // whole clusters
		c := rapid.Int64Range(0, nclusters-1).Draw(t, label+"_cluster")
		off = c * cs
		n = rapid.Int64Range(1, max(1, maxLen/cs)).Draw(t, label+"_clusters") * cs
	case 3: // sectors
		off = rapid.Int64Range(0, (size-1)/512).Draw(t, label+"_sector") * 512
		n = rapid.Int64Range(1, maxLen/512).Draw(t, label+"_sectors") * 512
	case 4: // anything
		off = rapid.Int64Range(0, size-1).Draw(t, label+"_off")
		n = rapid.Int64Range(1, maxLen).Draw(t, label+"_len")
	case 5: // to the end of the disk
		n = rapid.Int64Range(1, min(size, maxLen)).Draw(t, label+"_tail")
		off = size - n
	}
	n = min(n, size-off)
	return off, n
}

// ---------------------------------------------------------------------------
// TestModel

// mdlPending is an operation since the last flush: after a crash each of
// its bytes reads either as before or as the operation left it.
type mdlPending struct {
	off, n int64
	data   []byte // nil: zeros, or (discard) the model's discard result
	disc   bool
}

type mdlState struct {
	t     *rapid.T
	cfg   mdlConfig
	path  string
	img   *Image
	model *mdlModel
	ops   []string

	// flushed is the model as of the last flush; pending lists what
	// changed since (for crashes without a flush).
	flushed []byte
	pending []mdlPending
	// leaky is set once a crash without flush may have leaked clusters.
	leaky bool
}

func (s *mdlState) fatalf(format string, args ...any) {
	s.t.Helper()
	last := s.ops
	if len(last) > 16 {
		last = last[len(last)-16:]
	}
	s.t.Fatalf("%s\nconfig: %s\nlast ops (of %d):\n  %s", fmt.Sprintf(format, args...), s.cfg, len(s.ops), strings.Join(last, "\n  "))
}

func (s *mdlState) op(format string, args ...any) {
	s.ops = append(s.ops, fmt.Sprintf(format, args...))
}

// durable records that everything so far is on disk.
func (s *mdlState) durable() {
	if s.flushed == nil {
		s.flushed = make([]byte, len(s.model.disk))
	}
	copy(s.flushed, s.model.disk)
	s.pending = s.pending[:0]
}

// verify compares [off, off+n) with the model.
func (s *mdlState) verify(what string, off, n int64) {
	s.t.Helper()
	got := make([]byte, n)
	if k, err := s.img.ReadAt(ctx, got, off); err != nil || k != len(got) {
		s.fatalf("%s: ReadAt(%d, %d): n=%d err=%v", what, off, n, k, err)
	}
	if d := mdlDiff(got, s.model.disk[off:off+n], off, s.cfg.ClusterSize); d != "" {
		s.fatalf("%s: %s", what, d)
	}
}

// verifyAround reads back the clusters around an operation.
func (s *mdlState) verifyAround(what string, off, n int64) {
	s.t.Helper()
	cs := s.cfg.ClusterSize
	lo := max(0, off/cs*cs-cs)
	hi := min(s.cfg.Size, ((off+n+cs-1)/cs+1)*cs)
	s.verify(what, lo, hi-lo)
}

func (s *mdlState) open() {
	s.t.Helper()
	o := mdlDrawOpenOptions(s.t, s.cfg.ClusterSize)
	img, err := Open(s.path, o)
	if err != nil {
		s.fatalf("Open(%+v): %v", o, err)
	}
	s.img = img
	if img.Size() != s.cfg.Size {
		s.fatalf("Size() = %d, want %d", img.Size(), s.cfg.Size)
	}
}

func (s *mdlState) check(what string) {
	s.t.Helper()
	if err := mdlQemuCheck(s.path, s.leaky); err != nil {
		s.fatalf("%s: %v", what, err)
	}
}

// reopen closes the image, checks it with qemu-img, sometimes verifies it
// opened read-only, and opens it again.
func (s *mdlState) reopen(readOnly bool) {
	s.t.Helper()
	err := s.img.Close()
	s.img = nil
	if err != nil {
		s.fatalf("Close: %v", err)
	}
	s.durable()
	s.check("after close")
	if readOnly {
		img, err := Open(s.path, Options{ReadOnly: true})
		if err != nil {
			s.fatalf("Open read-only: %v", err)
		}
		s.img = img
		s.verify("read-only", 0, s.cfg.Size)
		if _, err := img.WriteAt(ctx, []byte{1}, 0, 0); !errors.Is(err, block.ErrReadOnly) {
			s.fatalf("WriteAt on a read-only image: %v, want ErrReadOnly", err)
		}
		err = img.Close()
		s.img = nil
		if err != nil {
			s.fatalf("Close read-only: %v", err)
		}
	}
	s.open()
}

// crash abandons the image without Close (after a Flush when flush is
// set), checks it and opens it again. Without a flush every byte changed
// since the last flush may read as before or as any later operation left
// it; the model then adopts what the image reads.
func (s *mdlState) crash(flush bool) {
	s.t.Helper()
	if flush {
		if err := s.img.Flush(ctx); err != nil {
			s.fatalf("Flush: %v", err)
		}
		s.durable()
	}
	s.img.mu.Lock()
	s.img.closed = true
	s.img.mu.Unlock()
	if err := s.img.closeFiles(); err != nil {
		s.fatalf("closing files: %v", err)
	}
	s.img = nil
	if !flush && len(s.pending) > 0 {
		s.leaky = true
	}
	s.check("after crash")
	s.open()
	size, cs := s.cfg.Size, s.cfg.ClusterSize
	got := make([]byte, size)
	if _, err := s.img.ReadAt(ctx, got, 0); err != nil {
		s.fatalf("after crash: ReadAt: %v", err)
	}
	for i := int64(0); i < size; i++ {
		if got[i] == s.flushed[i] {
			continue
		}
		ok := false
		for _, p := range s.pending {
			if i < p.off || i >= p.off+p.n {
				continue
			}
			var v byte
			switch {
			case p.data != nil:
				v = p.data[i-p.off]
			case p.disc && s.cfg.v2() && s.cfg.Backing != "":
				v = s.model.base[i]
			}
			if got[i] == v {
				ok = true
				break
			}
		}
		if !ok {
			s.fatalf("after crash (flush=%v): guest offset %d (cluster %d) reads %#x, neither its value at the last flush (%#x) nor one written since",
				flush, i, i/cs, got[i], s.flushed[i])
		}
	}
	copy(s.model.disk, got)
	s.durable()
}

// mdlDrawOpenOptions draws cache sizes, sometimes tiny so that tables are
// evicted and written back often.
func mdlDrawOpenOptions(t *rapid.T, cs int64) Options {
	var o Options
	if rapid.IntRange(0, 2).Draw(t, "small_l2_cache") == 0 {
		o.L2CacheSize = rapid.Int64Range(1, 4).Draw(t, "l2_cache_tables") * cs
	}
	if rapid.IntRange(0, 2).Draw(t, "small_refcount_cache") == 0 {
		o.RefcountCacheSize = rapid.Int64Range(1, 4).Draw(t, "refcount_cache_tables") * cs
	}
	return o
}

// edge runs a request at or beyond the edges of the disk: empty requests
// must do nothing, requests past the end must fail with ErrOutOfRange and
// change nothing.
func (s *mdlState) edge() {
	s.t.Helper()
	t, size := s.t, s.cfg.Size
	off := rapid.Int64Range(0, size).Draw(t, "edge_off")
	var n int64
	if rapid.Bool().Draw(t, "edge_beyond") {
		n = size - off + rapid.Int64Range(1, 1<<20).Draw(t, "edge_extra")
		if rapid.Bool().Draw(t, "edge_negative") {
			off = -rapid.Int64Range(1, 1<<20).Draw(t, "edge_neg")
			n = 1
		}
	}
	var want error
	if n != 0 {
		want = block.ErrOutOfRange
	}
	kind := rapid.IntRange(0, 3).Draw(t, "edge_kind")
	var err error
	switch kind {
	case 0:
		s.op("edge WriteAt(off=%d, len=%d)", off, n)
		var k int
		k, err = s.img.WriteAt(ctx, bytes.Repeat([]byte{0xee}, int(n)), off, 0)
		if n > 0 && k != 0 {
			s.fatalf("WriteAt(%d, %d) beyond the end wrote %d bytes", off, n, k)
		}
	case 1:
		s.op("edge WriteZeroes(off=%d, n=%d)", off, n)
		err = s.img.WriteZeroes(ctx, off, n, block.ZeroFlags(rapid.Bool().Draw(t, "edge_unmap"), false))
	case 2:
		s.op("edge Discard(off=%d, n=%d)", off, n)
		err = s.img.Discard(ctx, off, n, 0)
	case 3:
		s.op("edge ReadAt(off=%d, len=%d)", off, n)
		_, err = s.img.ReadAt(ctx, make([]byte, n), off)
	}
	if !errors.Is(err, want) {
		s.fatalf("request %d at %d..%d (size %d): err=%v, want %v", kind, off, off+n, size, err, want)
	}
	lo := max(0, min(off, size-1))
	s.verifyAround("after edge request", lo, min(size-lo, 1))
}

// mdlCase is one check's image: created from cfg at path, over a backing
// file holding bcontent when cfg has one.
type mdlCase struct {
	cfg      mdlConfig
	path     string
	bcontent []byte
}

// mdlCheckImages runs prop in n checks (short under -short), each on a
// new image of a drawn configuration in a fresh directory, removed when
// the check ends, as rapid runs many checks per test.
func mdlCheckImages(t *testing.T, n, short int, prefix string, prop func(*rapid.T, mdlCase)) {
	t.Helper()
	mdlHaveQemu(t)
	if testing.Short() {
		n = short
	}
	mdlCheck(t, n, func(rt *rapid.T) {
		dir, err := os.MkdirTemp(t.TempDir(), prefix)
		if err != nil {
			rt.Fatal(err)
		}
		rt.Cleanup(func() { os.RemoveAll(dir) })
		c := mdlCase{cfg: mdlDrawConfig(rt, 8<<20), path: filepath.Join(dir, "img.qcow2")}
		var backing string
		if c.cfg.Backing != "" {
			backing, c.bcontent = mdlMakeBacking(rt, c.cfg, dir)
		}
		rt.Logf("config: %s", c.cfg)
		if err := c.cfg.create(c.path, backing); err != nil {
			rt.Fatalf("Create: %v\nconfig: %s", err, c.cfg)
		}
		prop(rt, c)
	})
}

func TestModel(t *testing.T) {
	mdlCheckImages(t, 40, 10, "model", func(rt *rapid.T, c mdlCase) {
		cfg := c.cfg
		s := &mdlState{t: rt, cfg: cfg, path: c.path, model: newMdlModel(cfg, c.bcontent)}
		s.check("after create")
		s.open()
		s.durable()
		defer func() {
			if s.img != nil {
				s.img.Close()
			}
		}()

		size, cs := cfg.Size, cfg.ClusterSize
		opKinds := []string{"write", "write", "write", "zero", "zero", "discard", "discard", "compressed", "compressed",
			"flush", "read", "read", "reopen", "bigwrite", "edge", "crash"}
		nops := rapid.IntRange(1, 60).Draw(rt, "nops")
		for i := 0; i < nops; i++ {
			op := rapid.SampledFrom(opKinds).Draw(rt, "op")
			switch op {
			case "write", "bigwrite":
				var off, n int64
				if op == "write" {
					off, n = mdlDrawRange(rt, "w", size, cs)
				} else {
					off = rapid.Int64Range(0, size-1).Draw(rt, "bw_off")
					n = rapid.Int64Range(1, min(size-off, 1<<20)).Draw(rt, "bw_len")
				}
				fill := rapid.IntRange(0, mdlFills-1).Draw(rt, "fill")
				p := mdlFill(fill, rapid.Uint64().Draw(rt, "seed"), n)
				fua := rapid.IntRange(0, 4).Draw(rt, "fua") == 0
				s.op("WriteAt(off=%d, len=%d, fill=%d, fua=%v)", off, n, fill, fua)
				if k, err := s.img.WriteAt(ctx, p, off, block.FUAIf(fua)); err != nil || k != len(p) {
					s.fatalf("WriteAt(%d, %d): n=%d err=%v", off, n, k, err)
				}
				s.model.write(p, off)
				s.pending = append(s.pending, mdlPending{off: off, n: n, data: p})
				s.verifyAround("after write", off, n)
			case "zero":
				off, n := mdlDrawRange(rt, "z", size, cs)
				unmap := rapid.Bool().Draw(rt, "mayUnmap")
				fua := rapid.IntRange(0, 4).Draw(rt, "fua") == 0
				s.op("WriteZeroes(off=%d, n=%d, mayUnmap=%v, fua=%v)", off, n, unmap, fua)
				if err := s.img.WriteZeroes(ctx, off, n, block.ZeroFlags(unmap, fua)); err != nil {
					s.fatalf("WriteZeroes(%d, %d): %v", off, n, err)
				}
				s.model.zero(off, n)
				s.pending = append(s.pending, mdlPending{off: off, n: n})
				s.verifyAround("after write zeroes", off, n)
			case "discard":
				off, n := mdlDrawRange(rt, "d", size, cs)
				s.op("Discard(off=%d, n=%d)", off, n)
				if err := s.img.Discard(ctx, off, n, 0); err != nil {
					s.fatalf("Discard(%d, %d): %v", off, n, err)
				}
				s.model.discard(off, n)
				if !cfg.DataFile && !(cfg.v2() && cfg.Backing != "") {
					if first, last := mdlDiscardRange(off, n, size, cs); last > first {
						s.pending = append(s.pending, mdlPending{off: first * cs, n: min(last*cs, size) - first*cs, disc: true})
					}
				}
				s.verifyAround("after discard", off, n)
			case "compressed":
				if cfg.DataFile {
					continue
				}
				// One cluster or a run of them, as qemu-img convert -c
				// writes them.
				c0 := rapid.Int64Range(0, (size-1)/cs).Draw(rt, "ccluster")
				run := rapid.Int64Range(1, 8).Draw(rt, "cclusters")
				for c := c0; c < min(c0+run, (size+cs-1)/cs); c++ {
					off := c * cs
					n := min(cs, size-off)
					fill := rapid.IntRange(0, mdlFills-1).Draw(rt, "cfill")
					p := mdlFill(fill, rapid.Uint64().Draw(rt, "cseed"), n)
					s.op("WriteCompressed(off=%d, len=%d, fill=%d)", off, n, fill)
					if err := s.img.WriteCompressed(ctx, p, off); err != nil {
						s.fatalf("WriteCompressed(%d, %d): %v", off, n, err)
					}
					s.model.write(p, off)
					s.pending = append(s.pending, mdlPending{off: off, n: n, data: p})
					s.verifyAround("after compressed write", off, n)
				}
			case "flush":
				s.op("Flush()")
				if err := s.img.Flush(ctx); err != nil {
					s.fatalf("Flush: %v", err)
				}
				s.durable()
			case "read":
				off, n := mdlDrawRange(rt, "r", size, cs)
				s.op("ReadAt(off=%d, len=%d)", off, n)
				s.verify("read", off, n)
				// A range reported as zero must read as zeros.
				e, err := block.FirstExtent(ctx, s.img, off, n)
				if err != nil {
					s.fatalf("Extent(%d, %d): %v", off, n, err)
				}
				if e.Length <= 0 || e.Length > n {
					s.fatalf("Extent(%d, %d): length %d", off, n, e.Length)
				}
				if e.Status&block.StatusZero != 0 {
					if i := bytes.IndexFunc(s.model.disk[off:off+e.Length], func(r rune) bool { return r != 0 }); i >= 0 {
						s.fatalf("Extent(%d, %d) = %+v reports zeros, but the model has data", off, n, e)
					}
				}
			case "reopen":
				ro := rapid.IntRange(0, 2).Draw(rt, "read_only_too") == 0
				s.op("Close+Open(read-only check=%v)", ro)
				s.reopen(ro)
				s.verify("after reopen", 0, size)
			case "edge":
				s.edge()
			case "crash":
				flush := rapid.Bool().Draw(rt, "crash_flush")
				s.op("crash(flush=%v) + Open", flush)
				s.crash(flush)
			}
		}
		s.verify("final", 0, size)
		s.op("Close+Open (final)")
		s.reopen(false)
		s.verify("final after reopen", 0, size)
		err := s.img.Close()
		s.img = nil
		if err != nil {
			s.fatalf("final Close: %v", err)
		}
		s.check("final")
	})
}

// ---------------------------------------------------------------------------
// TestModelConcurrent

// mdlShared is the layout of the concurrent test: clusters [0, frozen)
// are written before the workers start and only read afterwards; worker g
// owns clusters [own[g], own[g+1]); in the shared clusters
// [shared0, shared1) worker g owns the bytes [cut[g], cut[g+1]) of every
// cluster.
type mdlLayout struct {
	cs               int64
	size             int64
	frozen           int64
	shared0, shared1 int64
	own              []int64 // len workers+1, cluster indices
	cut              []int64 // len workers+1, byte offsets inside a cluster
}

// mdlConcurrentModel is the model shared by the workers; each worker only
// changes bytes it owns, so the order of their updates does not matter.
type mdlConcurrentModel struct {
	mu sync.Mutex
	m  *mdlModel
}

func (cm *mdlConcurrentModel) do(f func(m *mdlModel)) {
	cm.mu.Lock()
	defer cm.mu.Unlock()
	f(cm.m)
}

func (cm *mdlConcurrentModel) slice(off, n int64) []byte {
	cm.mu.Lock()
	defer cm.mu.Unlock()
	return append([]byte(nil), cm.m.disk[off:off+n]...)
}

// mdlWorker runs n random operations on the bytes worker g owns and
// checks after each that they read back as the model says.
func mdlWorker(img *Image, cfg mdlConfig, lay *mdlLayout, cm *mdlConcurrentModel, g int, seed int64, n int) error {
	r := rand.New(rand.NewSource(seed))
	cs := lay.cs
	lo, hi := lay.own[g]*cs, min(lay.own[g+1]*cs, lay.size)
	check := func(what string, off, n int64) error {
		got := make([]byte, n)
		if _, err := img.ReadAt(ctx, got, off); err != nil {
			return fmt.Errorf("worker %d: %s: ReadAt(%d, %d): %v", g, what, off, n, err)
		}
		if d := mdlDiff(got, cm.slice(off, n), off, cs); d != "" {
			return fmt.Errorf("worker %d: %s: %s", g, what, d)
		}
		return nil
	}
	// randRange returns a range inside [a, b).
	randRange := func(a, b int64) (int64, int64) {
		switch r.Intn(3) {
		case 0: // whole clusters (a is cluster aligned in owned regions)
			if (b-a) >= cs && a%cs == 0 {
				c := r.Int63n((b - a) / cs)
				k := r.Int63n(min(4, (b-a)/cs-c)) + 1
				return a + c*cs, min(k*cs, b-a-c*cs)
			}
			fallthrough
		case 1:
			off := a + r.Int63n(b-a)
			return off, r.Int63n(min(b-off, cs)) + 1
		default:
			off := a + r.Int63n(b-a)
			return off, r.Int63n(min(b-off, 3*cs)) + 1
		}
	}
	for i := 0; i < n; i++ {
		shared := lay.shared1 > lay.shared0 && r.Intn(3) == 0
		var off, k int64
		if shared {
			c := lay.shared0 + r.Int63n(lay.shared1-lay.shared0)
			a, b := c*cs+lay.cut[g], c*cs+lay.cut[g+1]
			b = min(b, lay.size)
			if b <= a {
				continue
			}
			off, k = randRange(a, b)
		} else {
			if hi <= lo {
				continue
			}
			off, k = randRange(lo, hi)
		}
		var err error
		var what string
		switch op := r.Intn(10); {
		case op < 5:
			p := mdlFill(r.Intn(mdlFills), r.Uint64(), k)
			fua := r.Intn(8) == 0
			what = fmt.Sprintf("WriteAt(%d, %d, fua=%v)", off, k, fua)
			_, err = img.WriteAt(ctx, p, off, block.FUAIf(fua))
			cm.do(func(m *mdlModel) { m.write(p, off) })
		case op < 7:
			unmap := r.Intn(2) == 0
			what = fmt.Sprintf("WriteZeroes(%d, %d, mayUnmap=%v)", off, k, unmap)
			err = img.WriteZeroes(ctx, off, k, block.ZeroFlags(unmap, false))
			cm.do(func(m *mdlModel) { m.zero(off, k) })
		case op < 8:
			what = fmt.Sprintf("Discard(%d, %d)", off, k)
			err = img.Discard(ctx, off, k, 0)
			cm.do(func(m *mdlModel) { m.discard(off, k) })
		default:
			if shared || cfg.DataFile {
				continue
			}
			off = off / cs * cs
			k = min(cs, lay.size-off)
			p := mdlFill(r.Intn(mdlFills), r.Uint64(), k)
			what = fmt.Sprintf("WriteCompressed(%d, %d)", off, k)
			err = img.WriteCompressed(ctx, p, off)
			cm.do(func(m *mdlModel) { m.write(p, off) })
		}
		if err != nil {
			return fmt.Errorf("worker %d: %s: %v", g, what, err)
		}
		if err := check("after "+what, off, k); err != nil {
			return err
		}
	}
	// Everything this worker owns.
	if hi > lo {
		if err := check("final own region", lo, hi-lo); err != nil {
			return err
		}
	}
	for c := lay.shared0; c < lay.shared1; c++ {
		a, b := c*cs+lay.cut[g], min(c*cs+lay.cut[g+1], lay.size)
		if b > a {
			if err := check("final shared stripe", a, b-a); err != nil {
				return err
			}
		}
	}
	return nil
}

func TestModelConcurrent(t *testing.T) {
	mdlCheckImages(t, 15, 4, "conc", func(rt *rapid.T, c mdlCase) {
		cfg, path := c.cfg, c.path
		fail := func(format string, args ...any) {
			rt.Helper()
			rt.Fatalf("%s\nconfig: %s", fmt.Sprintf(format, args...), cfg)
		}
		// Sometimes with random delays in file I/O, to vary the
		// interleavings, and tiny caches.
		o := mdlDrawOpenOptions(rt, cfg.ClusterSize)
		if jitter := rapid.IntRange(0, 2).Draw(rt, "io_jitter") == 0; jitter {
			o.OpenFile = func(name string, ro bool) (block.File, error) {
				f, err := block.OpenFile(name, ro)
				if err != nil {
					return nil, err
				}
				return &mdlJitterFile{File: f}, nil
			}
		}
		img, err := Open(path, o)
		if err != nil {
			fail("Open: %v", err)
		}
		closed := false
		defer func() {
			if !closed {
				img.Close()
			}
		}()

		cs, size := cfg.ClusterSize, cfg.Size
		workers := rapid.IntRange(2, 6).Draw(rt, "workers")
		nops := rapid.IntRange(20, 150).Draw(rt, "ops_per_worker")
		nclusters := (size + cs - 1) / cs
		lay := &mdlLayout{cs: cs, size: size}
		// Frozen, shared, then one owned region per worker.
		lay.frozen = min(rapid.Int64Range(0, 4).Draw(rt, "frozen"), nclusters/4)
		lay.shared0 = lay.frozen
		lay.shared1 = lay.shared0 + min(rapid.Int64Range(0, 8).Draw(rt, "shared"), nclusters/4)
		per := (nclusters - lay.shared1) / int64(workers)
		for g := 0; g <= workers; g++ {
			lay.own = append(lay.own, lay.shared1+int64(g)*per)
		}
		lay.own[workers] = nclusters
		lay.cut = []int64{0}
		for g := 1; g < workers; g++ {
			// Unaligned cuts; the same for every shared cluster.
			lo := lay.cut[g-1] + 1
			hi := cs * int64(g) / int64(workers)
			lay.cut = append(lay.cut, rapid.Int64Range(min(lo, hi), hi).Draw(rt, "cut"))
		}
		lay.cut = append(lay.cut, cs)
		rt.Logf("layout: %+v", *lay)

		cm := &mdlConcurrentModel{m: newMdlModel(cfg, c.bcontent)}
		if lay.frozen > 0 {
			n := min(lay.frozen*cs, size)
			p := mdlFill(0, rapid.Uint64().Draw(rt, "frozen_seed"), n)
			if _, err := img.WriteAt(ctx, p, 0, 0); err != nil {
				fail("frozen write: %v", err)
			}
			cm.m.write(p, 0)
		}

		seed := rapid.Int64().Draw(rt, "seed")
		var (
			wg      sync.WaitGroup
			errMu   sync.Mutex
			errs    []error
			stop    = make(chan struct{})
			bgWG    sync.WaitGroup
			addErr  = func(err error) { errMu.Lock(); errs = append(errs, err); errMu.Unlock() }
			frozenN = min(lay.frozen*cs, size)
		)
		frozen := append([]byte(nil), cm.m.disk[:frozenN]...)
		for g := 0; g < workers; g++ {
			wg.Add(1)
			go func(g int) {
				defer wg.Done()
				if err := mdlWorker(img, cfg, lay, cm, g, seed+int64(g), nops); err != nil {
					addErr(err)
				}
			}(g)
		}
		// Readers: the frozen region must read back exactly; anything else
		// must read without error.
		for rd := 0; rd < 2; rd++ {
			bgWG.Add(1)
			go func(rd int) {
				defer bgWG.Done()
				r := rand.New(rand.NewSource(seed ^ int64(rd+100)))
				for {
					select {
					case <-stop:
						return
					default:
					}
					if frozenN > 0 && r.Intn(2) == 0 {
						off := r.Int63n(frozenN)
						n := r.Int63n(frozenN-off) + 1
						got := make([]byte, n)
						if _, err := img.ReadAt(ctx, got, off); err != nil {
							addErr(fmt.Errorf("reader: ReadAt(%d, %d): %v", off, n, err))
							return
						}
						if d := mdlDiff(got, frozen[off:off+n], off, cs); d != "" {
							addErr(fmt.Errorf("reader: frozen region: %s", d))
							return
						}
						continue
					}
					off := r.Int63n(size)
					n := r.Int63n(min(size-off, 4*cs)) + 1
					if _, err := img.ReadAt(ctx, make([]byte, n), off); err != nil {
						addErr(fmt.Errorf("reader: ReadAt(%d, %d): %v", off, n, err))
						return
					}
					if _, err := block.FirstExtent(ctx, img, off, n); err != nil {
						addErr(fmt.Errorf("reader: Extent(%d, %d): %v", off, n, err))
						return
					}
				}
			}(rd)
		}
		// Flusher.
		bgWG.Add(1)
		go func() {
			defer bgWG.Done()
			for {
				select {
				case <-stop:
					return
				case <-time.After(time.Millisecond):
				}
				if err := img.Flush(ctx); err != nil {
					addErr(fmt.Errorf("flusher: %v", err))
					return
				}
			}
		}()
		wg.Wait()
		close(stop)
		bgWG.Wait()
		if len(errs) > 0 {
			fail("%d errors, first: %v", len(errs), errors.Join(errs...))
		}

		verify := func(what string) {
			rt.Helper()
			got := make([]byte, size)
			if _, err := img.ReadAt(ctx, got, 0); err != nil {
				fail("%s: ReadAt: %v", what, err)
			}
			if d := mdlDiff(got, cm.m.disk, 0, cs); d != "" {
				fail("%s: %s", what, d)
			}
		}
		verify("after workers")
		closed = true
		if err := img.Close(); err != nil {
			fail("Close: %v", err)
		}
		if err := mdlQemuCheck(path); err != nil {
			fail("%v", err)
		}
		img, err = Open(path, Options{})
		if err != nil {
			fail("reopen: %v", err)
		}
		closed = false
		verify("after reopen")
		closed = true
		if err := img.Close(); err != nil {
			fail("Close after reopen: %v", err)
		}
	})
}

// ---------------------------------------------------------------------------
// Reproductions of engine bugs found by the model tests. Those marked fixed
// stay as regression tests.

// TestReproCreateV3Cluster512WithBacking: Create of a v3 image with
// 512-byte clusters fails as soon as the header needs a backing file name,
// a backing format or a data file name, because Create always writes the
// 8-entry feature name table (400 bytes). qemu-img 7.2 creates these
// images (it writes no feature name table for clusters of 4 KiB or less).
// Fixed in f730ebc; kept as a regression test.
func TestReproCreateV3Cluster512WithBacking(t *testing.T) {
	for _, o := range []CreateOptions{
		{Size: 1 << 20, ClusterSize: 512, BackingFile: "base.raw", BackingFormat: "raw"},
		{Size: 1 << 20, ClusterSize: 512, DataFile: "data.raw"},
	} {
		dir := t.TempDir()
		if err := os.WriteFile(filepath.Join(dir, "base.raw"), make([]byte, 1<<20), 0o644); err != nil {
			t.Fatal(err)
		}
		path := filepath.Join(dir, "img.qcow2")
		if err := Create(path, o); err != nil {
			t.Errorf("Create(cluster_size=512 compat=1.1 backing=%q backing_fmt=%q data_file=%q): %v (qemu-img create succeeds)",
				o.BackingFile, o.BackingFormat, o.DataFile, err)
			continue
		}
		if err := mdlQemuCheck(path); err != nil {
			t.Error(err)
		}
	}
}

// TestReproCompressedRefcountBits1: with refcount_bits=1 a second
// compressed cluster cannot be packed into the host cluster that holds the
// first (its refcount would become 2). QEMU then starts a new host cluster
// (qcow2_alloc_bytes checks refcount == refcount_max); the engine fails
// the write with "refcount ... would overflow 1 bits".
// Fixed in f730ebc; kept as a regression test.
func TestReproCompressedRefcountBits1(t *testing.T) {
	for _, cs := range []int64{4096, 65536} {
		path := filepath.Join(t.TempDir(), "img.qcow2")
		if err := Create(path, CreateOptions{Size: 2 * cs, ClusterSize: cs, RefcountBits: 1}); err != nil {
			t.Fatal(err)
		}
		img, err := Open(path, Options{})
		if err != nil {
			t.Fatal(err)
		}
		p := bytes.Repeat([]byte{'a'}, int(cs))
		for c := int64(0); c < 2; c++ {
			if err := img.WriteCompressed(ctx, p, c*cs); err != nil {
				t.Errorf("cluster_size=%d refcount_bits=1: WriteCompressed(cluster %d): %v", cs, c, err)
			}
		}
		if err := img.Close(); err != nil {
			t.Error(err)
		}
		if err := mdlQemuCheck(path); err != nil {
			t.Error(err)
		}
	}
}

// TestReproPreallocRefcountBits64: Create with preallocation (metadata,
// falloc or full) and refcount_bits=64 never returns once the disk has at
// least one L2 table's worth of clusters (cluster_size/8). Preallocation
// allocates the data clusters of each L2 table as one contiguous run of
// cluster_size/8 clusters, which is exactly the number of clusters one
// 64-bit refcount block covers; allocRunLocked places each new refcount
// block inside the range it covers, so no such run is ever free and the
// search goes on forever (growing the refcount table as it goes).
// Fixed in f9471c0; kept as a regression test.
func TestReproPreallocRefcountBits64(t *testing.T) {
	for _, cs := range []int64{512, 4096} {
		path := filepath.Join(t.TempDir(), "img.qcow2")
		o := CreateOptions{Size: 2 * (cs / 8) * cs, ClusterSize: cs, RefcountBits: 64, Preallocation: PreallocMetadata}
		done := make(chan error, 1)
		go func() { done <- Create(path, o) }()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("Create(cluster_size=%d refcount_bits=64 preallocation=metadata size=%d): %v", cs, o.Size, err)
				continue
			}
			if err := mdlQemuCheck(path); err != nil {
				t.Error(err)
			}
		case <-time.After(5 * time.Second):
			// The goroutine is left running: Create cannot be stopped.
			t.Errorf("Create(cluster_size=%d refcount_bits=64 preallocation=metadata size=%d) has not returned after 5s", cs, o.Size)
		}
	}
}

// TestReproReadRacesClusterReuse: a read that mapped a cluster can read its
// host cluster after a concurrent writer replaced the mapping, a flush
// released the old host cluster and another write reused it. The reader
// then gets another guest cluster's data, or, for a compressed cluster, a
// decompression error. Expected: a read concurrent with writes to the same
// range returns old or new data, never an error or foreign data.
// Fixed in e22494f; kept as a regression test.
func TestReproReadRacesClusterReuse(t *testing.T) {
	const cs = 65536
	path := filepath.Join(t.TempDir(), "img.qcow2")
	if err := Create(path, CreateOptions{Size: 8 * cs, ClusterSize: cs}); err != nil {
		t.Fatal(err)
	}
	// Reads of whole clusters are slowed down to widen the window between
	// mapping and reading.
	img, err := Open(path, Options{OpenFile: func(name string, ro bool) (block.File, error) {
		f, err := block.OpenFile(name, ro)
		if err != nil {
			return nil, err
		}
		return &mdlSlowFile{File: f, min: 4096, delay: 2 * time.Millisecond}, nil
	}})
	if err != nil {
		t.Fatal(err)
	}
	defer img.Close()
	// Cluster 0 only ever holds bytes 1..200 (compressed or not); clusters
	// 1..7 only 0xee.
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var errMu sync.Mutex
	var first error
	fail := func(err error) {
		errMu.Lock()
		if first == nil {
			first = err
		}
		errMu.Unlock()
	}
	loop := func(f func(i int) error) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				if err := f(i); err != nil {
					fail(err)
					return
				}
			}
		}()
	}
	loop(func(i int) error { // rewrites cluster 0, freeing its old host cluster
		p := bytes.Repeat([]byte{byte(i%200 + 1)}, cs)
		if i%2 == 0 {
			return img.WriteCompressed(ctx, p, 0)
		}
		if err := img.Discard(ctx, 0, cs, 0); err != nil {
			return err
		}
		_, err := img.WriteAt(ctx, p, 0, 0)
		return err
	})
	loop(func(i int) error { // allocates and frees clusters 1..7
		c := int64(i%7 + 1)
		if err := img.Discard(ctx, c*cs, cs, 0); err != nil {
			return err
		}
		_, err := img.WriteAt(ctx, bytes.Repeat([]byte{0xee}, cs), c*cs, 0)
		return err
	})
	loop(func(int) error { return img.Flush(ctx) })
	loop(func(int) error { // reads cluster 0
		p := make([]byte, cs)
		if _, err := img.ReadAt(ctx, p, 0); err != nil {
			return fmt.Errorf("ReadAt(cluster 0): %w", err)
		}
		if i := bytes.IndexByte(p, 0xee); i >= 0 {
			return fmt.Errorf("ReadAt(cluster 0) returned byte 0xee at %d, written only to clusters 1..7", i)
		}
		return nil
	})
	deadline := time.After(time.Second)
	for done := false; !done; {
		select {
		case <-deadline:
			done = true
		case <-time.After(10 * time.Millisecond):
			errMu.Lock()
			done = first != nil
			errMu.Unlock()
		}
	}
	close(stop)
	wg.Wait()
	if first != nil {
		t.Fatal(first)
	}
}

// mdlSlowFile delays reads of at least min bytes, and writes of exactly
// the sizes in writes by the given durations.
type mdlSlowFile struct {
	block.File
	min    int
	delay  time.Duration
	writes map[int]time.Duration
}

func (f *mdlSlowFile) ReadAt(p []byte, off int64) (int, error) {
	if f.min > 0 && len(p) >= f.min {
		time.Sleep(f.delay)
	}
	return f.File.ReadAt(p, off)
}

func (f *mdlSlowFile) WriteAt(p []byte, off int64) (int, error) {
	if d, ok := f.writes[len(p)]; ok {
		time.Sleep(d)
	}
	return f.File.WriteAt(p, off)
}

// mdlJitterFile sleeps for a random few hundred microseconds before some
// reads and writes.
type mdlJitterFile struct {
	block.File
	mu sync.Mutex
	r  *rand.Rand
}

func (f *mdlJitterFile) pause() {
	f.mu.Lock()
	if f.r == nil {
		f.r = rand.New(rand.NewSource(time.Now().UnixNano()))
	}
	d := time.Duration(f.r.Intn(400)) * time.Microsecond
	skip := f.r.Intn(3) == 0
	f.mu.Unlock()
	if !skip {
		time.Sleep(d)
	}
}

func (f *mdlJitterFile) ReadAt(p []byte, off int64) (int, error) {
	f.pause()
	return f.File.ReadAt(p, off)
}

func (f *mdlJitterFile) WriteAt(p []byte, off int64) (int, error) {
	f.pause()
	return f.File.WriteAt(p, off)
}

// TestReproExtL2SubclusterLostWrite: with extended L2 entries, a write
// that also touches a subcluster that is not yet data takes the cluster's
// claim and rewrites every touched subcluster, re-reading the bytes it does
// not cover from the host cluster (fillOld, "same place" case). A
// concurrent write to other bytes of an already-allocated subcluster takes
// the fast path (no claim) and lands between that read and the write-back,
// which then overwrites it with the stale bytes: a completed write is lost.
// Expected: writes to disjoint byte ranges never undo each other.
func TestReproExtL2SubclusterLostWrite(t *testing.T) {
	const cs, sub = 65536, 2048
	path := filepath.Join(t.TempDir(), "img.qcow2")
	if err := Create(path, CreateOptions{Size: cs, ClusterSize: cs, ExtendedL2: true}); err != nil {
		t.Fatal(err)
	}
	// Writes are slowed down to widen the window: B's 1 KiB data write
	// (after its fast-path check) by 2 ms, A's write-back of two
	// subclusters by 4 ms.
	img, err := Open(path, Options{OpenFile: func(name string, ro bool) (block.File, error) {
		f, err := block.OpenFile(name, ro)
		if err != nil {
			return nil, err
		}
		return &mdlSlowFile{File: f, writes: map[int]time.Duration{1024: 2 * time.Millisecond, 2 * sub: 4 * time.Millisecond}}, nil
	}})
	if err != nil {
		t.Fatal(err)
	}
	defer img.Close()
	// Subcluster 0 becomes data. Writer B owns bytes [0, 1024), writer A
	// owns [1024, 2*sub).
	if _, err := img.WriteAt(ctx, make([]byte, sub), 0, 0); err != nil {
		t.Fatal(err)
	}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { // A: subcluster 1 back to zero, then a write across subclusters 0 and 1
		defer wg.Done()
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			if err := img.WriteZeroes(ctx, sub, sub, 0); err != nil {
				t.Error(err)
				return
			}
			if _, err := img.WriteAt(ctx, bytes.Repeat([]byte{0xaa}, 2*sub-1024), 1024, 0); err != nil {
				t.Error(err)
				return
			}
		}
	}()
	var lost error
	deadline := time.Now().Add(time.Second)
	for i := 0; time.Now().Before(deadline) && lost == nil; i++ {
		p := bytes.Repeat([]byte{byte(i%250 + 1)}, 1024)
		if _, err := img.WriteAt(ctx, p, 0, 0); err != nil {
			t.Fatal(err)
		}
		time.Sleep(6 * time.Millisecond) // let a concurrent write-back land
		got := make([]byte, 1024)
		if _, err := img.ReadAt(ctx, got, 0); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, p) {
			lost = fmt.Errorf("write %d of bytes [0, 1024) lost: reads %#x, want %#x (a concurrent write to bytes [1024, %d) rewrote them)", i, got[0], p[0], 2*sub)
		}
	}
	close(stop)
	wg.Wait()
	if lost != nil {
		t.Fatal(lost)
	}
}
