package store

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"

	"golang.org/x/sys/unix"

	"github.com/ovis-storage/ovis/cluster/object"
	"github.com/ovis-storage/ovis/cluster/store/vfs"
)

// The journal is an append-only file of fixed-size records:
//
//	0  key  uint64 LE: an object ID, or a VDI id for recToken
//	8  val  uint64 LE: the token for recToken, else 0
//	16 op   uint32 LE
//	20 crc  uint32 LE, CRC32C of bytes 0..19
//
// Replayed in order it gives the live state: the objects that may have
// writes not yet durable (recDirty), the suspect copies (recSuspect), and
// each VDI's highest fencing token. A record is applied to the in-memory
// live state when it is enqueued, and it is durable once wait returns;
// appends are batched so that concurrent callers share one fdatasync.
const (
	recSize = 24

	recDirty   = 1
	recSuspect = 2
	recClean   = 3
	recToken   = 4
)

// compactAt is the journal size above which the batch leader rewrites
// the journal as a snapshot of its live state.
var compactAt int64 = 1 << 20

type record struct {
	key, val uint64
	op       uint32
}

func (r record) encode(b []byte) {
	binary.LittleEndian.PutUint64(b[0:], r.key)
	binary.LittleEndian.PutUint64(b[8:], r.val)
	binary.LittleEndian.PutUint32(b[16:], r.op)
	binary.LittleEndian.PutUint32(b[20:], crc32.Checksum(b[:20], castagnoli))
}

func decodeRecord(b []byte) (record, bool) {
	if crc32.Checksum(b[:20], castagnoli) != binary.LittleEndian.Uint32(b[20:]) {
		return record{}, false
	}
	r := record{
		key: binary.LittleEndian.Uint64(b[0:]),
		val: binary.LittleEndian.Uint64(b[8:]),
		op:  binary.LittleEndian.Uint32(b[16:]),
	}
	if r.op < recDirty || r.op > recToken {
		return record{}, false
	}
	return r, true
}

// liveState is what a replayed journal says.
type liveState struct {
	objs   map[object.ID]uint32 // recDirty or recSuspect
	tokens map[object.VDI]uint64
}

func newLiveState() liveState {
	return liveState{objs: map[object.ID]uint32{}, tokens: map[object.VDI]uint64{}}
}

func (l liveState) apply(r record) {
	switch r.op {
	case recDirty, recSuspect:
		l.objs[object.ID(r.key)] = r.op
	case recClean:
		delete(l.objs, object.ID(r.key))
	case recToken:
		v := object.VDI(r.key)
		if r.val > l.tokens[v] {
			l.tokens[v] = r.val
		}
	}
}

// replay applies the valid prefix of b and returns its length. A record
// that fails its checksum ends the journal: it and everything after it
// belong to an append whose fdatasync never returned.
func replay(b []byte, l liveState) int {
	n := 0
	for ; n+recSize <= len(b); n += recSize {
		r, ok := decodeRecord(b[n : n+recSize])
		if !ok {
			break
		}
		l.apply(r)
	}
	return n
}

func (l liveState) encode() []byte {
	b := make([]byte, 0, (len(l.objs)+len(l.tokens))*recSize)
	var rec [recSize]byte
	for v, t := range l.tokens {
		record{key: uint64(v), val: t, op: recToken}.encode(rec[:])
		b = append(b, rec[:]...)
	}
	for id, op := range l.objs {
		record{key: uint64(id), op: op}.encode(rec[:])
		b = append(b, rec[:]...)
	}
	return b
}

// journal is the store's one durable log of dirty objects, suspect
// copies and tokens.
//
// Locking: mu guards everything but fd, which only the batch leader
// (busy) touches. mu is a leaf: it is taken under obj.mu, never the other
// way round, and it is never held across I/O.
type journal struct {
	fs        vfs.FS
	path, dir string

	mu     sync.Mutex
	cond   sync.Cond
	live   liveState
	fd     int         // only the leader (busy) uses it
	size   int64       // bytes in the file; only the leader changes it
	buf    []byte      // records enqueued since the last batch was taken
	gen    uint64      // batches taken
	synced uint64      // batches durable
	busy   bool        // a leader is writing a batch
	err    error       // sticky: after a failed fdatasync nothing is known
	broken atomic.Bool // err is set; read without mu on every mutating call
	// failed holds the batches ENOSPC cut off: a later batch's success
	// says nothing of them.
	failed map[uint64]error
}

// openJournal replays the journal at path, truncates a torn tail and
// returns it ready for appends.
func openJournal(fs vfs.FS, dir string) (*journal, error) {
	j := &journal{fs: fs, path: filepath.Join(dir, "journal"), dir: dir, live: newLiveState()}
	j.cond.L = &j.mu
	b, err := readFile(fs, j.path)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("store: journal: %w", err)
	}
	n := replay(b, j.live)
	fd, err := fs.Open(j.path, unix.O_RDWR|unix.O_CREAT|unix.O_CLOEXEC, 0o644)
	if err != nil {
		return nil, fmt.Errorf("store: journal: open: %w", err)
	}
	if n != len(b) {
		if err := fs.Ftruncate(fd, int64(n)); err != nil {
			fs.Close(fd)
			return nil, fmt.Errorf("store: journal: truncate torn tail at %d: %w", n, err)
		}
	}
	j.fd, j.size = fd, int64(n)
	return j, nil
}

