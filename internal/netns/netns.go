package netns

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
)

// MaxNamespaces is the most namespaces one Net holds: addresses run from
// .10 to .(10+MaxNamespaces-1), and link names must fit in 15 bytes.
const MaxNamespaces = 99

// ErrClosed is returned by Close when the Net was already closed.
var ErrClosed = errors.New("netns: already closed")

// seq numbers the Nets of this process, for unique names.
var seq atomic.Uint32

// nameRE matches the links and namespaces of this package: the creating
// process ID, then the sequence number, then b (the bridge), h<i> (a host
// side veth) or -<i> (a namespace).
var nameRE = regexp.MustCompile(`^ovn([0-9a-f]{6})([0-9a-f]{2})(b|h[0-9]+|-[0-9]+)$`)

// Net is a bridge in the root namespace and the namespaces joined to
// it. See the package documentation.
//
// Safe for concurrent use. Release with Close.
type Net struct {
	prefix string // ovnPPPPPPSS
	subnet string // "10.A.B"
	n      int

	closed atomic.Bool
}

// New creates the bridge and n namespaces (1 ≤ n ≤ MaxNamespaces). On
// an error it deletes what it made. It first deletes what earlier,
// crashed processes left behind.
func New(ctx context.Context, n int) (*Net, error) {
	if n < 1 || n > MaxNamespaces {
		return nil, fmt.Errorf("netns: %d namespaces: want 1 to %d", n, MaxNamespaces)
	}
	if _, err := exec.LookPath("ip"); err != nil {
		return nil, fmt.Errorf("netns: iproute2's ip is needed (apt-get install iproute2): %w", err)
	}
	if err := cleanLeftovers(ctx); err != nil {
		return nil, err
	}
	subnet, err := freeSubnet(ctx)
	if err != nil {
		return nil, err
	}
	nt := &Net{
		prefix: fmt.Sprintf("ovn%06x%02x", os.Getpid()&0xffffff, seq.Add(1)&0xff),
		subnet: subnet,
		n:      n,
	}
	if err := nt.setup(ctx); err != nil {
		nt.Close()
		return nil, err
	}
	return nt, nil
}

// NewT is New for a test: it fails t on an error and closes the Net
// when the test ends.
func NewT(t testing.TB, n int) *Net {
	t.Helper()
	nt, err := New(context.Background(), n)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := nt.Close(); err != nil {
			t.Error(err)
		}
	})
	return nt
}

func (nt *Net) bridge() string        { return nt.prefix + "b" }
func (nt *Net) hostLink(i int) string { return nt.prefix + "h" + strconv.Itoa(i) }

// Namespace returns the name of namespace i, as `ip netns` knows it.
func (nt *Net) Namespace(i int) string { nt.check(i); return nt.prefix + "-" + strconv.Itoa(i) }

// Len returns the number of namespaces.
func (nt *Net) Len() int { return nt.n }

// Addr returns namespace i's IPv4 address (no port).
func (nt *Net) Addr(i int) string { nt.check(i); return nt.subnet + "." + strconv.Itoa(10+i) }

// HostAddr returns the bridge's address in the root namespace (no port):
// where a process in any namespace reaches the root's listeners.
func (nt *Net) HostAddr() string { return nt.subnet + ".1" }

// Cmd returns a command that runs name with args inside namespace i.
// Its process is the program itself (ip netns exec execs it), so signals
// sent to it reach the program.
func (nt *Net) Cmd(i int, name string, args ...string) *exec.Cmd {
	return exec.Command("ip", append([]string{"netns", "exec", nt.Namespace(i), name}, args...)...)
}

// CommandContext is Cmd with a context that kills the process when done.
func (nt *Net) CommandContext(ctx context.Context, i int, name string, args ...string) *exec.Cmd {
	return exec.CommandContext(ctx, "ip", append([]string{"netns", "exec", nt.Namespace(i), name}, args...)...)
}

