package export

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/ovis-storage/ovis/block"
	"github.com/ovis-storage/ovis/qcow2"
)

// This file holds the wrappers to two promises, in every order they can
// be stacked in: the capabilities of the device beneath are found with
// block.As and still work, none is claimed that the device lacks; and
// each request's Flags reach the device changed only as the wrapper
// documents.

// wrapKind is one kind of wrapper of this package.
type wrapKind int

const (
	kindWritethrough wrapKind = iota // WithCacheMode without a write cache
	kindUnsafe                       // WithCacheMode(CacheUnsafe)
	kindPolicy                       // WithPolicy
	kindMetrics                      // (*Metrics).Wrap
	numKinds
)

// request is one request a test sends down a chain of wrappers.
type request struct {
	op    string // "write", "zero", "discard" or "flush"
	f     block.Flags
	zeros bool // a write's payload is all zeros
}

func (r request) String() string { return r.op + " " + r.f.String() }

// layer is one wrapper of a chain: how it wraps a device, and the model
// it is held to: what it makes of a request on its way down (false when
// the request goes no further).
type layer struct {
	name string
	kind wrapKind
	wrap func(block.Device) block.Device
	down func(request) (request, bool)
	reg  *prometheus.Registry // a metrics layer's own registry
}

// writethroughDown: without a write cache every write and zero write is
// sent with FUA.
func writethroughDown(r request) (request, bool) {
	if r.op == "write" || r.op == "zero" {
		r.f |= block.FUA
	}
	return r, true
}

// unsafeDown: unsafe drops FUA and flushes.
func unsafeDown(r request) (request, bool) {
	if r.op == "flush" {
		return r, false
	}
	r.f &^= block.FUA
	return r, true
}

// policyDown: detect-zeroes turns an all-zero write into a zero write
// that keeps only FUA and may unmap only under detect-zeroes=unmap;
// discard=ignore stops TRIM. Zero writes pass as they are, NoFallback
// included.
func policyDown(discard Discard, zeroes DetectZeroes) func(request) (request, bool) {
	return func(r request) (request, bool) {
		switch {
		case r.op == "write" && r.zeros && zeroes != DetectZeroesOff:
			f := r.f & block.FUA
			if zeroes != DetectZeroesUnmap {
				f |= block.NoUnmap
			}
			return request{op: "zero", f: f}, true
		case r.op == "discard" && discard == DiscardIgnore:
			return r, false
		}
		return r, true
	}
}

func passDown(r request) (request, bool) { return r, true }

// variants returns a maker of each layer of kind k, one per setting that
// wraps. Each call makes a new layer (a metrics layer has a fresh
// registry).
func variants(k wrapKind) []func() layer {
	var out []func() layer
	switch k {
	case kindWritethrough:
		for _, m := range []block.CacheMode{block.CacheWritethrough, block.CacheDirectSync} {
			out = append(out, func() layer {
				return layer{name: m.String(), kind: k, down: writethroughDown,
					wrap: func(d block.Device) block.Device { return WithCacheMode(d, m) }}
			})
		}
	case kindUnsafe:
		out = append(out, func() layer {
			return layer{name: "unsafe", kind: k, down: unsafeDown,
				wrap: func(d block.Device) block.Device { return WithCacheMode(d, block.CacheUnsafe) }}
		})
	case kindPolicy:
		for _, p := range []struct {
			d Discard
			z DetectZeroes
		}{
			{DiscardIgnore, DetectZeroesOff}, {DiscardIgnore, DetectZeroesOn}, {DiscardIgnore, DetectZeroesUnmap},
			{DiscardUnmap, DetectZeroesOn}, {DiscardUnmap, DetectZeroesUnmap},
		} {
			out = append(out, func() layer {
				return layer{name: fmt.Sprintf("policy(%v,%v)", p.d, p.z), kind: k, down: policyDown(p.d, p.z),
					wrap: func(d block.Device) block.Device { return WithPolicy(d, p.d, p.z) }}
			})
		}
	case kindMetrics:
		out = append(out, func() layer {
			reg := prometheus.NewRegistry()
			return layer{name: "metrics", kind: k, down: passDown, reg: reg, wrap: NewMetrics(reg).Wrap}
		})
	}
	return out
}

