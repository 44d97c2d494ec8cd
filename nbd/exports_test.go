package nbd

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
)

// Tests in this file serve exports found at run time (Exports), as a
// cluster's changing set of disks would be.

// mapExports is an Exports whose set the test changes while the server
// runs. Each lookup returns a fresh *Export, as an implementation that
// builds its exports on demand does.
type mapExports struct {
	mu    sync.Mutex
	order []string
	m     map[string]Export
	// fail makes Lookup of that name fail with an error other than
	// ErrUnknownExport; listFail makes List fail.
	fail     map[string]error
	listFail error
	// hang makes Lookup wait until its context ends.
	hang bool
}

func newMapExports(exps ...Export) *mapExports {
	x := &mapExports{m: map[string]Export{}, fail: map[string]error{}}
	for _, e := range exps {
		x.put(e)
	}
	return x
}

func (x *mapExports) put(e Export) {
	x.mu.Lock()
	defer x.mu.Unlock()
	if _, ok := x.m[e.Name]; !ok {
		x.order = append(x.order, e.Name)
	}
	x.m[e.Name] = e
}

func (x *mapExports) remove(name string) {
	x.mu.Lock()
	defer x.mu.Unlock()
	delete(x.m, name)
	x.order = slices.DeleteFunc(x.order, func(n string) bool { return n == name })
}

func (x *mapExports) Lookup(ctx context.Context, name string) (*Export, error) {
	x.mu.Lock()
	hang, err := x.hang, x.fail[name]
	e, ok := x.m[name]
	x.mu.Unlock()
	switch {
	case hang:
		<-ctx.Done()
		return nil, ctx.Err()
	case err != nil:
		return nil, err
	case !ok:
		return nil, fmt.Errorf("no %q: %w", name, ErrUnknownExport)
	}
	return &e, nil
}

func (x *mapExports) List(ctx context.Context) ([]*Export, error) {
	x.mu.Lock()
	defer x.mu.Unlock()
	if x.listFail != nil {
		return nil, x.listFail
	}
	var out []*Export
	for _, n := range x.order {
		e := x.m[n]
		out = append(out, &e)
	}
	return out, nil
}

// listNames sends NBD_OPT_LIST and returns the names listed, or the error
// reply's type and message.
func (w *wireClient) listNames() ([]string, repType, string) {
	w.t.Helper()
	w.sendOpt(optList, nil)
	var names []string
	for _, r := range w.replies() {
		switch {
		case r.typ&repFlagError != 0:
			return names, r.typ, string(r.data)
		case r.typ == repServer:
			n := binary.BigEndian.Uint32(r.data)
			names = append(names, string(r.data[4:4+n]))
		}
	}
	return names, repAck, ""
}

// info sends NBD_OPT_INFO for name and returns the export's size, or the
// error reply's type and message.
func (w *wireClient) info(name string) (uint64, repType, string) {
	w.t.Helper()
	w.sendOpt(optInfo, infoData(name))
	var size uint64
	for _, r := range w.replies() {
		switch {
		case r.typ&repFlagError != 0:
			return 0, r.typ, string(r.data)
		case r.typ == repInfo && binary.BigEndian.Uint16(r.data) == uint16(infoExport):
			size = binary.BigEndian.Uint64(r.data[2:10])
		}
	}
	return size, repAck, ""
}

// goAfterHello sends NBD_OPT_GO for name on a connection past its greeting
// and returns the export's size.
func (w *wireClient) goAfterHello(name string) uint64 {
	w.t.Helper()
	w.sendOpt(optGo, infoData(name))
	var size uint64
	for _, r := range w.replies() {
		switch {
		case r.typ&repFlagError != 0:
			w.t.Fatalf("GO %q: error %#x: %s", name, r.typ, r.data)
		case r.typ == repInfo && binary.BigEndian.Uint16(r.data) == uint16(infoExport):
			size = binary.BigEndian.Uint64(r.data[2:10])
		}
	}
	return size
}

