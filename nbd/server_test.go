package nbd

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/ovis-storage/ovis/block"
)

// hookDevice is a fault-injection layer over a real device: each non-nil
// hook replaces the method it names.
type hookDevice struct {
	block.Device
	readAt  func(p []byte, off int64) (int, error)
	writeAt func(p []byte, off int64, fua bool) (int, error)
	extent  func(off, n int64) (block.Extent, error)
	flush   func() error
	discard func(off, n int64) error
	// writeZeroes sees the request's flags.
	writeZeroes func(off, n int64, f block.Flags) error
}

func (d *hookDevice) ReadAt(ctx context.Context, p []byte, off int64) (int, error) {
	if d.readAt != nil {
		return d.readAt(p, off)
	}
	return d.Device.ReadAt(ctx, p, off)
}

func (d *hookDevice) WriteAt(ctx context.Context, p []byte, off int64, f block.Flags) (int, error) {
	if d.writeAt != nil {
		return d.writeAt(p, off, f.Has(block.FUA))
	}
	return d.Device.WriteAt(ctx, p, off, f)
}

func (d *hookDevice) WriteZeroes(ctx context.Context, off, n int64, f block.Flags) error {
	if d.writeZeroes != nil {
		return d.writeZeroes(off, n, f)
	}
	return d.Device.WriteZeroes(ctx, off, n, f)
}

// Extents asks the extent hook run by run; a run of no length (the
// device bug the server must survive) ends the list there.
func (d *hookDevice) Extents(ctx context.Context, off, n int64, dst []block.Extent) ([]block.Extent, error) {
	if d.extent == nil {
		return d.Device.Extents(ctx, off, n, dst)
	}
	for end := off + n; off < end; {
		e, err := d.extent(off, end-off)
		if err != nil {
			return dst, err
		}
		dst = append(dst, e)
		if e.Length <= 0 {
			return dst, nil
		}
		off += e.Length
	}
	return dst, nil
}

func (d *hookDevice) Flush(ctx context.Context) error {
	if d.flush != nil {
		return d.flush()
	}
	return d.Device.Flush(ctx)
}

func (d *hookDevice) Discard(ctx context.Context, off, n int64, f block.Flags) error {
	if d.discard != nil {
		return d.discard(off, n)
	}
	return d.Device.Discard(ctx, off, n, f)
}