// Cut cuts namespace i off from the bridge: no packet leaves or reaches
// it until Heal(i). Cutting a cut namespace does nothing.
func (nt *Net) Cut(i int) error {
	nt.check(i)
	if err := ip(context.Background(), "link", "set", nt.hostLink(i), "down"); err != nil {
		return fmt.Errorf("netns: cut namespace %d: %w", i, err)
	}
	return nil
}

// Heal joins namespace i to the bridge again. Healing a namespace that
// is not cut does nothing.
func (nt *Net) Heal(i int) error {
	nt.check(i)
	if err := ip(context.Background(), "link", "set", nt.hostLink(i), "up"); err != nil {
		return fmt.Errorf("netns: heal namespace %d: %w", i, err)
	}
	return nil
}

// CutPeers cuts namespace i off from every other namespace, both ways,
// while it still reaches the root namespace (HostAddr: etcd, say): one
// blackhole route per other namespace's address inside namespace i, so
// that its packets to them, and its answers to theirs, are dropped
// silently, as by a failed link. Undo with HealPeers.
func (nt *Net) CutPeers(i int) error { return nt.peerRoutes(i, "replace") }

// HealPeers removes CutPeers' routes of namespace i.
func (nt *Net) HealPeers(i int) error { return nt.peerRoutes(i, "del") }

// peerRoutes adds (replace) or deletes (del) the blackhole route to each
// other namespace inside namespace i.
func (nt *Net) peerRoutes(i int, verb string) error {
	nt.check(i)
	for j := range nt.n {
		if j == i {
			continue
		}
		if err := ip(context.Background(), "-n", nt.Namespace(i), "route", verb, "blackhole", nt.Addr(j)+"/32"); err != nil {
			return fmt.Errorf("netns: route %s in namespace %d to %d: %w", verb, i, j, err)
		}
	}
	return nil
}

// Close deletes the namespaces, their veth pairs and the bridge. It
// finishes the teardown past an error and returns the first; a second
// call returns ErrClosed.
func (nt *Net) Close() error {
	if nt.closed.Swap(true) {
		return ErrClosed
	}
	return deletePrefix(context.Background(), nt.prefix)
}

func (nt *Net) check(i int) {
	if i < 0 || i >= nt.n {
		panic(fmt.Sprintf("netns: namespace %d of %d", i, nt.n))
	}
}

// setup makes the bridge, then each namespace with its veth pair.
func (nt *Net) setup(ctx context.Context) error {
	br := nt.bridge()
	steps := [][]string{
		{"link", "add", br, "type", "bridge"},
		{"addr", "add", nt.HostAddr() + "/24", "dev", br},
		{"link", "set", br, "up"},
	}
	for i := range nt.n {
		ns, h := nt.Namespace(i), nt.hostLink(i)
		steps = append(steps,
			[]string{"netns", "add", ns},
			[]string{"link", "add", h, "type", "veth", "peer", "name", "eth0", "netns", ns},
			[]string{"link", "set", h, "master", br, "up"},
			[]string{"-n", ns, "addr", "add", nt.Addr(i) + "/24", "dev", "eth0"},
			[]string{"-n", ns, "link", "set", "eth0", "up"},
			[]string{"-n", ns, "link", "set", "lo", "up"},
		)
	}
	for _, s := range steps {
		if err := ip(ctx, s...); err != nil {
			return fmt.Errorf("netns: setting up %s: %w", nt.prefix, err)
		}
	}
	return nil
}

// ip runs ip with args; the error quotes its output.
func ip(ctx context.Context, args ...string) error {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, "ip", args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("ip %s: %v: %s", strings.Join(args, " "), err, bytes.TrimSpace(out))
	}
	return nil
}

func ipOutput(ctx context.Context, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	var stderr bytes.Buffer
	cmd := exec.CommandContext(ctx, "ip", args...)
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return "", fmt.Errorf("ip %s: %v: %s", strings.Join(args, " "), err, bytes.TrimSpace(stderr.Bytes()))
	}
	return string(out), nil
}

