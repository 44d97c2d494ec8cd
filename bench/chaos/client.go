package main

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

// Each client's VDI is cut into regions; a round rewrites one whole
// region with fio (every block once, crc32c headers) and verifies it.
const (
	regionSize = 16 << 20
	regions    = 4
	vdiSize    = regionSize * regions
)

// client is one VM-like writer: its own VDI, served by one node (its
// home), with fio run in that node's namespace.
type client struct {
	name string
	c    *cluster
	rep  *report
	rng  *rand.Rand // the client's own, seeded from the run's seed
	log  *os.File
	gate *sync.RWMutex // held shared during each fio run: checks wait for no write in flight

	home  *member
	known map[int]region // region → its last completed round
	round int
}

// region is what a completed round left in one region: fio's seed (for
// verify_only) and the SHA-256 of the bytes read back through the
// cluster right after. fio's verify_only checks every block's crc32c but
// would accept an intact block of an older round; the hash does not.
type region struct {
	seed uint64
	hash string // "" when no read-back succeeded
}

// fioArgs returns fio's arguments for region r written (or, verifyOnly,
// re-read and checked) with seed.
func (cl *client) fioArgs(uri string, r int, seed uint64, verifyOnly bool) []string {
	args := []string{"--name=" + cl.name, "--ioengine=nbd", "--uri=" + uri, "--rw=randwrite", "--bsrange=4k-64k",
		"--iodepth=4", fmt.Sprintf("--offset=%d", r*regionSize), fmt.Sprintf("--size=%d", regionSize),
		"--verify=crc32c", "--do_verify=1", fmt.Sprintf("--randseed=%d", seed), "--rate=,2m", "--group_reporting"}
	if verifyOnly {
		args = append(args, "--verify_only")
	}
	return args
}

// fioResult classifies one fio run.
type fioResult int

const (
	fioOK       fioResult = iota
	fioMismatch           // a verify failure: always wrong
	fioError              // an I/O error or a hang
)

// runFio runs fio in the home's namespace, up to 3 minutes, and returns
// its class and an excerpt of its output.
func (cl *client) runFio(ctx context.Context, home *member, args []string) (fioResult, string) {
	cl.gate.RLock()
	defer cl.gate.RUnlock()
	ctx, cancel := context.WithTimeout(ctx, 3*time.Minute)
	defer cancel()
	// fio's NBD engine can spin on a connection its server dropped: once
	// the home's process has been gone 15 s, fio is ended (an explained
	// error). A home cut off still runs, and may rejoin by itself: its
	// client gets 2 minutes to ride the partition out.
	d0, _ := cl.disturbance(home)
	cl.c.mu.Lock()
	p0 := home.proc
	cl.c.mu.Unlock()
	var hung atomic.Bool
	watched := make(chan struct{})
	go func() {
		defer close(watched)
		var since time.Time
		for {
			select {
			case <-ctx.Done():
				return
			case <-time.After(time.Second):
			}
			cl.c.mu.Lock()
			d, st, p := home.disturbed, home.state, home.proc
			cl.c.mu.Unlock()
			if d == d0 && st == "up" {
				continue
			}
			limit := 2 * time.Minute // the same process, cut off or back
			select {
			case <-p0.Exited():
				limit = 15 * time.Second
			default:
				if p != p0 {
					limit = 15 * time.Second
				}
			}
			if since.IsZero() {
				since = time.Now()
			} else if time.Since(since) > limit {
				hung.Store(true)
				cancel()
				return
			}
		}
	}()
	cmd := cl.c.nt.CommandContext(ctx, home.slot, "fio", args...)
	// fio forks its job: end the whole process group, not the parent only.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
	var buf capBuffer
	cmd.Stdout, cmd.Stderr = &buf, &buf
	cmd.WaitDelay = 10 * time.Second
	err := cmd.Run()
	cancel()
	out := buf.Bytes()
	<-watched
	fmt.Fprintf(cl.log, "=== %s fio %s (on %s): %v\n%s\n", time.Now().UTC().Format(time.RFC3339Nano), strings.Join(args, " "), home.name, err, out)
	if hung.Load() {
		return fioError, "fio still running long after its node went down: ended"
	}
	o := string(out)
	if strings.Contains(o, "verify:") || strings.Contains(o, "verify failed") || strings.Contains(o, "bad magic") || strings.Contains(o, "err=84") {
		return fioMismatch, excerpt(o, "verify")
	}
	if err != nil || !strings.Contains(o, "err= 0") {
		if ctx.Err() == context.DeadlineExceeded {
			return fioError, "hung for 3 minutes, killed"
		}
		return fioError, excerpt(o, "err=")
	}
	return fioOK, ""
}