// TestDeviceErrors: device failures reach the client as the spec's
// errors, READ errors never follow data, and the connection goes on.
func TestDeviceErrors(t *testing.T) {
	t.Parallel()
	raw, _ := newRawDevice(t, wireSize, false)
	const bad = 512 << 10
	dev := &hookDevice{
		Device: raw,
		readAt: func(p []byte, off int64) (int, error) {
			if off+int64(len(p)) > bad {
				return 0, fmt.Errorf("disk: %w", syscall.EIO)
			}
			if off == 4096 && len(p) == 100 {
				return 50, nil // a short read without an error: a device bug
			}
			return raw.ReadAt(ctx, p, off)
		},
		writeAt: func(p []byte, off int64, fua bool) (int, error) {
			switch {
			case off >= bad:
				return 0, fmt.Errorf("disk: %w", syscall.EDQUOT)
			case off == 8192:
				return 0, block.ErrReadOnly
			case off == 12288:
				return 0, ENOMEM
			}
			return raw.WriteAt(ctx, p, off, block.FUAIf(fua))
		},
		extent: func(off, n int64) (block.Extent, error) {
			switch {
			case off >= bad:
				return block.Extent{}, syscall.EIO
			case off >= bad/2:
				return block.Extent{}, nil // zero length: a device bug
			}
			return block.Extent{Length: min(n, 128), Status: block.StatusHole | block.StatusZero, Depth: int(off / 128 % 3)}, nil
		},
		flush:   func() error { return errors.New("flush failed") },
		discard: func(off, n int64) error { return fmt.Errorf("no trim: %w", syscall.EOPNOTSUPP) },
	}
	_, sock := startWire(t, Config{Exports: FixedExports(Export{Device: dev})})
	for _, structured := range []bool{false, true} {
		w := dialWire(t, "unix", sock)
		if structured {
			w.negotiate("", true, contextBaseAllocation, contextAllocDepth)
		} else {
			w.negotiate("", false)
		}
		for i, c := range []struct {
			typ    cmdType
			off    uint64
			length uint32
			want   Errno
		}{
			{cmdRead, bad - 4096, 8192, EIO},
			{cmdRead, 4096, 100, EIO},
			{cmdWrite, bad, 512, ENOSPC},
			{cmdWrite, 8192, 512, EPERM},
			{cmdWrite, 12288, 512, ENOMEM},
			{cmdFlush, 0, 0, EIO},
			{cmdTrim, 0, 4096, 0},
		} {
			var payload []byte
			if c.typ == cmdWrite {
				payload = make([]byte, c.length)
			}
			w.request(0, c.typ, uint64(i), c.off, c.length, payload)
			readLen := 0
			if c.typ == cmdRead {
				readLen = int(c.length)
			}
			r := w.mustReply(readLen, c.off)
			if r.errno != c.want || r.handle != uint64(i) {
				t.Errorf("structured=%v %v at %d: errno %v, want %v", structured, c.typ, c.off, r.errno, c.want)
			}
			if c.want != 0 && structured && (len(r.chunks) != 1 || r.chunks[0].typ != replyTypeError) {
				t.Errorf("%v error reply has chunks %+v", c.typ, r.chunks)
			}
			if c.want != 0 && r.data != nil {
				t.Errorf("%v error reply carried data", c.typ)
			}
		}
		w.request(0, cmdRead, 50, 0, 8192, nil)
		if r := w.mustReply(8192, 0); r.errno != 0 || len(r.data) != 8192 {
			t.Fatalf("read after errors: %v", r.errno)
		}
		if !structured {
			continue
		}
		// Block status: a failing first lookup is an error; zero-length
		// extents become one data extent for the rest of the request.
		w.request(0, cmdBlockStatus, 60, bad, 4096, nil)
		if r := w.mustReply(0, 0); r.errno != EIO {
			t.Errorf("block status on failing extents: %v", r.errno)
		}
		w.request(0, cmdBlockStatus, 61, bad/2, 8192, nil)
		r := w.mustReply(0, 0)
		for _, c := range r.chunks {
			if got := c.payload[4:]; len(got) != 8 || binary.BigEndian.Uint32(got) != 8192 || binary.BigEndian.Uint32(got[4:]) != map[uint32]uint32{idBaseAllocation: 0, idAllocDepth: 1}[binary.BigEndian.Uint32(c.payload)] {
				t.Errorf("block status over zero-length extents: %x", c.payload)
			}
		}
		// Many small extents: capped, never past the request, depth
		// runs merged per context.
		w.request(0, cmdBlockStatus, 62, 0, bad/2, nil)
		r = w.mustReply(0, 0)
		for _, c := range r.chunks {
			var sum, n int
			for p := c.payload[4:]; len(p) > 0; p = p[8:] {
				sum += int(binary.BigEndian.Uint32(p))
				n++
			}
			id := binary.BigEndian.Uint32(c.payload)
			if sum != maxStatusExtents*128 || (id == idBaseAllocation && n != 1) || (id == idAllocDepth && n != maxStatusExtents) {
				t.Errorf("context %d: %d extents over %d bytes", id, n, sum)
			}
		}
		// A read whose extents fail is served as data.
		w.request(0, cmdRead, 63, bad/2-4096, 8192, nil)
		if r := w.mustReply(8192, bad/2-4096); r.errno != 0 || len(r.chunks) != 2 {
			t.Errorf("read over failing extents: %v, %d chunks", r.errno, len(r.chunks))
		}
	}
}

// TestOutOfOrder: a slow request does not hold back a fast one behind it.
func TestOutOfOrder(t *testing.T) {
	t.Parallel()
	raw, _ := newRawDevice(t, wireSize, false)
	release := make(chan struct{})
	dev := &hookDevice{Device: raw, readAt: func(p []byte, off int64) (int, error) {
		if off == 0 {
			<-release
		}
		return raw.ReadAt(ctx, p, off)
	}}
	_, sock := startWire(t, Config{Exports: FixedExports(Export{Device: dev})})
	w := dialWire(t, "unix", sock)
	w.negotiate("", false)
	w.request(0, cmdRead, 1, 0, 4096, nil)
	w.request(0, cmdRead, 2, 4096, 4096, nil)
	if r := w.mustReply(4096, 0); r.handle != 2 {
		t.Fatalf("first reply is for handle %d, want 2", r.handle)
	}
	close(release)
	if r := w.mustReply(4096, 0); r.handle != 1 {
		t.Fatalf("second reply is for handle %d, want 1", r.handle)
	}
}

