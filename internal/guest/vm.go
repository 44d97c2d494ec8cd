package guest

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"time"
)

// TCGEnv, when set to a non-empty value, forces QEMU's TCG emulator even
// where KVM is available: the worst case of a CI machine without KVM.
const TCGEnv = "OVIS_GUEST_TCG"

// Config says how to boot one guest. Kernel, Script, Drive and Dir are
// required.
type Config struct {
	// Kernel is the guest's kernel (FindKernel).
	Kernel Kernel
	// Script is the shell script /init runs under set -e, with phase, say
	// and fail defined (see initScript).
	Script string
	// Drive is the value of QEMU's -drive file=: an nbd:// or
	// nbd+unix:// URI (or a raw file). The guest sees it as /dev/vda.
	Drive string
	// Cache is the drive's QEMU cache mode: writeback, writethrough,
	// none, directsync or unsafe. The default is writeback.
	Cache string
	// Dir holds the initramfs. The control socket goes to a short
	// temporary folder of its own.
	Dir string
	// Accel is kvm or tcg. The default is DefaultAccel's.
	Accel string
	// MemoryMiB is the guest's memory. The default is 256.
	MemoryMiB int
	// Timeout bounds the whole run: QEMU is killed when it passes. The
	// default is 4 minutes.
	Timeout time.Duration
	// AnswerTimeout is how long the guest waits at a phase for the test's
	// answer before it fails. The default is 2 minutes.
	AnswerTimeout time.Duration
	// Console, if not nil, gets the guest's console (its kernel log and
	// the script's output) as it arrives, besides VM.Console.
	Console io.Writer
}

// Validate fills in the defaults and checks the rest.
func (c *Config) Validate() error {
	if c.Kernel.Image == "" || c.Kernel.Modules == "" {
		return errors.New("guest: Config.Kernel not set (FindKernel)")
	}
	if c.Script == "" || c.Drive == "" || c.Dir == "" {
		return fmt.Errorf("guest: Config needs Script, Drive and Dir (drive %q, dir %q)", c.Drive, c.Dir)
	}
	if strings.ContainsAny(c.Drive, ",") {
		return fmt.Errorf("guest: drive %q: a comma would end QEMU's file= value", c.Drive)
	}
	switch c.Cache {
	case "":
		c.Cache = "writeback"
	case "writeback", "writethrough", "none", "directsync", "unsafe":
	default:
		return fmt.Errorf("guest: cache mode %q: want writeback, writethrough, none, directsync or unsafe", c.Cache)
	}
	switch c.Accel {
	case "", "kvm", "tcg": // Start resolves "": DefaultAccel boots a probe
	default:
		return fmt.Errorf("guest: accel %q: want kvm or tcg", c.Accel)
	}
	if c.MemoryMiB == 0 {
		c.MemoryMiB = 256
	}
	if c.MemoryMiB < 64 {
		return fmt.Errorf("guest: memory %d MiB: want at least 64", c.MemoryMiB)
	}
	if c.Timeout == 0 {
		c.Timeout = 4 * time.Minute
	}
	if c.AnswerTimeout == 0 {
		c.AnswerTimeout = 2 * time.Minute
	}
	if c.Timeout < 0 || c.AnswerTimeout < time.Second {
		return fmt.Errorf("guest: timeout %v, answer timeout %v: want positive, the answer's at least 1 s", c.Timeout, c.AnswerTimeout)
	}
	return nil
}

// DefaultAccel is kvm when /dev/kvm can be opened, TCGEnv is not set and
// a kernel boots under KVM (probeKVM), tcg otherwise. The probe runs once
// per process.
func DefaultAccel(k Kernel) string {
	if os.Getenv(TCGEnv) != "" {
		return "tcg"
	}
	f, err := os.OpenFile("/dev/kvm", os.O_RDWR, 0)
	if err != nil {
		return "tcg"
	}
	f.Close()
	kvmProbe.once.Do(func() { kvmProbe.ok = probeKVM(k) })
	if !kvmProbe.ok {
		return "tcg"
	}
	return "kvm"
}

