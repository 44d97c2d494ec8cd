package nbd

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"path/filepath"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ovis-storage/ovis/qcow2"
)

// Flood test parameters. The server is small on purpose: its limits are
// what the attackers run into.
const (
	floodSize       = 16 << 20 // export size
	floodGoodRegion = 1 << 20  // the well-behaved client's region: [0, 1 MiB)
	floodBadRegion  = 8 << 20  // attackers touch only [8 MiB, 16 MiB)
	floodPayload    = 2 << 20  // MaxPayload
	floodReadBufs   = 8 << 20  // MaxReadBufferBytes: less than the attackers could hold
	floodMaxConns   = 48
	floodValid      = 32 // attackers that complete a handshake
	floodOptions    = 8  // attackers that flood the handshake with options
	floodHolders    = floodMaxConns - 1 - floodValid - floodOptions
	floodOverLimit  = 64 // dialers once the server is full
	floodDuration   = 4 * time.Second
	floodMaxOp      = 2 * time.Second // the good client's latency bound
	floodMaxGrowth  = 56 << 20        // HeapInuse growth bound
)

// attack is one misbehaviour of a connection past its handshake. It
// returns when the server has closed the connection, the attack is over,
// or ctx is done.
type attack struct {
	name string
	// weight is how often it runs, relative to the others.
	weight int
	run    func(ctx context.Context, c net.Conn, r *rand.Rand) error
}

