package main

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"io"
	mrand "math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ovis-storage/ovis/image"
	"github.com/ovis-storage/ovis/internal/testutil"
	"github.com/ovis-storage/ovis/qcow2"
)

// The kill test: `ovis nbd` is killed with SIGKILL at random moments while
// fio and a small client of the test's own write to it. After each kill,
// qemu-img check and ovis's Check must find no corruption (leaks are
// allowed: a crash may leak clusters, never corrupt), and every sector the
// client wrote must hold a value the crash allows: with writeback, the
// value as of the last completed FLUSH or one written after it; with
// writethrough, the last acknowledged write or the one in flight.

const (
	killImageSize = 16 << 20
	killRegion    = 4 << 20 // the test client's sectors: [0, 4 MiB)
	killFioOffset = 8 << 20 // fio's: [8 MiB, 16 MiB)
	killSector    = 512
	killSectors   = killRegion / killSector
)

// killRound is one server life: how it is started and how its image is
// checked.
type killRound struct {
	format string // qcow2 or raw
	cache  string // --cache
	image  string
	model  *killModel
}

// TestNBDKill runs 20 rounds: 16 over one qcow2 image with the default
// writeback cache, 2 over the same image with writethrough, and 2 over a
// raw image. The seed is printed; OVIS_KILL_SEED replays one.
func TestNBDKill(t *testing.T) {
	t.Parallel()
	seed := uint64(time.Now().UnixNano())
	if s := os.Getenv("OVIS_KILL_SEED"); s != "" {
		var err error
		if seed, err = strconv.ParseUint(s, 10, 64); err != nil {
			t.Fatalf("OVIS_KILL_SEED: %v", err)
		}
	}
	t.Logf("seed %d (OVIS_KILL_SEED=%d replays it)", seed, seed)
	r := mrand.New(mrand.NewPCG(seed, 7))

	dir := t.TempDir()
	qcowImage := filepath.Join(dir, "disk.qcow2")
	rawImage := filepath.Join(dir, "disk.raw")
	testutil.QemuImg(t, "create", "-q", "-f", "qcow2", qcowImage, strconv.Itoa(killImageSize))
	testutil.QemuImg(t, "create", "-q", "-f", "raw", rawImage, strconv.Itoa(killImageSize))
	qcowModel, rawModel := newKillModel(), newKillModel()
	var rounds []killRound
	for i := 0; i < 16; i++ {
		rounds = append(rounds, killRound{"qcow2", "writeback", qcowImage, qcowModel})
	}
	for i := 0; i < 2; i++ {
		rounds = append(rounds, killRound{"qcow2", "writethrough", qcowImage, qcowModel})
	}
	for i := 0; i < 2; i++ {
		rounds = append(rounds, killRound{"raw", "writeback", rawImage, rawModel})
	}
	var ids uint32
	for i, rd := range rounds {
		if !runKillRound(t, i, rd, r, &ids) {
			t.Fatalf("round %d (%s, --cache=%s) failed; seed %d", i, rd.format, rd.cache, seed)
		}
	}
}