// excerpt returns the lines of o that mention key, or o's end.
func excerpt(o, key string) string {
	var lines []string
	for _, l := range strings.Split(o, "\n") {
		if strings.Contains(l, key) || strings.HasPrefix(l, "fio:") {
			lines = append(lines, strings.TrimSpace(l))
		}
		if len(lines) == 4 {
			break
		}
	}
	if len(lines) == 0 {
		return strings.Join(strings.Fields(o[max(0, len(o)-300):]), " ")
	}
	return strings.Join(lines, " | ")
}

// awaitHome returns the client's home once it is up, moving the client
// to another node when its home has left. It returns nil when ctx ends.
func (cl *client) awaitHome(ctx context.Context) *member {
	for {
		cl.c.mu.Lock()
		h := cl.home
		st := h.state
		cl.c.mu.Unlock()
		if st == "up" {
			return h
		}
		if st == "left" {
			up := cl.c.byState("up")
			if len(up) > 0 {
				n := up[cl.rng.IntN(len(up))]
				cl.rep.event("client-move", "%s: its node %s left; now served by %s", cl.name, h.name, n.name)
				cl.c.mu.Lock()
				cl.home = n
				cl.c.mu.Unlock()
				continue
			}
		}
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(500 * time.Millisecond):
		}
	}
}

// disturbance returns how often m was disturbed and whether it is up.
func (cl *client) disturbance(m *member) (int, bool) {
	cl.c.mu.Lock()
	defer cl.c.mu.Unlock()
	return m.disturbed, m.state == "up"
}

// run writes rounds until stop ends; ctx ending kills fio at once.
func (cl *client) run(ctx, stop context.Context) {
	for stop.Err() == nil {
		home := cl.awaitHome(stop)
		if home == nil {
			return
		}
		r := cl.round % regions
		cl.round++
		seed := cl.rng.Uint64() >> 1
		d0, _ := cl.disturbance(home)
		delete(cl.known, r) // the region is being overwritten
		res, ex := cl.runFio(ctx, home, cl.fioArgs(cl.c.nbdURI(home, cl.name), r, seed, false))
		d1, up := cl.disturbance(home)
		switch {
		case res == fioOK:
			h, via, err := cl.regionHash(ctx, r)
			if err != nil {
				cl.rep.info("no-read-back", "%s region %d: %v; re-verified by fio alone", cl.name, r, err)
			}
			cl.known[r] = region{seed, h}
			cl.rep.check("client-round", true, "%s round %d: region %d written and verified through %s, read back through %s", cl.name, cl.round, r, home.name, via)
		case res == fioMismatch:
			cl.rep.check("client-round", false, "%s round %d: region %d through %s: VERIFY MISMATCH: %s", cl.name, cl.round, r, home.name, ex)
		case d1 != d0 || !up:
			cl.rep.expected("client-error-own-node-down", "%s round %d: region %d through %s failed while its node was down: %s", cl.name, cl.round, r, home.name, ex)
			if ctx.Err() != nil {
				return
			}
			cl.reverify(ctx, stop, "after its node came back")
		default:
			cl.rep.check("client-round", false, "%s round %d: region %d through %s failed with its node up: %s", cl.name, cl.round, r, home.name, ex)
			select { // no storm of failing rounds
			case <-ctx.Done():
				return
			case <-time.After(5 * time.Second):
			}
			cl.reverify(ctx, stop, "after an error")
		}
	}
}

