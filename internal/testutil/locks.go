package testutil

import (
	"bufio"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// LockedBytes returns the offsets of the one-byte locks any process holds
// on the file at path, sorted, as /proc/locks lists them (QEMU's image
// locks are one-byte OFD read locks: 100+i, 200+i).
func LockedBytes(t testing.TB, path string) []int64 {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open("/proc/locks")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	// "1: OFDLCK ADVISORY  READ -1 fd:01:1234 100 100"
	suffix := fmt.Sprintf(":%d", st.Ino)
	var offs []int64
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) < 8 || fields[1] == "->" || !strings.HasSuffix(fields[5], suffix) {
			continue
		}
		dev := strings.Split(fields[5], ":")
		if len(dev) != 3 {
			continue
		}
		maj, _ := strconv.ParseUint(dev[0], 16, 32)
		mnr, _ := strconv.ParseUint(dev[1], 16, 32)
		if unix.Mkdev(uint32(maj), uint32(mnr)) != st.Dev {
			continue
		}
		start, err1 := strconv.ParseInt(fields[6], 10, 64)
		end, err2 := strconv.ParseInt(fields[7], 10, 64)
		if err1 != nil || err2 != nil {
			continue
		}
		for o := start; o <= end; o++ {
			offs = append(offs, o)
		}
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	slices.Sort(offs)
	return slices.Compact(offs)
}

// HoldWithQemuIO starts qemu-io on path with extra arguments (-r, -U, -f
// FMT) and returns once it holds the image, which it does until the test
// ends: it runs one long sleep command.
func HoldWithQemuIO(t testing.TB, path string, args ...string) {
	t.Helper()
	before := len(LockedBytes(t, path))
	cmd := exec.Command(tool(t, "qemu-io"), append(append(args, "-c", "sleep 600000"), path)...)
	StartUntil(t, cmd, func() bool { return len(LockedBytes(t, path)) != before })
}

// StartUntil starts cmd and returns once ready reports true, failing the
// test if cmd exits first or 20 s pass. The returned stop (also run when
// the test ends) sends SIGTERM and, after 10 s, kills.
func StartUntil(t testing.TB, cmd *exec.Cmd, ready func() bool) (stop func()) {
	t.Helper()
	var stderr strings.Builder
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan struct{})
	go func() { cmd.Wait(); close(exited) }()
	stop = func() {
		cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-exited:
		case <-time.After(10 * time.Second):
			cmd.Process.Kill()
			<-exited
		}
	}
	t.Cleanup(stop)
	deadline := time.Now().Add(20 * time.Second)
	for !ready() {
		select {
		case <-exited:
			t.Fatalf("%v exited before it was ready: %s", cmd.Args, stderr.String())
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("%v not ready after 20s", cmd.Args)
		}
		time.Sleep(10 * time.Millisecond)
	}
	return stop
}