// runKillRound starts the server, runs fio and the test client, kills the
// server after a random time, then checks the image and the client's
// sectors. It reports whether the round passed.
func runKillRound(t *testing.T, round int, rd killRound, r *mrand.Rand, ids *uint32) bool {
	t.Helper()
	s := startNBD(t, nbdRun{args: []string{"-t", "-e", "2", "-f", rd.format, "--cache", rd.cache, "--discard", "unmap", rd.image}})
	writethrough := rd.cache == "writethrough"

	fio := exec.Command("fio", "--name=load", "--ioengine=nbd", "--uri="+s.uri,
		"--rw=randwrite", "--bs=4k", "--iodepth=8", "--size=8M", "--offset="+strconv.Itoa(killFioOffset),
		"--verify=crc32c", "--do_verify=0", "--time_based", "--runtime=30")
	var fioOut syncBuffer
	fio.Stdout, fio.Stderr = &fioOut, &fioOut
	if err := fio.Start(); err != nil {
		t.Fatalf("fio: %v", err)
	}
	fioDone := make(chan error, 1)
	go func() { fioDone <- fio.Wait() }()

	dctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	c, err := dialNBD(dctx, "unix", s.addr, "")
	cancel()
	if err != nil {
		t.Fatalf("round %d: test client: %v\n%s", round, err, s.stderr)
	}
	clientSeed := r.Uint64()
	stats := make(chan killStats, 1)
	go func() { stats <- rd.model.drive(c, clientSeed, ids, writethrough) }()

	time.Sleep(time.Duration(200+r.IntN(1000)) * time.Millisecond)
	s.cmd.Process.Signal(syscall.SIGKILL)
	s.wait(20 * time.Second)
	st := <-stats
	c.c.Close()
	var nbdErr *nbdReplyError
	if errors.As(st.err, &nbdErr) {
		t.Errorf("round %d: the server failed a request before the kill: %v", round, st.err)
	}
	select {
	case <-fioDone:
	case <-time.After(20 * time.Second):
		fio.Process.Kill()
		<-fioDone
	}
	t.Logf("round %d (%s, --cache=%s): %d writes acknowledged, %d flushes, %d in flight at the kill; fio: %s",
		round, rd.format, rd.cache, st.writes, st.flushes, st.inFlight, fioSummary(fioOut.String()))

	ok := true
	if rd.format == "qcow2" {
		ok = checkKilled(t, round, rd.image)
	}
	return rd.model.verify(t, round, rd.image, rd.format) && ok
}

// fioSummary is fio's write line, or a note that it wrote nothing.
func fioSummary(out string) string {
	for _, l := range strings.Split(out, "\n") {
		if l = strings.TrimSpace(l); strings.HasPrefix(l, "write: IOPS=") {
			return l
		}
	}
	return "no summary (killed before its first report)"
}

// checkKilled runs qemu-img check and ovis's Check on a killed server's
// image: no corruption, no check error, and the two agree on the leaks.
func checkKilled(t *testing.T, round int, image string) bool {
	t.Helper()
	out, code := testutil.QemuImgExit(t, "check", "--output=json", "-f", "qcow2", image)
	if code != 0 && code != 3 {
		t.Errorf("round %d: qemu-img check: exit %d (2: corrupt, 1: check failed)\n%s", round, code, out)
		return false
	}
	var rep struct {
		Corruptions int `json:"corruptions"`
		Leaks       int `json:"leaks"`
		CheckErrors int `json:"check-errors"`
	}
	if err := json.Unmarshal([]byte(out[:strings.LastIndex(out, "}")+1]), &rep); err != nil {
		t.Errorf("round %d: qemu-img check report: %v\n%s", round, err, out)
		return false
	}
	img, err := qcow2.Open(image, qcow2.Options{ReadOnly: true})
	if err != nil {
		t.Errorf("round %d: ovis cannot open the killed server's image: %v", round, err)
		return false
	}
	defer img.Close()
	res, err := img.Check(ctx, qcow2.RepairNone)
	if err != nil {
		t.Errorf("round %d: ovis Check: %v", round, err)
		return false
	}
	if res.Corruptions != 0 || res.CheckErrors != 0 || res.Leaks != rep.Leaks {
		t.Errorf("round %d: ovis Check finds %d corruptions, %d errors, %d leaks; qemu-img check %d, %d, %d\n%s",
			round, res.Corruptions, res.CheckErrors, res.Leaks, rep.Corruptions, rep.CheckErrors, rep.Leaks, strings.Join(res.Messages, "\n"))
		return false
	}
	if res.Leaks != 0 {
		t.Logf("round %d: %d leaked clusters (allowed after a crash)", round, res.Leaks)
	}
	return true
}

