package store

import (
	"errors"
	"fmt"
	"sync"

	"github.com/ovis-storage/ovis/cluster/object"
)

// Flush makes every write to vdi's objects acknowledged before it was
// called durable, by syncing only the objects written since their last
// sync, and the VDI's directory when files were created. The objects
// it leaves clean are then cleared from the dirty journal, so that a
// crash no longer makes them suspect. vdi 0 flushes every VDI.
func (s *Store) Flush(vdi object.VDI) error {
	if err := s.enterWrite(); err != nil {
		return err
	}
	defer s.ops.Done()
	return s.flush(vdi)
}

func (s *Store) flush(vdi object.VDI) error {
	var vs []*vdiState
	s.mu.Lock()
	if vdi != 0 {
		vs = append(vs, s.vdiLocked(vdi))
	} else {
		for _, v := range s.vdis {
			vs = append(vs, v)
		}
	}
	s.mu.Unlock()
	var errs []error
	var seq uint64
	for _, v := range vs {
		q, err := s.flushVDI(v)
		if err != nil {
			errs = append(errs, err)
		}
		seq = max(seq, q)
	}
	if seq > 0 {
		if err := s.j.wait(seq); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// flushVDI syncs v's dirty objects and enqueues recClean for those left
// clean; it returns the journal batch to wait for (0 for none).
func (s *Store) flushVDI(v *vdiState) (uint64, error) {
	// Referenced, so that none is forgotten (and loaded again as a second
	// obj) while Flush works on it.
	s.mu.Lock()
	v.mu.Lock()
	objs := make([]*obj, 0, len(v.journaled))
	for _, o := range v.journaled {
		o.refs++
		objs = append(objs, o)
	}
	v.mu.Unlock()
	s.mu.Unlock()
	defer func() {
		for _, o := range objs {
			s.release(o)
		}
	}()

	type pending struct {
		o   *obj
		gen uint64
		err error
	}
	var todo []*pending
	var errs []error
	for _, o := range objs {
		o.mu.Lock()
		gen, need, exists := o.dirtyGen, o.dirtyGen != o.syncedGen, o.exists
		o.mu.Unlock()
		p := &pending{o: o, gen: gen}
		todo = append(todo, p)
		if !need || !exists {
			continue
		}
		p.err = errNeedSync
	}
	// fdatasyncs run in parallel: the file system may commit them
	// together, and a device with a queue serves them concurrently.
	work := make(chan *pending)
	var wg sync.WaitGroup
	for range min(flushParallel, len(todo)) {
		wg.Go(func() {
			for p := range work {
				p.err = s.syncFile(p.o)
			}
		})
	}
	for _, p := range todo {
		if p.err == errNeedSync {
			work <- p
		}
	}
	close(work)
	wg.Wait()
	var synced []*pending
	for _, p := range todo {
		if p.err != nil {
			errs = append(errs, p.err)
			continue
		}
		synced = append(synced, p)
	}
	v.mu.Lock()
	gen := v.dirGen
	v.mu.Unlock()
	if err := s.syncVDIDir(v, gen); err != nil {
		return 0, errors.Join(append(errs, err)...)
	}

	// Clear under v.mu so that a writer re-journaling an object adds it
	// to v.journaled only after it has left (see obj.prepping).
	var seq uint64
	v.mu.Lock()
	for _, p := range synced {
		o := p.o
		o.mu.Lock()
		if p.gen > o.syncedGen {
			o.syncedGen = p.gen
		}
		if o.journaled && !o.suspect && !o.prepping && !o.excl && o.writers == 0 && o.dirtyGen == o.syncedGen && o.createGen <= v.dirSynced {
			o.journaled = false
			seq = s.j.enqueue(record{key: uint64(o.id), op: recClean})
			delete(v.journaled, o.id)
		}
		o.mu.Unlock()
	}
	v.mu.Unlock()
	return seq, errors.Join(errs...)
}

// flushParallel bounds the fdatasyncs one Flush runs at once.
const flushParallel = 8

var errNeedSync = errors.New("needs sync")

// syncFile fdatasyncs o's file; a failure makes the copy suspect. It
// waits out Put, Remove and ClearSuspect (which swap or delete the file)
// and counts as a user of o meanwhile, so that they never run beside it.
func (s *Store) syncFile(o *obj) error {
	o.mu.Lock()
	for o.excl {
		o.cond.Wait()
	}
	if !o.exists {
		o.mu.Unlock()
		return nil
	}
	o.users++
	a := &access{o: o, version: o.version}
	o.mu.Unlock()
	defer s.end(a)
	fd, err := s.fds.get(o.id, o.path, false)
	if err != nil {
		return fmt.Errorf("store: flush: object %s: %w", o.id, err)
	}
	a.fd = fd
	if err := s.writeHeader(a); err != nil { // plain writes leave it to Flush
		return s.failed(o, fmt.Errorf("store: flush: %w", err))
	}
	if err := s.syncData(o, fd.fd); err != nil {
		return s.failed(o, fmt.Errorf("store: flush: object %s: %w", o.id, err))
	}
	return nil
}