// TestFlood serves a qcow2 image to one well-behaved client while others
// flood the server: connections over the limit, option floods and
// stalled handshakes, and connections that complete a handshake and then
// send garbage, oversized and truncated requests, unknown commands, WRITE
// headers without their payload, and READs whose replies they never
// read. The good client's write/read/verify round trips must each finish
// within floodMaxOp, the server's HeapInuse must not grow by more than
// floodMaxGrowth, connections over the limit must be refused at once, and
// after Close no goroutine may be left.
func TestFlood(t *testing.T) {
	// Not parallel: the heap and the goroutines are measured for the
	// whole process.
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)

	path := filepath.Join(t.TempDir(), "flood.qcow2")
	if err := qcow2.Create(path, qcow2.CreateOptions{Size: floodSize}); err != nil {
		t.Fatal(err)
	}
	img, err := qcow2.Open(path, qcow2.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer img.Close()

	runtime.GC()
	goroutinesBefore := runtime.NumGoroutine()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	heapBefore := ms.HeapInuse

	var states [StateClosed + 1]atomic.Int64
	srv, err := New(Config{
		Exports:            FixedExports(Export{Device: img}),
		MaxConnections:     floodMaxConns,
		MaxPayload:         floodPayload,
		MaxReadBufferBytes: floodReadBufs,
		HandshakeTimeout:   2 * time.Second,
		IdleTimeout:        time.Second,
		ConnState:          func(_ net.Conn, s ConnState) { states[s].Add(1) },
		// Warnings only: the flood makes thousands of debug lines.
		Logger: slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelWarn})),
	})
	if err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(t.TempDir(), "flood.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(context.Background(), l) }()

	// The good client connects first, so that it has its slot.
	good := dialWire(t, "unix", sock)
	good.negotiate("", true, contextBaseAllocation)

	// The heap sampler: HeapInuse as it is (garbage included) and, every
	// fourth sample, right after a collection, which is what the server
	// holds.
	var peak, livePeak atomic.Uint64
	sampleDone := make(chan struct{})
	stopSampling := make(chan struct{})
	go func() {
		defer close(sampleDone)
		var ms runtime.MemStats
		for i := 0; ; i++ {
			live := i%4 == 0
			if live {
				runtime.GC()
			}
			runtime.ReadMemStats(&ms)
			peak.Store(max(peak.Load(), ms.HeapInuse))
			if live {
				livePeak.Store(max(livePeak.Load(), ms.HeapInuse))
			}
			select {
			case <-stopSampling:
				return
			case <-time.After(25 * time.Millisecond):
			}
		}
	}()

	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	var stats floodStats
	attacks := floodAttacks(&stats)
	// The attacks that try to pin memory run more often than the others.
	var schedule []int
	for i, a := range attacks {
		for range a.weight {
			schedule = append(schedule, i)
		}
	}
	dial := func() (net.Conn, error) {
		c, err := net.DialTimeout("unix", sock, time.Second)
		if err != nil {
			return nil, err
		}
		stop := context.AfterFunc(ctx, func() { c.Close() })
		return &stopConn{Conn: c, stop: stop}, nil
	}
	// Slot holders: stalled handshakes that fill the server up, so that
	// the dialers below are over the limit.
	for i := 0; i < floodHolders; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for ctx.Err() == nil {
				c, err := dial()
				if err != nil {
					pause(ctx, 10*time.Millisecond)
					continue
				}
				io.Copy(io.Discard, c) // until HandshakeTimeout or the end
				c.Close()
				stats.held.Add(1)
			}
		}()
	}
	// Option floods.
	for i := 0; i < floodOptions; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := rand.New(rand.NewPCG(seed, uint64(1000+i)))
			for ctx.Err() == nil {
				c, err := dial()
				if err != nil {
					pause(ctx, 10*time.Millisecond)
					continue
				}
				optionFlood(c, r)
				c.Close()
				stats.optionFloods.Add(1)
			}
		}()
	}
	// Valid handshakes, then an attack; again when the server hangs up.
	for i := 0; i < floodValid; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := rand.New(rand.NewPCG(seed, uint64(i)))
			for n := i; ctx.Err() == nil; n++ {
				c, err := dial()
				if err != nil {
					pause(ctx, 10*time.Millisecond)
					continue
				}
				a := attacks[schedule[n%len(schedule)]]
				if err := rawHandshake(c, n%2 == 0); err != nil {
					c.Close()
					pause(ctx, 10*time.Millisecond)
					continue
				}
				a.run(ctx, c, r)
				c.Close()
				stats.attack(a.name)
			}
		}()
	}
	// Wait until the server is full, then dial over the limit.
	deadline := time.Now().Add(5 * time.Second)
	for states[StateNew].Load()-states[StateClosed].Load() < floodMaxConns-4 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	var refusedMax atomic.Int64
	for i := 0; i < floodOverLimit; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for ctx.Err() == nil {
				start := time.Now()
				c, err := dial()
				if err != nil {
					pause(ctx, 10*time.Millisecond)
					continue
				}
				c.SetReadDeadline(time.Now().Add(5 * time.Second))
				var b [1]byte
				if _, err := c.Read(b[:]); err != nil {
					if errors.Is(err, io.EOF) {
						stats.refused.Add(1)
						d := int64(time.Since(start))
						for m := refusedMax.Load(); d > m && !refusedMax.CompareAndSwap(m, d); m = refusedMax.Load() {
						}
					}
				} else {
					// Admitted because an attacker's slot came free:
					// stall the handshake like a holder.
					io.Copy(io.Discard, c)
				}
				c.Close()
				pause(ctx, 20*time.Millisecond)
			}
		}()
	}

	// The good client: write, read back, verify; flush now and then.
	r := rand.New(rand.NewPCG(seed, 99))
	model := make([]byte, floodGoodRegion)
	var ops int
	var slowest time.Duration
	end := time.Now().Add(floodDuration)
	for handle := uint64(1); time.Now().Before(end); handle += 2 {
		n := 512 + r.IntN(64<<10)
		off := r.IntN(floodGoodRegion - n)
		data := junkAt(r, n)
		start := time.Now()
		good.c.SetDeadline(start.Add(floodMaxOp + 5*time.Second))
		good.request(0, cmdWrite, handle, uint64(off), uint32(n), data)
		if rep := good.mustReply(0, 0); rep.errno != 0 || rep.handle != handle {
			t.Fatalf("good write %d at %d: errno %v handle %d", n, off, rep.errno, rep.handle)
		}
		copy(model[off:], data)
		rn := 4096 + r.IntN(128<<10)
		roff := r.IntN(floodGoodRegion - rn)
		good.request(0, cmdRead, handle+1, uint64(roff), uint32(rn), nil)
		rep := good.mustReply(rn, uint64(roff))
		if rep.errno != 0 || rep.handle != handle+1 || !bytes.Equal(rep.data, model[roff:roff+rn]) {
			t.Fatalf("good read %d at %d: errno %v handle %d, data matches %v", rn, roff, rep.errno, rep.handle, bytes.Equal(rep.data, model[roff:roff+rn]))
		}
		if ops%16 == 15 {
			good.request(0, cmdFlush, handle+1, 0, 0, nil)
			if rep := good.mustReply(0, 0); rep.errno != 0 {
				t.Fatalf("good flush: %v", rep.errno)
			}
		}
		if d := time.Since(start); d > slowest {
			slowest = d
		}
		ops++
	}
	if slowest > floodMaxOp {
		t.Errorf("the good client's slowest round trip took %v, more than %v", slowest, floodMaxOp)
	}

	cancel()
	wg.Wait()
	close(stopSampling)
	<-sampleDone
	good.request(0, cmdDisc, 0, 0, 0, nil)
	if err := srv.Close(); err != nil {
		t.Errorf("Close: %v", err)
	}
	if err := <-served; err != ErrServerClosed {
		t.Errorf("Serve: %v", err)
	}
	good.c.Close()

	t.Logf("good client: %d round trips, slowest %v; %s; refused over the limit: %d, slowest refusal %v; heap in use %d MiB before, peak %d MiB, peak after a collection %d MiB",
		ops, slowest, stats.String(), stats.refused.Load(), time.Duration(refusedMax.Load()), heapBefore>>20, peak.Load()>>20, livePeak.Load()>>20)
	t.Logf("connection states: new %d, negotiating %d, transmission %d, closed %d",
		states[StateNew].Load(), states[StateNegotiating].Load(), states[StateTransmission].Load(), states[StateClosed].Load())

	if growth := int64(livePeak.Load()) - int64(heapBefore); growth > floodMaxGrowth {
		t.Errorf("heap in use after a collection grew by %d MiB during the flood, more than %d MiB", growth>>20, floodMaxGrowth>>20)
	}
	if stats.refused.Load() == 0 {
		t.Errorf("no connection over the limit was refused")
	}
	if d := time.Duration(refusedMax.Load()); d > time.Second {
		t.Errorf("refusing a connection over the limit took %v", d)
	}
	for _, a := range attacks {
		if stats.count(a.name) == 0 {
			t.Errorf("attack %q never completed", a.name)
		}
	}
	if d := stats.slowestHangUp; d > 5*time.Second {
		t.Errorf("a stalled connection was hung up on only after %v (IdleTimeout 1s)", d)
	}
	if stats.optionFloods.Load() == 0 {
		t.Errorf("no option flood completed")
	}
	if n, c := states[StateNew].Load(), states[StateClosed].Load(); n != c {
		t.Errorf("ConnState: %d connections new, %d closed", n, c)
	}

	// Nothing left behind: every server and client goroutine ends.
	deadline = time.Now().Add(10 * time.Second)
	for runtime.NumGoroutine() > goroutinesBefore {
		if time.Now().After(deadline) {
			buf := make([]byte, 1<<20)
			t.Fatalf("%d goroutines after Close, %d before:\n%s", runtime.NumGoroutine(), goroutinesBefore, buf[:runtime.Stack(buf, true)])
		}
		time.Sleep(10 * time.Millisecond)
	}
	runtime.GC()
	runtime.GC()
	runtime.ReadMemStats(&ms)
	if growth := int64(ms.HeapInuse) - int64(heapBefore); growth > 16<<20 {
		t.Errorf("heap in use after Close is %d MiB above the start", growth>>20)
	}
}