// killModel is what the test client knows about its sectors. Write ids
// are unique over the whole test; 0 is a sector never written (zeros).
//
// durable[s] is the id the sector must hold if nothing was written to it
// since: as of the last completed FLUSH (writeback) or the last
// acknowledged write (writethrough). since[s] holds the ids written to it
// after that, acknowledged or not: any of them may have reached the disk.
type killModel struct {
	durable []uint32
	latest  []uint32
	since   [][]uint32
	// log describes the requests of the current round, for failures.
	log []killOp
}

// killOp is one request of the test client, as the failure report shows.
type killOp struct {
	what        string // WRITE, WRITE FUA, WRITE_ZEROES or FLUSH
	id          uint32
	first, n    int
	ok          bool
	when, after time.Duration
}

func newKillModel() *killModel {
	return &killModel{
		durable: make([]uint32, killSectors),
		latest:  make([]uint32, killSectors),
		since:   make([][]uint32, killSectors),
	}
}

type killStats struct {
	writes, flushes, inFlight int
	// err ended the client: the kill, or a refused request.
	err error
}

// drive writes and flushes until the connection breaks. Writes are of 1
// to 64 sectors at random sectors (one in three right after the previous
// one), one in eight with FUA; one request in
// six is instead a WRITE_ZEROES that may unmap (so that clusters are
// freed and allocated again across the kills); a FLUSH follows every 1
// to 8 requests, or in half the rounds every 1 to 64. The model is updated as each request is issued and
// completed; zeros are id 0.
func (m *killModel) drive(c *nbdConn, seed uint64, ids *uint32, writethrough bool) killStats {
	r := mrand.New(mrand.NewPCG(seed, 3))
	var st killStats
	m.log = m.log[:0]
	start := time.Now()
	gap := 8
	if r.IntN(2) == 0 {
		gap = 64
	}
	untilFlush := 1 + r.IntN(gap)
	next := 0 // the sector after the last write
	for {
		if untilFlush == 0 {
			m.log = append(m.log, killOp{what: "FLUSH", when: time.Since(start)})
			if err := c.flush(context.Background()); err != nil {
				st.err = err
				return st
			}
			m.log[len(m.log)-1].ok = true
			m.log[len(m.log)-1].after = time.Since(start)
			copy(m.durable, m.latest)
			clear(m.since)
			st.flushes++
			untilFlush = 1 + r.IntN(gap)
			continue
		}
		untilFlush--
		zero := r.IntN(6) == 0
		fua := !zero && r.IntN(8) == 0
		n := 1 + r.IntN(64)
		if zero {
			n = (1 + r.IntN(4)) * 128 // 64 KiB to 256 KiB
		}
		first := r.IntN(killSectors - n + 1)
		switch {
		case zero && r.IntN(2) == 0:
			first &^= 127 // cluster-aligned: whole clusters are freed
		case !zero && next+n <= killSectors && r.IntN(3) == 0:
			first = next // sequential, as a journal writes
		}
		next = first + n
		var id uint32
		if !zero {
			*ids++
			id = *ids
		}
		for s := first; s < first+n; s++ {
			m.since[s] = append(m.since[s], id)
		}
		what := "WRITE"
		switch {
		case zero:
			what = "WRITE_ZEROES"
		case fua:
			what = "WRITE FUA"
		}
		m.log = append(m.log, killOp{what: what, id: id, first: first, n: n, when: time.Since(start)})
		st.inFlight = 1
		var err error
		if zero {
			err = c.writeZeroes(context.Background(), uint64(first*killSector), uint32(n*killSector))
		} else {
			data := make([]byte, n*killSector)
			for i := 0; i < n; i++ {
				fillSector(data[i*killSector:(i+1)*killSector], id, first+i)
			}
			err = c.write(context.Background(), uint64(first*killSector), data, fua)
		}
		if err != nil {
			st.err = err
			return st
		}
		st.inFlight = 0
		st.writes++
		m.log[len(m.log)-1].ok = true
		m.log[len(m.log)-1].after = time.Since(start)
		for s := first; s < first+n; s++ {
			m.latest[s] = id
			if writethrough || fua {
				m.durable[s] = id
				m.since[s] = nil
			}
		}
	}
}

