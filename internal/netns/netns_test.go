package netns

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"
)

// The test binary doubles as the helper process run inside namespaces:
// with NETNS_HELPER set it is an echo server or a one-shot client.
const helperEnv = "NETNS_HELPER"

func TestMain(m *testing.M) {
	if mode := os.Getenv(helperEnv); mode != "" {
		os.Exit(helper(mode, os.Args[len(os.Args)-1]))
	}
	os.Exit(m.Run())
}

// helper runs "echo" (serve addr, echo every line back) or "dial" (send
// a line to addr and wait for it back: exit 0, or 1 with the error).
func helper(mode, addr string) int {
	switch mode {
	case "echo":
		l, err := net.Listen("tcp", addr)
		if err != nil {
			fmt.Println(err)
			return 1
		}
		fmt.Println("ready")
		serveEcho(l)
		return 0
	case "dial":
		if err := ping(addr, time.Second); err != nil {
			fmt.Println(err)
			return 1
		}
		return 0
	}
	fmt.Println("unknown helper mode", mode)
	return 2
}

func serveEcho(l net.Listener) {
	for {
		c, err := l.Accept()
		if err != nil {
			return
		}
		go func() {
			defer c.Close()
			io.Copy(c, c)
		}()
	}
}

// ping dials addr and waits for one line to be echoed, within d each.
func ping(addr string, d time.Duration) error {
	c, err := net.DialTimeout("tcp", addr, d)
	if err != nil {
		return err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(d))
	if _, err := io.WriteString(c, "ping\n"); err != nil {
		return err
	}
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		return err
	}
	if line != "ping\n" {
		return fmt.Errorf("echo gave %q", line)
	}
	return nil
}

// helperCmd returns the test binary run as a helper in namespace i, or
// in the root namespace for i < 0.
func helperCmd(t *testing.T, nt *Net, i int, mode, addr string) *exec.Cmd {
	t.Helper()
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	var cmd *exec.Cmd
	if i < 0 {
		cmd = exec.Command(self, addr)
	} else {
		cmd = nt.Cmd(i, self, addr)
	}
	cmd.Env = append(os.Environ(), helperEnv+"="+mode)
	return cmd
}