// chains returns the makers of every chain of wrappers, outermost first:
// every order of every non-empty set of kinds, and each kind nested
// twice, in every combination of the layers' variants.
func chains() [][]func() layer {
	var orders [][]wrapKind
	var permute func(prefix []wrapKind, used uint)
	permute = func(prefix []wrapKind, used uint) {
		if len(prefix) > 0 {
			orders = append(orders, slices.Clone(prefix))
		}
		for k := range numKinds {
			if used&(1<<k) == 0 {
				permute(append(prefix, k), used|1<<k)
			}
		}
	}
	permute(nil, 0)
	for k := range numKinds {
		orders = append(orders, []wrapKind{k, k})
	}
	var out [][]func() layer
	for _, o := range orders {
		combos := [][]func() layer{nil}
		for _, k := range o {
			var next [][]func() layer
			for _, c := range combos {
				for _, v := range variants(k) {
					next = append(next, append(slices.Clone(c), v))
				}
			}
			combos = next
		}
		out = append(out, combos...)
	}
	return out
}

// chain is a device wrapped in layers.
type chain struct {
	name   string
	layers []layer        // outermost first
	devs   []block.Device // devs[i] is what layers[i] returned
	top    block.Device
}

func build(d block.Device, makers []func() layer) chain {
	c := chain{layers: make([]layer, len(makers)), devs: make([]block.Device, len(makers))}
	var names []string
	for i, m := range makers {
		c.layers[i] = m()
		names = append(names, c.layers[i].name)
	}
	for i := len(makers) - 1; i >= 0; i-- {
		d = c.layers[i].wrap(d)
		c.devs[i] = d
	}
	c.name, c.top = strings.Join(names, "/"), d
	return c
}

// down returns what the device beneath the chain receives for r, or
// false when a layer stops it.
func (c chain) down(r request) (request, bool) {
	for _, l := range c.layers {
		var ok bool
		if r, ok = l.down(r); !ok {
			return r, false
		}
	}
	return r, true
}

// outerMetrics returns the index of the outermost metrics layer, or -1.
func (c chain) outerMetrics() int {
	return slices.IndexFunc(c.layers, func(l layer) bool { return l.kind == kindMetrics })
}

// readCounts returns the reads each metrics layer counted, in order.
func (c chain) readCounts(t *testing.T) []float64 {
	t.Helper()
	var out []float64
	for _, l := range c.layers {
		if l.reg == nil {
			continue
		}
		mfs, err := l.reg.Gather()
		if err != nil {
			t.Fatal(err)
		}
		n := -1.0
		for _, mf := range mfs {
			if mf.GetName() != "ovis_block_requests_total" {
				continue
			}
			for _, m := range mf.GetMetric() {
				for _, lp := range m.GetLabel() {
					if lp.GetName() == "op" && lp.GetValue() == OpRead {
						n = m.GetCounter().GetValue()
					}
				}
			}
		}
		if n < 0 {
			t.Fatalf("%s: no read counter", l.name)
		}
		out = append(out, n)
	}
	return out
}

// plainDevice is a device in memory with no optional interface, as a
// backend without capabilities looks to the wrappers. It logs the
// requests that reach it, and refuses NoFallback zero writes as a device
// that could zero only by writing zeros.
type plainDevice struct {
	data []byte
	log  []string
}

func (p *plainDevice) ReadAt(_ context.Context, b []byte, off int64) (int, error) {
	if err := block.CheckRange(off, int64(len(b)), p.Size()); err != nil {
		return 0, err
	}
	return copy(b, p.data[off:]), nil
}

func (p *plainDevice) WriteAt(_ context.Context, b []byte, off int64, f block.Flags) (int, error) {
	if err := block.CheckRange(off, int64(len(b)), p.Size()); err != nil {
		return 0, err
	}
	p.log = append(p.log, request{op: "write", f: f}.String())
	return copy(p.data[off:], b), nil
}

func (p *plainDevice) WriteZeroes(_ context.Context, off, n int64, f block.Flags) error {
	if err := block.CheckRange(off, n, p.Size()); err != nil {
		return err
	}
	p.log = append(p.log, request{op: "zero", f: f}.String())
	if f.Has(block.NoFallback) {
		return block.ErrNoFallback
	}
	clear(p.data[off : off+n])
	return nil
}

func (p *plainDevice) Discard(_ context.Context, off, n int64, f block.Flags) error {
	if err := block.CheckRange(off, n, p.Size()); err != nil {
		return err
	}
	p.log = append(p.log, request{op: "discard", f: f}.String())
	return nil
}

func (p *plainDevice) Flush(context.Context) error {
	p.log = append(p.log, request{op: "flush"}.String())
	return nil
}

func (p *plainDevice) Extents(_ context.Context, off, n int64, dst []block.Extent) ([]block.Extent, error) {
	if err := block.CheckRange(off, n, p.Size()); err != nil {
		return dst, err
	}
	if n == 0 {
		return dst, nil
	}
	return append(dst, block.Extent{Length: n, Depth: 1}), nil
}