// fillSector writes the content of sector s as written by write id: a
// header naming both, then bytes derived from them.
func fillSector(b []byte, id uint32, s int) {
	copy(b, "OVKT")
	binary.BigEndian.PutUint32(b[4:8], id)
	binary.BigEndian.PutUint64(b[8:16], uint64(s))
	for i := 16; i < len(b); i++ {
		b[i] = byte(uint32(i)*13 + id*7 + uint32(s)*3)
	}
}

// sectorID returns the write id a sector's content is from: 0 for zeros,
// -1 for anything no write produced.
func sectorID(b []byte, s int) int64 {
	if bytes.Equal(b, make([]byte, len(b))) {
		return 0
	}
	if string(b[:4]) != "OVKT" {
		return -1
	}
	id := binary.BigEndian.Uint32(b[4:8])
	want := make([]byte, len(b))
	fillSector(want, id, s)
	if !bytes.Equal(b, want) {
		return -1
	}
	return int64(id)
}

// verify reads the client's region of the image with ovis's engine and
// checks every sector against the model; then the model takes what is on
// disk as the new durable state, since the next round starts from it.
func (m *killModel) verify(t *testing.T, round int, file, format string) bool {
	t.Helper()
	dev, err := image.Open(file, format, qcow2.Options{ReadOnly: true})
	if err != nil {
		t.Errorf("round %d: open %s: %v", round, file, err)
		return false
	}
	defer dev.Close()
	buf := make([]byte, killRegion)
	if _, err := dev.ReadAt(ctx, buf, 0); err != nil && !errors.Is(err, io.EOF) {
		t.Errorf("round %d: read %s: %v", round, file, err)
		return false
	}
	bad, lost, newer := 0, 0, 0
	var badSectors []int
	for s := 0; s < killSectors; s++ {
		got := sectorID(buf[s*killSector:(s+1)*killSector], s)
		switch {
		case got >= 0 && uint32(got) != m.latest[s] && uint32(got) == m.durable[s]:
			lost++ // an acknowledged, unflushed write did not survive
		case got >= 0 && uint32(got) != m.durable[s]:
			newer++ // a write after the last flush did
		}
		allowed := got >= 0 && (uint32(got) == m.durable[s] || containsID(m.since[s], uint32(got)))
		if !allowed {
			badSectors = append(badSectors, s)
			if bad < 10 {
				t.Errorf("round %d: sector %d (offset %d) holds write %d; allowed: %d (durable) or one written since %v",
					round, s, s*killSector, got, m.durable[s], m.since[s])
			}
			bad++
			continue
		}
		m.durable[s], m.latest[s], m.since[s] = uint32(got), uint32(got), nil
	}
	if bad > 0 {
		t.Errorf("round %d: %d of %d sectors hold a value the crash does not allow", round, bad, killSectors)
		var runs [][2]int // the bad sectors, as [first, end) runs
		for _, s := range badSectors {
			if k := len(runs) - 1; k >= 0 && runs[k][1] == s {
				runs[k][1]++
				continue
			}
			runs = append(runs, [2]int{s, s + 1})
		}
		t.Logf("round %d: bad sectors %v; the requests of the round that touched their 64 KiB clusters, and the flushes:", round, runs)
		const cl = 65536 / killSector
		for _, op := range m.log {
			touches := false
			for _, r := range runs {
				touches = touches || (op.first < (r[1]+cl-1)/cl*cl && r[0]/cl*cl < op.first+op.n)
			}
			if op.what == "FLUSH" || touches {
				t.Logf("  %-12s id %-6d sectors [%d, %d) issued %v, completed %v (%v)", op.what, op.id, op.first, op.first+op.n, op.when, op.after, op.ok)
			}
		}
	}
	t.Logf("round %d: after the kill, %d sectors lost their last acknowledged write and %d hold one written after the last flush", round, lost, newer)
	return bad == 0
}

func containsID(ids []uint32, id uint32) bool {
	for _, x := range ids {
		if x == id {
			return true
		}
	}
	return false
}