// floodStats counts what the attackers managed.
type floodStats struct {
	mu      sync.Mutex
	attacks map[string]int
	// slowestHangUp is the longest a stalled connection waited for the
	// server to hang up.
	slowestHangUp time.Duration
	held          atomic.Int64
	optionFloods  atomic.Int64
	refused       atomic.Int64
}

func (s *floodStats) attack(name string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.attacks == nil {
		s.attacks = map[string]int{}
	}
	s.attacks[name]++
}

func (s *floodStats) hungUp(d time.Duration) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.slowestHangUp = max(s.slowestHangUp, d)
}

func (s *floodStats) count(name string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.attacks[name]
}

func (s *floodStats) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return fmt.Sprintf("attacks %v, slowest hang-up of a stalled connection %v, stalled handshakes %d, option floods %d",
		s.attacks, s.slowestHangUp, s.held.Load(), s.optionFloods.Load())
}

// stopConn is a client connection that ctx closes; Close also stops that.
type stopConn struct {
	net.Conn
	stop func() bool
}

func (c *stopConn) Close() error {
	c.stop()
	return c.Conn.Close()
}

// pause sleeps for d or until ctx is done.
func pause(ctx context.Context, d time.Duration) {
	select {
	case <-ctx.Done():
	case <-time.After(d):
	}
}