func (p *plainDevice) Size() int64  { return int64(len(p.data)) }
func (p *plainDevice) Close() error { return nil }

const (
	devSize  = 4 << 20
	dataLen  = 64 << 10 // [0, dataLen) holds data
	holeOff  = dataLen  // [holeOff, holeOff+dataLen) was never written
	engineAt = 2 * dataLen
	probeLen = 4096
)

// pattern returns n bytes that differ from case to case and never read as
// zeros.
func pattern(seed, n int) []byte {
	p := make([]byte, n)
	for i := range p {
		p[i] = byte(seed*7 + i%251 + 1)
	}
	return p
}

// bottom is a device under test, what it can do, and what it must read.
type bottom struct {
	name string
	dev  block.Device
	want []byte
	path string // the file a Mapper names

	nowait bool         // a NoWaitReader
	mapper bool         // a block.Mapper
	raw    *block.Raw   // the device, if raw; src is what it copies from
	src    *block.Raw   //
	srcF   *os.File     // src's file, for each case's pattern
	img    *qcow2.Image // the device, if a qcow2 image
}

func newBottoms(t *testing.T) []*bottom {
	dir := t.TempDir()
	data := pattern(0, dataLen)
	want := func() []byte {
		w := make([]byte, devSize)
		copy(w, data)
		return w
	}

	plain := &plainDevice{data: want()}

	rawPath := filepath.Join(dir, "disk.raw")
	if err := os.WriteFile(rawPath, data, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(rawPath, devSize); err != nil {
		t.Fatal(err)
	}
	raw, err := block.OpenRaw(rawPath, false)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { raw.Close() })
	srcPath := filepath.Join(dir, "src.raw")
	srcF, err := os.Create(srcPath)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srcF.Close() })
	if err := srcF.Truncate(probeLen); err != nil {
		t.Fatal(err)
	}
	src, err := block.OpenRaw(srcPath, true)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { src.Close() })

	imgPath := filepath.Join(dir, "disk.qcow2")
	if err := qcow2.Create(imgPath, qcow2.CreateOptions{Size: devSize, ClusterSize: probeLen}); err != nil {
		t.Fatal(err)
	}
	img, err := qcow2.Open(imgPath, qcow2.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { img.Close() })
	if _, err := img.WriteAt(ctx, data, 0, 0); err != nil {
		t.Fatal(err)
	}

	return []*bottom{
		{name: "plain", dev: plain, want: want()},
		{name: "raw", dev: raw, want: want(), path: rawPath, nowait: true, mapper: true, raw: raw, src: src, srcF: srcF},
		{name: "qcow2", dev: img, want: want(), path: imgPath, nowait: true, mapper: true, img: img},
	}
}

// TestCapabilitiesSurviveWrappers wraps each kind of device in every
// chain of wrappers and checks that every capability the device has is
// found with block.As and works, and that none it lacks is claimed
// (metrics claims NoWaitReader on any device, and then serves nothing).
func TestCapabilitiesSurviveWrappers(t *testing.T) {
	all := chains()
	for _, b := range newBottoms(t) {
		if b.nowait {
			// The bottom serves the probes itself, or the chains
			// could not be expected to.
			for _, off := range []int64{0, holeOff} {
				if !block.ReadNoWait(b.dev, make([]byte, probeLen), off) {
					t.Fatalf("%s: ReadNoWait at %d fails on the bare device", b.name, off)
				}
			}
		}
		t.Run(b.name, func(t *testing.T) {
			for i, makers := range all {
				c := build(b.dev, makers)
				checkCapabilities(t, b, c, i)
				if t.Failed() {
					t.Fatalf("chain %s failed", c.name)
				}
			}
		})
	}
}