// TestExportsAtRunTime: an export added while the server runs is served
// and listed from then on, one removed is refused to new clients in
// qemu-nbd's words while a connection already on it goes on, and the
// empty name gets the first export listed unless ExactNames.
func TestExportsAtRunTime(t *testing.T) {
	t.Parallel()
	a, _ := newRawDevice(t, 64<<10, false)
	late, _ := newRawDevice(t, 128<<10, false)
	x := newMapExports(Export{Name: "a", Device: a})
	_, sock := startWire(t, Config{Exports: x})

	w := dialWire(t, "unix", sock)
	w.hello(flagCFixedNewstyle | flagCNoZeroes)
	if _, typ, msg := w.info("late"); typ != repErrUnknown || msg != "export 'late' not present" {
		t.Errorf("INFO before the export exists: %#x %q, want NBD_REP_ERR_UNKNOWN \"export 'late' not present\"", typ, msg)
	}
	x.put(Export{Name: "late", Device: late})
	if names, typ, _ := w.listNames(); typ != repAck || !slices.Equal(names, []string{"a", "late"}) {
		t.Errorf("LIST after the export was added: %q (%#x), want a, late", names, typ)
	}
	if size, typ, msg := w.info("late"); typ != repAck || size != 128<<10 {
		t.Errorf("INFO once the export exists: size %d, %#x %q", size, typ, msg)
	}
	if size := w.goAfterHello("late"); size != 128<<10 {
		t.Fatalf("GO late: size %d", size)
	}

	x.remove("late")
	w2 := dialWire(t, "unix", sock)
	w2.hello(flagCFixedNewstyle | flagCNoZeroes)
	if _, typ, msg := w2.info("late"); typ != repErrUnknown || msg != "export 'late' not present" {
		t.Errorf("INFO after the export was removed: %#x %q", typ, msg)
	}
	if size, typ, _ := w2.info(""); typ != repAck || size != 64<<10 {
		t.Errorf("INFO of the empty name: size %d (%#x), want the first export listed (65536)", size, typ)
	}
	// The connection on the removed export still serves it.
	w.request(0, cmdWrite, 1, 4096, 4096, pattern(1, 4096))
	if r := w.mustReply(0, 0); r.errno != 0 || r.handle != 1 {
		t.Errorf("WRITE on the removed export: %+v", r)
	}
	w.request(0, cmdRead, 2, 4096, 4096, nil)
	if r := w.mustReply(4096, 0); r.errno != 0 || string(r.data) != string(pattern(1, 4096)) {
		t.Errorf("READ on the removed export: %v", r.errno)
	}

	exact, _ := newRawDevice(t, 4096, false)
	_, sockExact := startWire(t, Config{Exports: newMapExports(Export{Name: "a", Device: exact}), ExactNames: true})
	w3 := dialWire(t, "unix", sockExact)
	w3.hello(flagCFixedNewstyle | flagCNoZeroes)
	if _, typ, msg := w3.info(""); typ != repErrUnknown || msg != "export '' not present" {
		t.Errorf("INFO of the empty name with ExactNames: %#x %q", typ, msg)
	}
}

// TestExportsFailures: a lookup that fails, a listing that fails and
// exports that could not be served are refused as not available, without
// the cause, and the handshake goes on.
func TestExportsFailures(t *testing.T) {
	t.Parallel()
	dev, _ := newRawDevice(t, 64<<10, false)
	x := newMapExports(
		Export{Name: "ok", Device: dev},
		Export{Name: "nodev"},
		Export{Name: "long description", Description: strings.Repeat("d", maxStringLen+1), Device: dev},
	)
	x.fail["broken"] = errors.New("directory unreachable")
	_, sock := startWire(t, Config{Exports: x})
	w := dialWire(t, "unix", sock)
	w.hello(flagCFixedNewstyle | flagCNoZeroes)
	for _, name := range []string{"broken", "nodev", "long description"} {
		_, typ, msg := w.info(name)
		if want := "export '" + name + "' not available"; typ != repErrUnknown || msg != want {
			t.Errorf("INFO %q: %#x %q, want NBD_REP_ERR_UNKNOWN %q", name, typ, msg, want)
		}
	}
	if names, typ, _ := w.listNames(); typ != repAck || !slices.Equal(names, []string{"ok"}) {
		t.Errorf("LIST: %q (%#x), want only the servable export", names, typ)
	}
	x.mu.Lock()
	x.listFail = errors.New("directory unreachable")
	x.mu.Unlock()
	if _, typ, msg := w.listNames(); typ != repErrUnknown || strings.Contains(msg, "unreachable") {
		t.Errorf("failed LIST: %#x %q, want NBD_REP_ERR_UNKNOWN without the cause", typ, msg)
	}
	if size := w.goAfterHello("ok"); size != 64<<10 {
		t.Errorf("GO after the failures: size %d", size)
	}
}