// enqueue applies r to the live state and queues it for the next batch.
// It returns the batch to wait for.
func (j *journal) enqueue(r record) uint64 {
	j.mu.Lock()
	defer j.mu.Unlock()
	return j.enqueueLocked(r)
}

func (j *journal) enqueueLocked(r record) uint64 {
	j.live.apply(r)
	var rec [recSize]byte
	r.encode(rec[:])
	j.buf = append(j.buf, rec[:]...)
	return j.gen + 1
}

// wait returns once batch seq is durable. One waiter leads: it writes
// the batch and syncs while the others sleep, so concurrent callers
// share one fdatasync.
func (j *journal) wait(seq uint64) error {
	j.mu.Lock()
	defer j.mu.Unlock()
	for j.synced < seq || j.failed[seq] != nil {
		if err := j.failed[seq]; err != nil {
			return err
		}
		if j.err != nil {
			return j.err
		}
		if j.busy {
			j.cond.Wait()
			continue
		}
		j.busy = true
		batch := j.buf
		j.buf = nil
		j.gen++
		g := j.gen
		var snap []byte
		if j.size+int64(len(batch)) > compactAt && int64(len(j.live.objs)+len(j.live.tokens))*recSize*4 < j.size {
			snap = j.live.encode()
		}
		j.mu.Unlock()
		var err error
		if snap != nil {
			err = j.rewrite(snap)
		} else {
			err = j.append(batch)
		}
		j.mu.Lock()
		j.busy = false
		switch {
		case errors.Is(err, ErrNoSpace):
			// Nothing of the batch counts (append cut it off); the
			// records stay in the live state, which only errs towards
			// suspicion. Later batches may succeed once space is freed.
			if j.failed == nil || len(j.failed) > 1024 {
				j.failed = map[uint64]error{}
			}
			j.failed[g] = fmt.Errorf("store: journal: %w", err)
			j.cond.Broadcast()
			continue
		case err != nil:
			j.err = fmt.Errorf("store: journal: %w", err)
			j.broken.Store(true)
		default:
			j.synced = g
		}
		j.cond.Broadcast()
	}
	return nil
}

// failure returns the sticky error, nil while the journal works.
func (j *journal) failure() error {
	if !j.broken.Load() {
		return nil
	}
	j.mu.Lock()
	defer j.mu.Unlock()
	return j.err
}

// sync makes everything enqueued so far durable.
func (j *journal) sync() error {
	j.mu.Lock()
	seq := j.gen
	if len(j.buf) > 0 {
		seq++
	}
	j.mu.Unlock()
	return j.wait(seq)
}

func (j *journal) append(b []byte) error {
	for done := 0; done < len(b); {
		n, err := j.fs.Pwrite(j.fd, b[done:], j.size+int64(done))
		if errors.Is(err, unix.ENOSPC) {
			// Cut off the partial batch so that the next one does not
			// follow a torn record.
			if terr := j.fs.Ftruncate(j.fd, j.size); terr != nil {
				return fmt.Errorf("append at %d: %w; truncate: %w", j.size, err, terr)
			}
			return fmt.Errorf("append at %d: %w: %w", j.size, ErrNoSpace, err)
		}
		if err != nil {
			return fmt.Errorf("append at %d: %w", j.size, err)
		}
		done += n
	}
	j.size += int64(len(b))
	if err := j.fs.Fdatasync(j.fd); err != nil {
		return fmt.Errorf("fdatasync: %w", err)
	}
	return nil
}

// rewrite replaces the journal with snap, atomically: tmp file, fsync,
// rename, directory fsync.
func (j *journal) rewrite(snap []byte) error {
	tmp := j.path + ".tmp"
	if err := writeFileSync(j.fs, tmp, snap); err != nil {
		j.fs.Remove(tmp)
		return noSpace(err) // the journal itself is untouched
	}
	if err := j.fs.Rename(tmp, j.path); err != nil {
		return fmt.Errorf("rename: %w", err)
	}
	if err := syncDir(j.fs, j.dir); err != nil {
		return err
	}
	fd, err := j.fs.Open(j.path, unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("reopen: %w", err)
	}
	j.fs.Close(j.fd)
	j.fd, j.size = fd, int64(len(snap))
	return nil
}

// compact rewrites the journal as its live state now. Callers make sure
// no batch is in flight (Open and Close).
func (j *journal) compact() error {
	j.mu.Lock()
	snap := j.live.encode()
	j.buf = nil
	j.mu.Unlock()
	return j.rewrite(snap)
}

func (j *journal) close() error {
	return j.fs.Close(j.fd)
}
