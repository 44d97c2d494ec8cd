package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/signal"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

// imgGrace is how long an interrupted `ovis img` verb has to return on
// its own before the process exits anyway. Verbs check their context
// between steps, so only one stuck in a single long engine step (a
// refcount rebuild) waits it out; the engine orders its writes so that
// stopping there leaks clusters at worst, as killing qemu-img does.
const imgGrace = 1500 * time.Millisecond

// imgVerb is set once an `ovis img` verb starts: those end with 128 plus
// the signal's number when interrupted, as qemu-img does by dying of it,
// while `ovis up` and `ovis nbd` treat a signal as their normal stop.
var imgVerb atomic.Bool

// serverInterrupts, set by `ovis up` and `ovis nbd` before they serve,
// receives SIGINT (Ctrl-C) in place of it cancelling the context: the
// server stops at once only when no client is attached or on a second
// Ctrl-C, since stopping under an attached VM fails its next I/O. SIGTERM
// still cancels the context, a stop at once as for qemu-nbd.
var serverInterrupts atomic.Pointer[chan struct{}]

// serveInterrupts makes SIGINT reach the returned channel (see
// serverInterrupts).
func serveInterrupts() <-chan struct{} {
	ch := make(chan struct{}, 4)
	serverInterrupts.Store(&ch)
	return ch
}

// interrupts turns SIGINT and SIGTERM into the cancellation of a context.
// A second signal during an img verb exits at once.
type interrupts struct {
	ch     chan os.Signal
	stderr io.Writer
	mu     sync.Mutex
	sig    syscall.Signal // the first signal received, 0 before
	done   bool           // stop was called: the verb has returned
}

// notifyInterrupts starts watching for SIGINT and SIGTERM and returns the
// context they cancel. Release with stop.
func notifyInterrupts(parent context.Context, stderr io.Writer) (*interrupts, context.Context) {
	ctx, cancel := context.WithCancelCause(parent)
	in := &interrupts{ch: make(chan os.Signal, 2), stderr: stderr}
	signal.Notify(in.ch, os.Interrupt, syscall.SIGTERM)
	go func() {
		var grace <-chan time.Time
		for {
			select {
			case s, ok := <-in.ch:
				if !ok {
					return
				}
				sig := s.(syscall.Signal)
				if ch := serverInterrupts.Load(); ch != nil && sig == syscall.SIGINT {
					select {
					case *ch <- struct{}{}:
					default: // the server has not taken the last ones yet
					}
					continue
				}
				in.mu.Lock()
				first := in.sig == 0
				if first {
					in.sig = sig
				}
				in.mu.Unlock()
				if first {
					cancel(fmt.Errorf("interrupted by signal %d (%v)", int(sig), sig))
					if imgVerb.Load() {
						grace = time.After(imgGrace)
					}
					continue
				}
				if imgVerb.Load() {
					in.exitNow()
				}
			case <-grace:
				in.exitNow()
			}
		}
	}()
	return in, ctx
}

// exitNow ends a verb that did not return in time.
func (in *interrupts) exitNow() {
	in.mu.Lock()
	sig, done := in.sig, in.done
	in.mu.Unlock()
	if done {
		return // main is reporting and exiting itself
	}
	fmt.Fprintf(in.stderr, "ovis: %v: not stopped after %v, exiting\n", sig, imgGrace)
	os.Exit(128 + int(sig))
}

// signal returns the first signal received, 0 if none.
func (in *interrupts) signal() syscall.Signal {
	in.mu.Lock()
	defer in.mu.Unlock()
	return in.sig
}

// stop stops watching; a signal after it has its default effect.
func (in *interrupts) stop() {
	in.mu.Lock()
	in.done = true
	in.mu.Unlock()
	signal.Stop(in.ch)
	close(in.ch)
}