// startEcho starts an echo server at addr in namespace i (root for
// i < 0) and waits until it listens.
func startEcho(t *testing.T, nt *Net, i int, addr string) {
	t.Helper()
	cmd := helperCmd(t, nt, i, "echo", addr)
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatalf("echo server in namespace %d: %v", i, err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	line, err := bufio.NewReader(out).ReadString('\n')
	if line != "ready\n" {
		t.Fatalf("echo server in namespace %d at %s: %q %v", i, addr, line, err)
	}
}

// reach dials addr from namespace from (root for from < 0) once.
func reach(t *testing.T, nt *Net, from int, addr string) error {
	t.Helper()
	if from < 0 {
		return ping(addr, time.Second)
	}
	out, err := helperCmd(t, nt, from, "dial", addr).CombinedOutput()
	if err != nil {
		return fmt.Errorf("%v: %s", err, strings.TrimSpace(string(out)))
	}
	return nil
}

// mustReach wants addr reachable from from within 10 s (a healed link
// may take a moment: ARP, the bridge port).
func mustReach(t *testing.T, nt *Net, from int, addr, when string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		err := reach(t, nt, from, addr)
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: %s not reachable from namespace %d: %v", when, addr, from, err)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// TestCutHeal: for each path, the listener is reachable; after Cut of
// one end it is not (three tries); after Heal it is again.
func TestCutHeal(t *testing.T) {
	nt := NewT(t, 3)
	// The root's listener is on the bridge address, as an etcd for the
	// namespaces would be.
	hostEcho := net.JoinHostPort(nt.HostAddr(), "0")
	l, err := net.Listen("tcp", hostEcho)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	go serveEcho(l)
	hostEcho = l.Addr().String()
	ns0Echo := net.JoinHostPort(nt.Addr(0), "5000")
	startEcho(t, nt, 0, ns0Echo)

	for _, tc := range []struct {
		name string
		from int // -1: the root namespace
		addr string
		cut  int
	}{
		{"root to ns0, ns0 cut", -1, ns0Echo, 0},
		{"ns1 to ns0, ns0 cut", 1, ns0Echo, 0},
		{"ns1 to ns0, ns1 cut", 1, ns0Echo, 1},
		{"ns0 to root, ns0 cut", 0, hostEcho, 0},
		{"ns2 to root, ns1 cut (not on the path)", 2, hostEcho, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			mustReach(t, nt, tc.from, tc.addr, "before the cut")
			if err := nt.Cut(tc.cut); err != nil {
				t.Fatal(err)
			}
			onPath := tc.cut == tc.from || tc.addr == ns0Echo && tc.cut == 0
			for try := range 3 {
				err := reach(t, nt, tc.from, tc.addr)
				if onPath && err == nil {
					t.Fatalf("try %d: %s reachable from namespace %d while namespace %d is cut", try, tc.addr, tc.from, tc.cut)
				}
				if !onPath && err != nil {
					t.Fatalf("try %d: %s not reachable from namespace %d, though only namespace %d is cut: %v", try, tc.addr, tc.from, tc.cut, err)
				}
			}
			if err := nt.Heal(tc.cut); err != nil {
				t.Fatal(err)
			}
			mustReach(t, nt, tc.from, tc.addr, "after the heal")
		})
	}
}

// TestCutEstablished: a connection made before the cut carries nothing
// while it lasts, and delivers what was written during it after the
// heal (a partition, not a reset).
func TestCutEstablished(t *testing.T) {
	nt := NewT(t, 1)
	addr := net.JoinHostPort(nt.Addr(0), "5000")
	startEcho(t, nt, 0, addr)
	mustReach(t, nt, -1, addr, "before the cut")
	c, err := net.DialTimeout("tcp", addr, time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	r := bufio.NewReader(c)
	roundTrip := func(msg string, d time.Duration) error {
		c.SetDeadline(time.Now().Add(d))
		if _, err := io.WriteString(c, msg); err != nil {
			return err
		}
		got, err := r.ReadString('\n')
		if err == nil && got != msg {
			t.Fatalf("echo of %q gave %q", msg, got)
		}
		return err
	}
	if err := roundTrip("one\n", 2*time.Second); err != nil {
		t.Fatalf("before the cut: %v", err)
	}
	if err := nt.Cut(0); err != nil {
		t.Fatal(err)
	}
	if err := roundTrip("two\n", 2*time.Second); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("during the cut: the established connection gave %v, want a timeout", err)
	}
	if err := nt.Heal(0); err != nil {
		t.Fatal(err)
	}
	// TCP's retransmission backoff decides when "two" goes again.
	c.SetDeadline(time.Now().Add(30 * time.Second))
	got, err := r.ReadString('\n')
	if err != nil || got != "two\n" {
		t.Fatalf("after the heal: %q, %v; want the echo of what was written during the cut", got, err)
	}
}

// TestClose: Close removes every link and namespace of the Net, a second
// Close says ErrClosed, and New removes what a dead process left.
func TestClose(t *testing.T) {
	ctx := context.Background()
	nt, err := New(ctx, 2)
	if err != nil {
		t.Fatal(err)
	}
	links, spaces, err := names(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if n := count(nt.prefix, links, spaces); n != 5 {
		t.Fatalf("after New: %d links and namespaces of %s, want 5 (bridge, 2 veths, 2 namespaces): %v %v", n, nt.prefix, links, spaces)
	}
	if err := nt.Close(); err != nil {
		t.Fatal(err)
	}
	if err := nt.Close(); !errors.Is(err, ErrClosed) {
		t.Fatalf("second Close: %v, want ErrClosed", err)
	}
	links, spaces, _ = names(ctx)
	if n := count(nt.prefix, links, spaces); n != 0 {
		t.Fatalf("after Close: %v %v still there", links, spaces)
	}

	// A dead process's leftovers: a PID that is not running.
	pid := 0xfffff0
	for alive(pid) {
		pid--
	}
	dead := fmt.Sprintf("ovn%06x01", pid)
	for _, s := range [][]string{
		{"link", "add", dead + "b", "type", "bridge"},
		{"netns", "add", dead + "-0"},
		{"link", "add", dead + "h0", "type", "veth", "peer", "name", "eth0", "netns", dead + "-0"},
	} {
		if err := ip(ctx, s...); err != nil {
			deletePrefix(ctx, dead)
			t.Fatal(err)
		}
	}
	nt2, err := New(ctx, 1)
	if err != nil {
		deletePrefix(ctx, dead)
		t.Fatal(err)
	}
	defer nt2.Close()
	links, spaces, _ = names(ctx)
	if n := count(dead, links, spaces); n != 0 {
		deletePrefix(ctx, dead)
		t.Fatalf("New left a dead process's %v %v", links, spaces)
	}
	if n := count(nt2.prefix, links, spaces); n != 3 {
		t.Fatalf("the new Net has %d links and namespaces, want 3: %v %v", n, links, spaces)
	}
}

func count(prefix string, lists ...[]string) int {
	n := 0
	for _, l := range lists {
		for _, s := range l {
			if strings.HasPrefix(s, prefix) {
				n++
			}
		}
	}
	return n
}