func checkCapabilities(t *testing.T, b *bottom, c chain, i int) {
	checkRead := func(what string, off, n int64) {
		t.Helper()
		got := make([]byte, n)
		if _, err := c.top.ReadAt(ctx, got, off); err != nil {
			t.Fatalf("%s: %s: ReadAt(%d, %d): %v", c.name, what, off, n, err)
		}
		if !bytes.Equal(got, b.want[off:off+n]) {
			t.Errorf("%s: %s: ReadAt(%d, %d) reads other bytes", c.name, what, off, n)
		}
	}
	checkRead("start", 0, 2*dataLen)

	// NoWaitReader.
	nr, ok := block.As[block.NoWaitReader](c.top)
	m := c.outerMetrics()
	before := c.readCounts(t)
	served := 0
	switch {
	case b.nowait:
		if !ok {
			t.Fatalf("%s: NoWaitReader lost", c.name)
		}
		if wantNR := b.dev.(block.NoWaitReader); m < 0 && nr != wantNR {
			t.Errorf("%s: As found a NoWaitReader other than the device's", c.name)
		} else if m >= 0 && nr != c.devs[m].(block.NoWaitReader) {
			t.Errorf("%s: As found a NoWaitReader other than the outer metrics", c.name)
		}
		for _, off := range []int64{0, holeOff} {
			for how, read := range map[string]func([]byte, int64) bool{
				"As": nr.ReadNoWait, "block.ReadNoWait": func(p []byte, off int64) bool { return block.ReadNoWait(c.top, p, off) },
			} {
				p := make([]byte, probeLen)
				if !read(p, off) {
					t.Errorf("%s: ReadNoWait through %s at %d not served", c.name, how, off)
					continue
				}
				served++
				if !bytes.Equal(p, b.want[off:off+probeLen]) {
					t.Errorf("%s: ReadNoWait through %s at %d reads other bytes", c.name, how, off)
				}
			}
		}
	case m >= 0:
		// Metrics counts ReadNoWait, so it has the method whatever is
		// beneath; over a device without one it serves nothing.
		if !ok {
			t.Fatalf("%s: metrics' NoWaitReader not found", c.name)
		}
		if nr.ReadNoWait(make([]byte, probeLen), 0) || block.ReadNoWait(c.top, make([]byte, probeLen), 0) {
			t.Errorf("%s: ReadNoWait served over a device that has none", c.name)
		}
	case ok:
		t.Errorf("%s: NoWaitReader claimed over a device that has none", c.name)
	}
	// Each metrics layer counts every read served through it.
	for k, n := range c.readCounts(t) {
		if n != before[k]+float64(served) {
			t.Errorf("%s: metrics layer %d counted %v no-wait reads, want %d", c.name, k, n-before[k], served)
		}
	}

	// Mapper.
	mp, ok := block.As[block.Mapper](c.top)
	switch {
	case b.mapper && !ok:
		t.Errorf("%s: Mapper lost", c.name)
	case b.mapper:
		if mp != b.dev.(block.Mapper) {
			t.Errorf("%s: As found a Mapper other than the device's", c.name)
		}
		got, err := mp.MapAt(ctx, 0, 2*dataLen)
		if err != nil {
			t.Fatalf("%s: MapAt: %v", c.name, err)
		}
		if !got.Present || !got.Data || got.Zero || got.Length <= 0 || got.Length > dataLen || got.File != b.path {
			t.Errorf("%s: MapAt(0) = %+v, want data of %s", c.name, got, b.path)
		}
		got, err = mp.MapAt(ctx, holeOff, dataLen)
		if err != nil {
			t.Fatalf("%s: MapAt: %v", c.name, err)
		}
		if got.Data || !got.Zero || got.Length != dataLen {
			t.Errorf("%s: MapAt(%d) = %+v, want %d bytes of zeros", c.name, holeOff, got, dataLen)
		}
	case ok:
		t.Errorf("%s: Mapper claimed over a device that has none", c.name)
	}

	// A raw file's copy offload.
	r, ok := block.As[*block.Raw](c.top)
	switch {
	case b.raw != nil && r != b.raw:
		t.Errorf("%s: As[*block.Raw] = %p, %v, want the device", c.name, r, ok)
	case b.raw != nil:
		p := pattern(i+1, probeLen)
		if _, err := b.srcF.WriteAt(p, 0); err != nil {
			t.Fatal(err)
		}
		if err := r.CopyFrom(b.src, 0, engineAt, probeLen); err != nil {
			t.Fatalf("%s: CopyFrom: %v", c.name, err)
		}
		copy(b.want[engineAt:], p)
		checkRead("after CopyFrom", engineAt, probeLen)
	case ok:
		t.Errorf("%s: *block.Raw claimed over a %s device", c.name, b.name)
	}

	// A qcow2 image's own operations: a compressed write, in a
	// cluster of its own (an image does not compress over a cluster it
	// has).
	img, ok := block.As[*qcow2.Image](c.top)
	switch {
	case b.img != nil && img != b.img:
		t.Errorf("%s: As[*qcow2.Image] = %p, %v, want the device", c.name, img, ok)
	case b.img != nil:
		off := engineAt + int64(i)*probeLen
		if off+probeLen > devSize {
			t.Fatalf("more chains than the image has clusters for")
		}
		p := bytes.Repeat([]byte{byte(i%255 + 1)}, probeLen)
		if err := img.WriteCompressed(ctx, p, off); err != nil {
			t.Fatalf("%s: WriteCompressed: %v", c.name, err)
		}
		copy(b.want[off:], p)
		checkRead("after WriteCompressed", off, probeLen)
	case ok:
		t.Errorf("%s: *qcow2.Image claimed over a %s device", c.name, b.name)
	}
}