// rawHandshake negotiates the default export on c, with structured
// replies and base:allocation when structured is set. It is for goroutines
// that may not fail the test.
func rawHandshake(c net.Conn, structured bool) error {
	c.SetDeadline(time.Now().Add(5 * time.Second))
	defer c.SetDeadline(time.Time{})
	r := bufio.NewReader(c)
	var hello [18]byte
	if _, err := io.ReadFull(r, hello[:]); err != nil {
		return err
	}
	var contexts []string
	options := 1
	if structured {
		contexts = []string{contextBaseAllocation}
		options = 3
	}
	if _, err := c.Write(handshakeBytes("", structured, contexts...)); err != nil {
		return err
	}
	for range options {
		for {
			var h [20]byte
			if _, err := io.ReadFull(r, h[:]); err != nil {
				return err
			}
			typ := repType(binary.BigEndian.Uint32(h[12:16]))
			if _, err := io.CopyN(io.Discard, r, int64(binary.BigEndian.Uint32(h[16:20]))); err != nil {
				return err
			}
			if typ&repFlagError != 0 {
				return fmt.Errorf("option refused: %#x", uint32(typ))
			}
			if typ == repAck {
				break
			}
		}
	}
	if r.Buffered() != 0 {
		return errors.New("bytes after the handshake")
	}
	return nil
}

// optionFlood sends options without reading the replies until the server
// hangs up (HandshakeTimeout, an oversized option, or a full socket).
func optionFlood(c net.Conn, r *rand.Rand) {
	c.SetDeadline(time.Now().Add(5 * time.Second))
	go io.Copy(io.Discard, io.LimitReader(c, int64(r.IntN(1<<20)))) // read some replies, then stop
	var hello [18]byte
	io.ReadFull(c, hello[:])
	c.Write(binary.BigEndian.AppendUint32(nil, uint32(flagCFixedNewstyle|flagCNoZeroes)))
	for {
		var b []byte
		switch r.IntN(7) {
		case 0:
			b = optBytes(optList, nil)
		case 1:
			b = optBytes(optInfo, infoData("nope", infoName, infoDescription, 77))
		case 2:
			b = optBytes(optType(r.Uint32()), junkAt(r, r.IntN(4096)))
		case 3:
			b = optBytes(optStructuredReply, nil)
		case 4:
			b = optBytes(optListMetaContext, metaData("", "base:", "qemu:", "x:y"))
		case 5:
			// An option as long as allowed, of junk.
			h := binary.BigEndian.AppendUint64(nil, optsMagic)
			h = binary.BigEndian.AppendUint32(h, uint32(optSetMetaContext))
			h = binary.BigEndian.AppendUint32(h, maxOptionLen)
			if _, err := c.Write(h); err != nil {
				return
			}
			b = junkAt(r, maxOptionLen)
		case 6:
			if r.IntN(20) == 0 {
				// Longer than allowed: TOO_BIG, then the end.
				b = binary.BigEndian.AppendUint64(nil, optsMagic)
				b = binary.BigEndian.AppendUint32(b, uint32(optInfo))
				b = binary.BigEndian.AppendUint32(b, 1<<31)
			} else {
				b = optBytes(optGo, []byte{0, 0})
			}
		}
		if _, err := c.Write(b); err != nil {
			return
		}
	}
}

// junk is bytes the attackers send, made once so that the attackers
// allocate little: the heap is measured for the whole process.
var junk = pattern(42, 4*floodPayload)

// junkAt returns n bytes of junk starting at a random place.
func junkAt(r *rand.Rand, n int) []byte {
	off := r.IntN(len(junk) - n + 1)
	return junk[off : off+n]
}

// drain reads and drops everything the server sends on c; the channel is
// closed when the server has hung up.
func drain(c net.Conn) <-chan struct{} {
	done := make(chan struct{})
	go func() {
		defer close(done)
		io.Copy(io.Discard, c)
	}()
	return done
}

// stall waits until the server hangs up (hungUp closed) or ctx is done,
// and records how long the server took to hang up.
func stall(ctx context.Context, hungUp <-chan struct{}, stats *floodStats) {
	start := time.Now()
	select {
	case <-hungUp:
		stats.hungUp(time.Since(start))
	case <-ctx.Done():
	}
}