// names returns the links and namespaces of this package that exist.
func names(ctx context.Context) (links, spaces []string, err error) {
	out, err := ipOutput(ctx, "-o", "link", "show")
	if err != nil {
		return nil, nil, err
	}
	// "12: ovn00123401h0@if2: <…" : the name ends at '@' or ':'.
	for _, l := range strings.Split(out, "\n") {
		f := strings.Fields(l)
		if len(f) < 2 {
			continue
		}
		name, _, _ := strings.Cut(strings.TrimSuffix(f[1], ":"), "@")
		if nameRE.MatchString(name) {
			links = append(links, name)
		}
	}
	out, err = ipOutput(ctx, "netns", "list")
	if err != nil {
		return nil, nil, err
	}
	for _, l := range strings.Split(out, "\n") {
		f := strings.Fields(l)
		if len(f) > 0 && nameRE.MatchString(f[0]) {
			spaces = append(spaces, f[0])
		}
	}
	return links, spaces, nil
}

// deletePrefix deletes the host-side links (which takes their peers
// with them), the namespaces and the bridge whose names start with
// prefix, and returns the first error.
func deletePrefix(ctx context.Context, prefix string) error {
	links, spaces, err := names(ctx)
	if err != nil {
		return fmt.Errorf("netns: listing for teardown of %s: %w", prefix, err)
	}
	var first error
	keep := func(err error) {
		if err != nil && first == nil {
			first = fmt.Errorf("netns: teardown of %s: %w", prefix, err)
		}
	}
	var bridge []string
	for _, l := range links {
		if !strings.HasPrefix(l, prefix) {
			continue
		}
		if strings.HasSuffix(l, "b") {
			bridge = append(bridge, l)
			continue
		}
		keep(ip(ctx, "link", "del", l))
	}
	for _, s := range spaces {
		if strings.HasPrefix(s, prefix) {
			keep(ip(ctx, "netns", "del", s))
		}
	}
	for _, b := range bridge {
		keep(ip(ctx, "link", "del", b))
	}
	return first
}

// cleanLeftovers deletes the Nets of processes that no longer exist.
func cleanLeftovers(ctx context.Context) error {
	links, spaces, err := names(ctx)
	if err != nil {
		return fmt.Errorf("netns: listing leftovers: %w", err)
	}
	dead := map[string]bool{}
	for _, name := range append(links, spaces...) {
		m := nameRE.FindStringSubmatch(name)
		pid, _ := strconv.ParseInt(m[1], 16, 64)
		if pid == int64(os.Getpid()&0xffffff) || alive(int(pid)) {
			continue
		}
		dead["ovn"+m[1]] = true
	}
	for p := range dead {
		if err := deletePrefix(ctx, p); err != nil {
			return fmt.Errorf("netns: deleting the leftovers of process %s: %w", p[3:], err)
		}
	}
	return nil
}

func alive(pid int) bool {
	err := syscall.Kill(pid, 0)
	return err == nil || errors.Is(err, syscall.EPERM)
}

// freeSubnet picks 10.A.B with no address or route of the root
// namespace in 10.A.B.0/24.
func freeSubnet(ctx context.Context) (string, error) {
	addrs, err := ipOutput(ctx, "-4", "-o", "addr", "show")
	if err != nil {
		return "", fmt.Errorf("netns: listing addresses: %w", err)
	}
	routes, err := ipOutput(ctx, "-4", "route", "show", "table", "all")
	if err != nil {
		return "", fmt.Errorf("netns: listing routes: %w", err)
	}
	used := addrs + routes
	for range 1000 {
		// 10.100–10.249 leaves the low, commonly used 10.x alone.
		s := fmt.Sprintf("10.%d.%d", 100+rand.IntN(150), rand.IntN(256))
		if !strings.Contains(used, " "+s+".") && !strings.Contains(used, "\n"+s+".") && !strings.HasPrefix(used, s+".") {
			return s, nil
		}
	}
	return "", errors.New("netns: no free 10.A.B.0/24 subnet found")
}