// reverify re-reads every region completed before, through the home
// once it is up again, until a run is not cut short by its node going
// down. It reports whether all verified; it gives up (false) when stop
// ends while the home is down.
func (cl *client) reverify(ctx, stop context.Context, why string) bool {
	for {
		// A home that is down when the chaos ends returns after the rounds
		// have ended: the final re-verification covers it then.
		home := cl.awaitHome(stop)
		if home == nil {
			return false
		}
		d0, _ := cl.disturbance(home)
		ok, interrupted := true, false
		var regs []string
		for r := range regions {
			reg, known := cl.known[r]
			if !known {
				continue
			}
			regs = append(regs, fmt.Sprint(r))
			res, ex := cl.runFio(ctx, home, cl.fioArgs(cl.c.nbdURI(home, cl.name), r, reg.seed, true))
			if res == fioOK {
				if reg.hash == "" {
					continue
				}
				h, via, err := cl.regionHash(ctx, r)
				switch {
				case err != nil:
					cl.rep.info("no-read-back", "%s region %d: %v; re-verified by fio alone", cl.name, r, err)
				case h != reg.hash:
					cl.rep.check("client-reverify", false, "%s re-verify %s, region %d read through %s: CONTENT CHANGED: sha256 %s, was %s after its round (blocks pass crc32c: an older round's data?)", cl.name, why, r, via, h[:16], reg.hash[:16])
					ok = false
					delete(cl.known, r)
				}
				continue
			}
			d1, up := cl.disturbance(home)
			if res == fioError && (d1 != d0 || !up) {
				cl.rep.expected("client-error-own-node-down", "%s re-verify of region %d through %s failed while its node was down: %s", cl.name, r, home.name, ex)
				interrupted = true
				break
			}
			what := "failed"
			if res == fioMismatch {
				what = "VERIFY MISMATCH"
			}
			cl.rep.check("client-reverify", false, "%s re-verify %s, region %d through %s: %s: %s", cl.name, why, r, home.name, what, ex)
			ok = false
			delete(cl.known, r)
		}
		if interrupted {
			if ctx.Err() != nil {
				return false
			}
			continue
		}
		if ok {
			cl.rep.check("client-reverify", true, "%s re-verify %s: regions [%s] through %s verify", cl.name, why, strings.Join(regs, " "), home.name)
		}
		return ok
	}
}

func newClient(c *cluster, rep *report, gate *sync.RWMutex, name string, home *member, seed uint64) (*client, error) {
	f, err := os.Create(filepath.Join(c.base, name+"-fio.log"))
	if err != nil {
		return nil, err
	}
	return &client{name: name, c: c, rep: rep, rng: rand.New(rand.NewPCG(seed, uint64(len(name)))), log: f, gate: gate, home: home, known: map[int]region{}}, nil
}

// regionHash reads region r of the client's VDI through an up node
// (ovis vdi read, from the root namespace) and returns its SHA-256 and
// the node's name. It tries up to three nodes: one may go down meanwhile.
func (cl *client) regionHash(ctx context.Context, r int) (hash, via string, err error) {
	up := cl.c.byState("up")
	cl.rng.Shuffle(len(up), func(i, j int) { up[i], up[j] = up[j], up[i] })
	for _, m := range up[:min(3, len(up))] {
		var b []byte
		b, err = cl.c.adminBytes(ctx, cl.c.nodeAddr(m), "vdi", "read", cl.name, fmt.Sprint(r*regionSize), fmt.Sprint(regionSize))
		if err == nil && len(b) != regionSize {
			err = fmt.Errorf("vdi read gave %d bytes, want %d", len(b), regionSize)
		}
		if err == nil {
			sum := sha256.Sum256(b)
			return hex.EncodeToString(sum[:]), m.name, nil
		}
	}
	if err == nil {
		err = errors.New("no node is up")
	}
	return "", "", fmt.Errorf("reading region %d back: %w", r, err)
}

// capBuffer keeps the first and the last 32 KiB written to it: a fio
// spinning on a dead connection prints the same error without end.
type capBuffer struct {
	mu         sync.Mutex
	head, tail []byte
	dropped    int64
}

const capHalf = 32 << 10

func (b *capBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	n := len(p)
	if room := capHalf - len(b.head); room > 0 {
		k := min(room, len(p))
		b.head = append(b.head, p[:k]...)
		p = p[k:]
	}
	b.tail = append(b.tail, p...)
	if over := len(b.tail) - capHalf; over > 0 {
		b.dropped += int64(over)
		b.tail = append(b.tail[:0], b.tail[over:]...)
	}
	return n, nil
}

// Bytes returns the head, a note of what was dropped, and the tail.
func (b *capBuffer) Bytes() []byte {
	b.mu.Lock()
	defer b.mu.Unlock()
	out := append([]byte(nil), b.head...)
	if b.dropped > 0 {
		out = fmt.Appendf(out, "\n[... %d bytes dropped ...]\n", b.dropped)
	}
	return append(out, b.tail...)
}