// TestFlagsThroughWrappers sends requests with each combination of flags
// that matters down every chain of wrappers, and checks what reaches the
// device against the layers' model: writethrough adds FUA to writes and
// zero writes, unsafe removes FUA and drops flushes, detect-zeroes turns
// an all-zero write into a zero write with NoUnmap unless unmap,
// discard=ignore stops TRIM, and NoFallback reaches the device on a zero
// write through every wrapper, whose ErrNoFallback comes back.
func TestFlagsThroughWrappers(t *testing.T) {
	reqs := []request{
		{op: "write"},
		{op: "write", f: block.FUA},
		{op: "write", zeros: true},
		{op: "write", f: block.FUA, zeros: true},
		{op: "write", f: block.FUA | block.NoFallback | block.NoUnmap, zeros: true},
		{op: "zero"},
		{op: "zero", f: block.FUA},
		{op: "zero", f: block.NoUnmap},
		{op: "zero", f: block.NoFallback},
		{op: "zero", f: block.NoFallback | block.NoUnmap | block.FUA},
		{op: "discard"},
		{op: "discard", f: block.FUA},
		{op: "flush"},
	}
	const off, n = 4096, 8192
	for _, makers := range chains() {
		p := &plainDevice{data: make([]byte, 1<<20)}
		c := build(p, makers)
		for _, r := range reqs {
			p.log = nil
			var err error
			switch r.op {
			case "write":
				buf := pattern(1, n)
				if r.zeros {
					buf = make([]byte, n)
				}
				var k int
				if k, err = c.top.WriteAt(ctx, buf, off, r.f); err == nil && k != n {
					t.Errorf("%s: %v: wrote %d bytes, want %d", c.name, r, k, n)
				}
			case "zero":
				err = c.top.WriteZeroes(ctx, off, n, r.f)
			case "discard":
				err = c.top.Discard(ctx, off, n, r.f)
			case "flush":
				err = c.top.Flush(ctx)
			}
			var want []string
			got, reached := c.down(r)
			if reached {
				want = []string{got.String()}
			}
			if !slices.Equal(p.log, want) {
				t.Errorf("%s: %v (zeros %v): device got %q, want %q", c.name, r, r.zeros, p.log, want)
			}
			refused := reached && got.op == "zero" && got.f.Has(block.NoFallback)
			switch {
			case refused && !errors.Is(err, block.ErrNoFallback):
				t.Errorf("%s: %v: error %v, want ErrNoFallback", c.name, r, err)
			case !refused && err != nil:
				t.Errorf("%s: %v: %v", c.name, r, err)
			}
		}
	}
}

// TestWrappersForwardNoOptionalMethod: a wrapper implements Device, its
// own changes and Unwrap, and no optional interface of the device beneath
// (block.As finds those), but for metrics' counting ReadNoWait. Settings
// that change nothing return the device itself.
func TestWrappersForwardNoOptionalMethod(t *testing.T) {
	p := &plainDevice{data: make([]byte, 4096)}
	for k := range numKinds {
		for _, v := range variants(k) {
			l := v()
			w := l.wrap(p)
			if w == block.Device(p) {
				t.Errorf("%s: does not wrap", l.name)
				continue
			}
			if u, ok := w.(block.Wrapper); !ok || u.Unwrap() != block.Device(p) {
				t.Errorf("%s: Unwrap does not return the device", l.name)
			}
			if _, ok := w.(block.NoWaitReader); ok != (k == kindMetrics) {
				t.Errorf("%s: implements NoWaitReader: %v", l.name, ok)
			}
			if _, ok := w.(block.Mapper); ok {
				t.Errorf("%s: implements Mapper", l.name)
			}
			if _, ok := w.(interface {
				CopyFrom(*block.Raw, int64, int64, int64) error
			}); ok {
				t.Errorf("%s: implements CopyFrom", l.name)
			}
		}
	}
	for _, m := range []block.CacheMode{block.CacheWriteback, block.CacheNone} {
		if WithCacheMode(p, m) != block.Device(p) {
			t.Errorf("WithCacheMode(%v) wraps", m)
		}
	}
	if WithPolicy(p, DiscardUnmap, DetectZeroesOff) != block.Device(p) {
		t.Error("WithPolicy(unmap, off) wraps")
	}
}