// TestShutdownTimeout: Shutdown with requests stuck in the device gives
// up at its deadline, closes everything and reports the deadline.
func TestShutdownTimeout(t *testing.T) {
	t.Parallel()
	raw, _ := newRawDevice(t, wireSize, false)
	release := make(chan struct{})
	var once sync.Once
	stuck := make(chan struct{})
	dev := &hookDevice{Device: raw, readAt: func(p []byte, off int64) (int, error) {
		once.Do(func() { close(stuck) })
		<-release
		return raw.ReadAt(ctx, p, off)
	}}
	s, err := New(Config{Exports: FixedExports(Export{Device: dev}), Logger: testLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go s.Serve(context.Background(), l)
	w := dialWire(t, "tcp", l.Addr().String())
	w.negotiate("", false)
	w.request(0, cmdRead, 1, 0, 4096, nil)
	<-stuck
	// Released well after Shutdown gives up, so that a slow machine does
	// not let the reply out before the connection is closed.
	time.AfterFunc(2*time.Second, func() { close(release) })
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if err := s.Shutdown(ctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Shutdown: %v", err)
	}
	w.expectClosed()
	if err := s.Close(); err != ErrServerClosed {
		t.Errorf("Close after Shutdown: %v", err)
	}
}

// TestCloseAndLimits: connections over MaxConnections are closed at once;
// Close ends everything; Serve then returns ErrServerClosed.
func TestCloseAndLimits(t *testing.T) {
	t.Parallel()
	raw, _ := newRawDevice(t, wireSize, false)
	s, err := New(Config{Exports: FixedExports(Export{Device: raw}), MaxConnections: 1, Logger: testLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- s.Serve(context.Background(), l) }()
	first := dialWire(t, "tcp", l.Addr().String())
	first.negotiate("", false)
	second := dialWire(t, "tcp", l.Addr().String())
	second.expectClosed()
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	first.expectClosed()
	if err := <-served; err != ErrServerClosed {
		t.Errorf("Serve: %v", err)
	}
	if err := s.Close(); err != ErrServerClosed {
		t.Errorf("second Close: %v", err)
	}
	if err := s.Serve(context.Background(), l); err != ErrServerClosed {
		t.Errorf("Serve after Close: %v", err)
	}
}

// TestServeContext: canceling Serve's context stops that listener only.
func TestServeContext(t *testing.T) {
	t.Parallel()
	raw, _ := newRawDevice(t, wireSize, false)
	s, sock := startWire(t, Config{Exports: FixedExports(Export{Device: raw})})
	w := dialWire(t, "unix", sock)
	w.negotiate("", false)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() { served <- s.Serve(ctx, l) }()
	cancel()
	if err := <-served; !errors.Is(err, context.Canceled) {
		t.Errorf("Serve: %v", err)
	}
	w.request(0, cmdRead, 1, 0, 512, nil)
	if r := w.mustReply(512, 0); r.errno != 0 {
		t.Errorf("connection after another listener stopped: %v", r.errno)
	}
}

// TestFastZero: FAST_ZERO requests reach the device as NoFallback; those
// it can serve are served and those it refuses with block.ErrNoFallback
// fail with ENOTSUP, leaving the data alone.
func TestFastZero(t *testing.T) {
	t.Parallel()
	raw, _ := newRawDevice(t, wireSize, false)
	dev := &hookDevice{Device: raw}
	dev.writeZeroes = func(off, n int64, f block.Flags) error {
		if f.Has(block.NoFallback) && (f.Has(block.NoUnmap) || off%65536 != 0 || n%65536 != 0) {
			return block.ErrNoFallback
		}
		return raw.WriteZeroes(ctx, off, n, f)
	}
	_, sock := startWire(t, Config{Exports: FixedExports(Export{Device: dev})})
	w := dialWire(t, "unix", sock)
	w.negotiate("", false)
	data := pattern(11, 131072)
	w.request(0, cmdWrite, 1, 0, uint32(len(data)), data)
	w.mustReply(0, 0)
	for i, c := range []struct {
		flags  cmdFlags
		off    uint64
		length uint32
		want   Errno
	}{
		{cmdFlagFastZero, 4096, 4096, ENOTSUP},
		{cmdFlagFastZero | cmdFlagNoHole, 0, 65536, ENOTSUP},
		{cmdFlagFastZero, 65536, 65536, 0},
	} {
		w.request(c.flags, cmdWriteZeroes, uint64(i), c.off, c.length, nil)
		if r := w.mustReply(0, 0); r.errno != c.want {
			t.Errorf("write zeroes %+v: %v", c, r.errno)
		}
	}
	w.request(0, cmdRead, 9, 0, 131072, nil)
	r := w.mustReply(131072, 0)
	if !bytes.Equal(r.data[:65536], data[:65536]) || !bytes.Equal(r.data[65536:], make([]byte, 65536)) {
		t.Errorf("contents after fast zeroes are wrong")
	}
}