// TestExportsLookupBounded: a lookup that never answers is ended by the
// handshake timeout, and by Close.
func TestExportsLookupBounded(t *testing.T) {
	t.Parallel()
	dev, _ := newRawDevice(t, 4096, false)
	x := newMapExports(Export{Name: "a", Device: dev})
	x.hang = true
	const timeout = 300 * time.Millisecond
	s, sock, _ := serveUnix(t, Config{Exports: x, HandshakeTimeout: timeout})
	for _, stop := range []string{"handshake timeout", "Close"} {
		w := dialWire(t, "unix", sock)
		w.hello(flagCFixedNewstyle | flagCNoZeroes)
		w.sendOpt(optGo, infoData("a"))
		start := time.Now()
		if stop == "Close" {
			go func() {
				time.Sleep(timeout / 3)
				s.Close()
			}()
		}
		w.c.SetReadDeadline(time.Now().Add(10 * time.Second))
		io.Copy(io.Discard, w.r)
		if took := time.Since(start); took > timeout+margin {
			t.Errorf("%s: the connection ended %v after GO, want at most %v", stop, took, timeout+margin)
		}
	}
}

// TestExportsContextsCarryOver: with an Exports that returns a new
// *Export at each lookup, the contexts SET_META_CONTEXT selected apply to
// the GO on the same export, and are dropped when the export no longer
// offers them under the ids the client was given.
func TestExportsContextsCarryOver(t *testing.T) {
	t.Parallel()
	dev, _ := newRawDevice(t, 64<<10, false)
	clean := func(off, n int64) (int64, bool, error) { return n, false, nil }
	for _, tc := range []struct {
		name string
		// change is applied between SET_META_CONTEXT and GO.
		change *Export
		want   Errno
	}{
		{"unchanged", nil, 0},
		{"bitmap renamed", &Export{Name: "b", Device: dev, Bitmaps: []ExportBitmap{{Name: "other", Extent: clean}}}, EINVAL},
		// The ids of bitmaps do not depend on allocation depth.
		{"allocation depth dropped", &Export{Name: "b", Device: dev, NoAllocationDepth: true, Bitmaps: []ExportBitmap{{Name: "b0", Extent: clean}}}, 0},
		{"bitmap moved to another id", &Export{Name: "b", Device: dev, Bitmaps: []ExportBitmap{{Name: "new", Extent: clean}, {Name: "b0", Extent: clean}}}, EINVAL},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			x := newMapExports(Export{Name: "b", Device: dev, Bitmaps: []ExportBitmap{{Name: "b0", Extent: clean}}})
			_, sock := startWire(t, Config{Exports: x})
			w := dialWire(t, "unix", sock)
			w.hello(flagCFixedNewstyle | flagCNoZeroes)
			w.sendOpt(optStructuredReply, nil)
			w.replies()
			w.structured = true
			w.sendOpt(optSetMetaContext, metaData("b", "base:allocation", "qemu:dirty-bitmap:b0"))
			if r := w.replies(); len(r) != 3 || r[2].typ != repAck {
				t.Fatalf("SET_META_CONTEXT: %d replies", len(r))
			}
			if tc.change != nil {
				x.put(*tc.change)
			}
			w.sendOpt(optGo, infoData("b"))
			if r := w.replies(); r[len(r)-1].typ != repAck {
				t.Fatalf("GO: %#x", r[len(r)-1].typ)
			}
			w.request(0, cmdBlockStatus, 1, 0, 64<<10, nil)
			r := w.mustReply(0, 0)
			if r.errno != tc.want {
				t.Fatalf("BLOCK_STATUS: %v, want %v", r.errno, tc.want)
			}
			if tc.want == 0 && len(r.chunks) != 2 {
				t.Errorf("BLOCK_STATUS: %d chunks, want one per selected context", len(r.chunks))
			}
		})
	}
}