var kvmProbe struct {
	once sync.Once
	ok   bool
}

// probeKVM boots k under KVM with no root: a working KVM gets to the
// kernel's "VFS: Unable to mount root" panic, and QEMU exits, in about a
// second. Nested KVM on some hosts (a Firecracker VM, for one) opens but
// hangs the kernel right after decompression; that shows as no panic in
// 10 s.
func probeKVM(k Kernel) bool {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	out, _ := exec.CommandContext(ctx, "qemu-system-x86_64", "-accel", "kvm",
		"-nodefaults", "-no-user-config", "-nographic", "-no-reboot", "-m", "128",
		"-kernel", k.Image, "-append", "console=ttyS0 panic=-1",
		"-monitor", "none", "-serial", "stdio").CombinedOutput()
	return strings.Contains(string(out), "Kernel panic")
}

// Event is one line the guest sent on its control port: "OVIS KIND
// [NAME] [KEY=VALUE...]".
type Event struct {
	Kind string            // BOOTED, PHASE, DONE, FAIL, or what the script says
	Name string            // a PHASE's name; the first word after other kinds
	Args map[string]string // the KEY=VALUE words after the name
	Line string            // the whole line
	Time time.Time         // when the test received it
}

func parseEvent(line string) (Event, bool) {
	f := strings.Fields(line)
	if len(f) < 2 || f[0] != "OVIS" {
		return Event{}, false
	}
	e := Event{Kind: f[1], Args: map[string]string{}, Line: line, Time: time.Now()}
	for i, w := range f[2:] {
		if k, v, ok := strings.Cut(w, "="); ok {
			e.Args[k] = v
		} else if i == 0 {
			e.Name = w
		}
	}
	if e.Kind == "FAIL" {
		e.Name = strings.TrimSpace(strings.TrimPrefix(line, "OVIS FAIL"))
	}
	return e, true
}

// VM is one running QEMU with the guest. Its lifecycle: Start, then Phase
// and Continue for each phase the script has, then Wait; Close always
// (it kills QEMU if it still runs).
//
// Locking: mu guards the console and the event log; the control
// connection is written only by Continue's caller. Next, Phase and Wait
// are for one goroutine; Console and Events are safe from any.
type VM struct {
	cfg     Config
	cmd     *exec.Cmd
	sockDir string
	ln      net.Listener
	stderr  *lockedBuffer

	events  chan Event    // from the control port; closed at its EOF
	exited  chan struct{} // closed when QEMU has exited and exitErr is set
	exitErr error
	conn    chan net.Conn // the accepted control connection, once
	ctl     net.Conn

	mu struct {
		sync.Mutex
		console strings.Builder
		log     []Event
	}
	wg        sync.WaitGroup
	cancel    context.CancelFunc
	closeOnce sync.Once
	start     time.Time
}