// floodAttacks are the misbehaviours of connections past their handshake.
// They touch only [floodBadRegion, floodSize).
func floodAttacks(stats *floodStats) []attack {
	badOff := func(r *rand.Rand) uint64 { return floodBadRegion + uint64(r.IntN(floodSize-floodBadRegion)) }
	return []attack{
		{"garbage", 1, func(ctx context.Context, c net.Conn, r *rand.Rand) error {
			hungUp := drain(c)
			_, err := c.Write(junkAt(r, 1+r.IntN(64<<10)))
			stall(ctx, hungUp, stats)
			return err
		}},
		{"garbage with magic", 1, func(ctx context.Context, c net.Conn, r *rand.Rand) error {
			// Random commands, flags and lengths, bytes between them.
			drain(c)
			for i := 0; i < 200 && ctx.Err() == nil; i++ {
				h := requestBytes(cmdFlags(r.Uint32()), cmdType(r.IntN(12)), r.Uint64(), badOff(r), uint32(r.IntN(2*floodPayload)))
				if _, err := c.Write(append(h, junkAt(r, r.IntN(64))...)); err != nil {
					return err
				}
			}
			return nil
		}},
		{"over the maximum", 1, func(ctx context.Context, c net.Conn, r *rand.Rand) error {
			hungUp := drain(c)
			for i := 0; i < 5 && ctx.Err() == nil; i++ {
				var b []byte
				b = append(b, requestBytes(0, cmdRead, 1, floodBadRegion, floodPayload+1+uint32(r.IntN(1<<30)))...)
				b = append(b, requestBytes(0, cmdWrite, 2, floodBadRegion, 4*floodPayload)...)
				if _, err := c.Write(b); err != nil {
					return err
				}
				if _, err := c.Write(junk); err != nil { // read and dropped
					return err
				}
				b = requestBytes(0, cmdTrim, 3, floodBadRegion, floodSize-floodBadRegion)
				b = append(b, requestBytes(0, cmdWriteZeroes, 4, floodBadRegion, floodSize-floodBadRegion)...)
				b = append(b, requestBytes(0, cmdBlockStatus, 5, floodBadRegion, floodSize-floodBadRegion)...)
				b = append(b, requestBytes(0, cmdCache, 6, floodBadRegion, floodSize-floodBadRegion)...)
				if _, err := c.Write(b); err != nil {
					return err
				}
			}
			// Too long to skip: the server replies and hangs up.
			_, err := c.Write(requestBytes(0, cmdWrite, 7, 0, 0xffffffff))
			stall(ctx, hungUp, stats)
			return err
		}},
		{"write header without payload", 2, func(ctx context.Context, c net.Conn, r *rand.Rand) error {
			hungUp := drain(c)
			_, err := c.Write(requestBytes(0, cmdWrite, 1, floodBadRegion, floodPayload))
			stall(ctx, hungUp, stats) // the idle timeout ends it
			return err
		}},
		{"partial write payload", 1, func(ctx context.Context, c net.Conn, r *rand.Rand) error {
			hungUp := drain(c)
			b := requestBytes(cmdFlagFUA, cmdWrite, 1, badOff(r)&^(floodPayload-1), floodPayload)
			if _, err := c.Write(b); err != nil {
				return err
			}
			_, err := c.Write(junkAt(r, r.IntN(floodPayload)))
			stall(ctx, hungUp, stats)
			return err
		}},
		{"truncated header", 1, func(ctx context.Context, c net.Conn, r *rand.Rand) error {
			hungUp := drain(c)
			h := requestBytes(0, cmdRead, 1, floodBadRegion, 4096)
			_, err := c.Write(h[:1+r.IntN(requestHeaderLen-1)])
			if r.IntN(2) == 0 {
				stall(ctx, hungUp, stats)
			}
			return err
		}},
		{"unknown commands", 1, func(ctx context.Context, c net.Conn, r *rand.Rand) error {
			drain(c)
			for i := 0; i < 500 && ctx.Err() == nil; i++ {
				typ := cmdType(8 + r.IntN(1<<16-8))
				if _, err := c.Write(requestBytes(cmdFlags(r.Uint32()), typ, uint64(i), r.Uint64(), r.Uint32())); err != nil {
					return err
				}
			}
			return nil
		}},
		{"unread replies", 5, func(ctx context.Context, c net.Conn, r *rand.Rand) error {
			// READs at the maximum whose replies are never read: the
			// replies block, and the idle timeout ends the connection,
			// which the next write notices.
			for i := 0; ctx.Err() == nil; i++ {
				if _, err := c.Write(requestBytes(0, cmdRead, uint64(i), floodBadRegion, floodPayload)); err != nil {
					return nil
				}
				if i >= 32 {
					pause(ctx, 50*time.Millisecond)
				}
			}
			return nil
		}},
	}
}
