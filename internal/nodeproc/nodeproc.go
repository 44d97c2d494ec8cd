// Package nodeproc runs `ovis node` as a process of its own and reads
// what it announces on stdout: its ID and node address, the etcd other
// nodes join with, its metrics and NBD addresses. It is the one process
// harness of the tests that need real processes (SIGKILL, SIGSTOP,
// network namespaces, Debian's etcd: cmd/ovis) and of bench/chaos; the
// tests that need none run on internal/clustertest.
package nodeproc

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"regexp"
	"syscall"
	"time"
)

// The lines `ovis node` prints once it serves (cmd/ovis/cluster.go),
// the NBD one last.
var (
	servingRE = regexp.MustCompile(`^ovis node (\S+) serving on (\S+)`)
	joinRE    = regexp.MustCompile(`--etcd (\S+)`)
	metricsRE = regexp.MustCompile(`^metrics at http://(\S+)/metrics`)
	nbdRE     = regexp.MustCompile(`^VDIs are served at nbd://(\S+)/NAME`)
)

// Proc is one `ovis node` process, started by Start.
type Proc struct {
	Cmd *exec.Cmd
	// What the node announced: its ID, its node-to-node and admin
	// address, the etcd URL other nodes join with (a node that embeds
	// etcd says it), its metrics address (with --metrics) and its NBD
	// address.
	ID, Addr, Etcd, Metrics, NBD string

	exited chan struct{}
	err    error // the process's end; read after exited closes
	ready  chan announced
}

// announced is what the node printed on its start.
type announced struct{ id, addr, etcd, metrics, nbd string }

// Start starts cmd, an `ovis node` command whose stdout it sets, and
// reads what the node prints; Ready waits for it to serve. echo, when not
// nil, gets every line the node prints on stdout, from the reading
// goroutine, never after Exited is closed. The node's stderr is the
// caller's (cmd.Stderr).
func Start(cmd *exec.Cmd, echo func(line string)) (*Proc, error) {
	// A pipe of our own, not cmd.StdoutPipe: Exited follows the
	// process's end, not the end of its stdout, which a child of the
	// node could hold open.
	r, w, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	cmd.Stdout = w
	err = cmd.Start()
	w.Close()
	if err != nil {
		r.Close()
		return nil, fmt.Errorf("starting %s: %w", cmd.Path, err)
	}
	p := &Proc{Cmd: cmd, exited: make(chan struct{}), ready: make(chan announced, 1)}
	read := make(chan struct{})
	go func() {
		defer close(read)
		var a announced
		sc := bufio.NewScanner(r)
		for sc.Scan() {
			l := sc.Text()
			if echo != nil {
				echo(l)
			}
			if m := servingRE.FindStringSubmatch(l); m != nil {
				a.id, a.addr = m[1], m[2]
			}
			if m := joinRE.FindStringSubmatch(l); m != nil {
				a.etcd = m[1]
			}
			if m := metricsRE.FindStringSubmatch(l); m != nil {
				a.metrics = m[1]
			}
			if m := nbdRE.FindStringSubmatch(l); m != nil && a.nbd == "" {
				a.nbd = m[1]
				p.ready <- a
			}
		}
	}()
	go func() {
		err := cmd.Wait()
		// What the node wrote before its end is still read; then the
		// reader stops.
		r.SetReadDeadline(time.Now().Add(time.Second))
		<-read
		r.Close()
		p.err = err
		close(p.exited)
	}()
	return p, nil
}

// Ready waits until the node announces its NBD address, and fills in
// what it announced. It fails when the process ends first, or when ctx
// ends (the process is left running: the caller decides). Call it once.
func (p *Proc) Ready(ctx context.Context) error {
	select {
	case a := <-p.ready:
		p.ID, p.Addr, p.Etcd, p.Metrics, p.NBD = a.id, a.addr, a.etcd, a.metrics, a.nbd
		return nil
	case <-p.exited:
		return fmt.Errorf("%s exited (%v) before serving", p.Cmd.Path, p.err)
	case <-ctx.Done():
		return fmt.Errorf("%s did not serve: %w", p.Cmd.Path, ctx.Err())
	}
}

// Exited is closed once the process has ended.
func (p *Proc) Exited() <-chan struct{} { return p.exited }

// Err is how the process ended; nil until Exited is closed.
func (p *Proc) Err() error {
	select {
	case <-p.exited:
		return p.err
	default:
		return nil
	}
}

// ErrKilled: the process outlived the wait after its signal and was
// killed.
var ErrKilled = errors.New("nodeproc: the process did not end after its signal; killed")

// Stop sends sig and waits, at most wait, for the process to end; then
// it kills it and returns ErrKilled. A process already ended is left.
func (p *Proc) Stop(sig syscall.Signal, wait time.Duration) error {
	select {
	case <-p.exited:
		return nil
	default:
	}
	p.Cmd.Process.Signal(sig)
	select {
	case <-p.exited:
		return nil
	case <-time.After(wait):
		p.Cmd.Process.Kill()
		<-p.exited
		return ErrKilled
	}
}

// Signal sends sig without waiting (SIGSTOP, SIGCONT).
func (p *Proc) Signal(sig syscall.Signal) error { return p.Cmd.Process.Signal(sig) }