// Start builds the initramfs and starts QEMU. The run ends at cfg.Timeout
// or when ctx ends, whichever comes first: QEMU is then killed.
func Start(ctx context.Context, cfg Config) (*VM, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.Accel == "" {
		cfg.Accel = DefaultAccel(cfg.Kernel)
	}
	initrd := filepath.Join(cfg.Dir, "initramfs.cpio")
	if err := BuildInitramfs(initrd, cfg.Kernel, cfg.Script, int(cfg.AnswerTimeout/time.Second)); err != nil {
		return nil, err
	}
	qemu, err := exec.LookPath("qemu-system-x86_64")
	if err != nil {
		return nil, fmt.Errorf("guest: qemu-system-x86_64 is not installed (%v); run scripts/test.sh, which installs qemu-system-x86", err)
	}
	// Unix socket paths are limited to 108 bytes: a short folder of its own.
	sockDir, err := os.MkdirTemp("", "ovis-guest-")
	if err != nil {
		return nil, fmt.Errorf("guest: control socket folder: %w", err)
	}
	sock := filepath.Join(sockDir, "ctl")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		os.RemoveAll(sockDir)
		return nil, fmt.Errorf("guest: control socket: %w", err)
	}
	v := &VM{
		cfg: cfg, sockDir: sockDir, ln: ln, stderr: &lockedBuffer{},
		events: make(chan Event, 64), exited: make(chan struct{}), conn: make(chan net.Conn, 1),
		start: time.Now(),
	}
	accel := []string{"-accel", "tcg"}
	if cfg.Accel == "kvm" {
		accel = []string{"-accel", "kvm"}
	}
	args := append(accel,
		"-nodefaults", "-no-user-config", "-nographic", "-no-reboot",
		"-m", fmt.Sprint(cfg.MemoryMiB), "-smp", "1",
		"-kernel", cfg.Kernel.Image, "-initrd", initrd,
		// panic=-1 reboots at once on a panic, which -no-reboot turns
		// into QEMU's exit.
		"-append", "console=ttyS0 panic=-1 oops=panic",
		"-monitor", "none",
		"-serial", "stdio",
		"-chardev", "socket,id=ctl,path="+sock,
		"-serial", "chardev:ctl",
		"-drive", "file="+cfg.Drive+",format=raw,if=virtio,cache="+cfg.Cache,
	)
	runCtx, cancel := context.WithTimeout(ctx, cfg.Timeout)
	v.cancel = cancel
	v.cmd = exec.Command(qemu, args...)
	v.cmd.Stderr = v.stderr
	stdout, err := v.cmd.StdoutPipe()
	if err != nil {
		v.cleanup()
		return nil, fmt.Errorf("guest: %w", err)
	}
	if err := v.cmd.Start(); err != nil {
		v.cleanup()
		return nil, fmt.Errorf("guest: starting %s: %w", qemu, err)
	}
	v.wg.Add(4)
	go v.readConsole(stdout)
	go v.accept()
	go func() {
		defer v.wg.Done()
		// The console's pipe is drained by readConsole before Wait
		// returns: Wait closes it.
		v.exitErr = v.cmd.Wait()
		close(v.exited)
	}()
	go func() {
		defer v.wg.Done()
		select {
		case <-runCtx.Done():
			v.cmd.Process.Kill()
		case <-v.exited:
		}
	}()
	return v, nil
}

// Args are QEMU's arguments, for the test log.
func (v *VM) Args() []string { return v.cmd.Args }

// Accel is the accelerator the guest runs under.
func (v *VM) Accel() string { return v.cfg.Accel }

func (v *VM) readConsole(r io.Reader) {
	defer v.wg.Done()
	br := bufio.NewReader(r)
	for {
		b, err := br.ReadBytes('\n')
		if len(b) > 0 {
			s := strings.ReplaceAll(string(b), "\r", "")
			v.mu.Lock()
			v.mu.console.WriteString(s)
			v.mu.Unlock()
			if v.cfg.Console != nil {
				v.cfg.Console.Write([]byte(s))
			}
		}
		if err != nil {
			return
		}
	}
}

// accept takes QEMU's connection to the control socket and reads its lines
// into events until EOF.
func (v *VM) accept() {
	defer v.wg.Done()
	defer close(v.events)
	c, err := v.ln.Accept()
	if err != nil {
		return
	}
	v.conn <- c
	sc := bufio.NewScanner(c)
	for sc.Scan() {
		e, ok := parseEvent(strings.TrimSpace(sc.Text()))
		if !ok {
			continue
		}
		v.mu.Lock()
		v.mu.log = append(v.mu.log, e)
		v.mu.Unlock()
		v.events <- e
	}
}

// Console is everything the guest printed on its console so far: the
// kernel log and the script's output.
func (v *VM) Console() string {
	v.mu.Lock()
	defer v.mu.Unlock()
	return v.mu.console.String()
}

// Events are the control lines received so far.
func (v *VM) Events() []Event {
	v.mu.Lock()
	defer v.mu.Unlock()
	return append([]Event(nil), v.mu.log...)
}

// Elapsed is the time since Start.
func (v *VM) Elapsed() time.Duration { return time.Since(v.start) }

// exitError says how QEMU ended, once it has.
func (v *VM) exitError() error {
	select {
	case <-v.exited:
	case <-time.After(5 * time.Second):
		return fmt.Errorf("guest: control port closed, QEMU still running\nqemu stderr:\n%s", v.stderr)
	}
	return fmt.Errorf("guest: QEMU exited (%v) after %v\nqemu stderr:\n%s", v.exitErr, v.Elapsed().Round(time.Millisecond), v.stderr)
}

// Next returns the next control line. It fails when the guest or QEMU has
// gone, or ctx ends.
func (v *VM) Next(ctx context.Context) (Event, error) {
	select {
	case e, ok := <-v.events:
		if !ok {
			return Event{}, v.exitError()
		}
		return e, nil
	case <-ctx.Done():
		return Event{}, fmt.Errorf("guest: waiting for the guest: %w", ctx.Err())
	}
}

// Phase waits for the guest to reach phase name and returns its event.
// Lines of other kinds on the way are skipped (Events keeps them); a
// FAIL, DONE or another phase is an error.
func (v *VM) Phase(ctx context.Context, name string) (Event, error) {
	for {
		e, err := v.Next(ctx)
		if err != nil {
			return Event{}, fmt.Errorf("guest: waiting for phase %s: %w", name, err)
		}
		switch {
		case e.Kind == "PHASE" && e.Name == name:
			return e, nil
		case e.Kind == "PHASE", e.Kind == "DONE":
			return e, fmt.Errorf("guest: waiting for phase %s, got %q", name, e.Line)
		case e.Kind == "FAIL":
			return e, fmt.Errorf("guest: failed before phase %s: %s", name, e.Name)
		}
	}
}

// Continue answers the phase the guest waits at.
func (v *VM) Continue() error {
	if v.ctl == nil {
		select {
		case v.ctl = <-v.conn:
		case <-time.After(5 * time.Second):
			return errors.New("guest: no control connection from QEMU")
		}
	}
	v.ctl.SetWriteDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.WriteString(v.ctl, "go\n"); err != nil {
		return fmt.Errorf("guest: answering the guest: %w", err)
	}
	return nil
}

// Wait waits for the script's end (DONE) and QEMU's exit. A FAIL or a
// phase nobody answers is an error.
func (v *VM) Wait(ctx context.Context) error {
	for {
		e, err := v.Next(ctx)
		if err != nil {
			return fmt.Errorf("guest: waiting for the end: %w", err)
		}
		switch e.Kind {
		case "FAIL":
			return fmt.Errorf("guest: failed: %s", e.Name)
		case "PHASE":
			return fmt.Errorf("guest: waiting for the end, got %q", e.Line)
		case "DONE":
			select {
			case <-v.exited:
				if v.exitErr != nil {
					return fmt.Errorf("guest: QEMU after the guest's power-off: %v\nqemu stderr:\n%s", v.exitErr, v.stderr)
				}
				return nil
			case <-ctx.Done():
				return fmt.Errorf("guest: waiting for QEMU to exit after power-off: %w", ctx.Err())
			}
		}
	}
}

// Close kills QEMU if it still runs, waits for it and for every goroutine,
// and removes the control socket. It returns nil; calling it again does
// nothing.
func (v *VM) Close() error {
	v.closeOnce.Do(func() {
		v.cmd.Process.Kill()
		<-v.exited
		v.ln.Close()
		select {
		case c := <-v.conn:
			c.Close()
		default:
		}
		if v.ctl != nil {
			v.ctl.Close()
		}
		// The reader may be blocked handing an event nobody takes.
		go func() {
			for range v.events {
			}
		}()
		v.wg.Wait()
		v.cleanup()
	})
	return nil
}

func (v *VM) cleanup() {
	if v.cancel != nil {
		v.cancel()
	}
	v.ln.Close()
	os.RemoveAll(v.sockDir)
}

// lockedBuffer is a strings.Builder safe for exec's copier and readers.
type lockedBuffer struct {
	mu sync.Mutex
	b  strings.Builder
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}
