package main

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// nbdSize is the size nbdinfo reads on a new connection to url.
func nbdSize(t *testing.T, url string) int64 {
	t.Helper()
	out := runTool(t, "nbdinfo", "--size", url)
	n, err := strconv.ParseInt(strings.TrimSpace(out), 10, 64)
	if err != nil {
		t.Fatalf("nbdinfo --size %s: %q: %v", url, out, err)
	}
	return n
}

// TestClusterResize: `ovis vdi resize` is seen by the next NBD connection
// through nodes that already have the VDI open, writable or read-only,
// and the new end can be written through the lock holder and read
// through another node; a client connected across the resize keeps its
// size and its writes; a shrink needs --shrink, as before.
func TestClusterResize(t *testing.T) {
	const (
		oldSize = 8 << 20
		newSize = 16 << 20
		shrunk  = 12 << 20
	)
	nodes := startCluster(t, 3, "")
	n1, n2, n3 := nodes[0], nodes[1], nodes[2]
	dir := t.TempDir()
	n1.mustAdmin(t, "cluster", "format", "--copies", "2")

	url := func(n *clusterNode, vdi string) string { return "nbd://" + n.nbd + "/" + vdi }
	// a is written through n1 (its lock holder) and read through n2;
	// b the other way round.
	vdis := []struct {
		name           string
		writer, reader *clusterNode
		model          string
	}{
		{"a", n1, n2, filepath.Join(dir, "a.raw")},
		{"b", n2, n1, filepath.Join(dir, "b.raw")},
	}
	write := func(t *testing.T, v string, n *clusterNode, model, cmd string) {
		t.Helper()
		if r := runQemuIO(t, dir, "-f", "raw", url(n, v), "-c", cmd); r.code != 0 || strings.Contains(r.stdout, "failed") {
			t.Fatalf("qemu-io %q on %s: exit %d\n%s%s\nnode stderr:\n%s", cmd, v, r.code, r.stdout, r.stderr, n.stderr)
		}
		if r := runQemuIO(t, dir, "-f", "raw", model, "-c", cmd); r.code != 0 {
			t.Fatal(r.stdout, r.stderr)
		}
	}
	for _, v := range vdis {
		n1.mustAdmin(t, "vdi", "create", v.name, strconv.Itoa(oldSize))
		if r := qemuImg(t, dir, "create", "-f", "raw", v.model, strconv.Itoa(oldSize)); r.code != 0 {
			t.Fatal(r.stderr)
		}
		// Both nodes open the VDI: the writer takes its lock, the reader
		// serves it read-only.
		write(t, v.name, v.writer, v.model, "write -P 0x11 0 64k")
		if got := nbdSize(t, url(v.reader, v.name)); got != oldSize {
			t.Fatalf("vdi %s through the reader: size %d, want %d", v.name, got, oldSize)
		}
	}

	// A client stays connected to a through n1 and writes while the
	// VDIs grow (through n3, which has neither open).
	q := startQemuIO(t, url(n1, "a"))
	// Connected before the resize: a slow start would see the new size.
	q.do("length", "> 8 MiB")
	var batch []string
	for i := range 32 {
		batch = append(batch, fmt.Sprintf("write -P 0x%02x %d 64k", 0x40+i, 1<<20+i*64<<10))
	}
	// Queued at once: qemu-io runs them one after the other while the
	// resizes go through.
	fmt.Fprintln(q.in, strings.Join(batch, "\n"))
	for _, v := range vdis {
		n3.mustAdmin(t, "vdi", "resize", v.name, strconv.Itoa(newSize))
	}
	// It keeps the size of its handshake: NBD cannot tell it of the new
	// one; it must reconnect. Its writes all landed.
	out := strings.Join(q.do("length", "> 8 MiB"), "\n")
	if n := strings.Count(out, "wrote 65536/65536"); n != len(batch) || strings.Contains(out, "failed") {
		t.Fatalf("%d of %d writes of the connected client went through across the resize:\n%s", n, len(batch), out)
	}
	if r := runQemuIO(t, dir, append([]string{"-f", "raw", vdis[0].model}, interleave("-c", batch)...)...); r.code != 0 {
		t.Fatal(r.stdout, r.stderr)
	}
	q.kill()

	for _, v := range vdis {
		if err := os.Truncate(v.model, newSize); err != nil {
			t.Fatal(err)
		}
		for _, n := range []*clusterNode{v.writer, v.reader} {
			if got := nbdSize(t, url(n, v.name)); got != newSize {
				t.Errorf("vdi %s after resize, new connection to %s: size %d, want %d", v.name, n.addr, got, newSize)
			}
		}
		// The new end is written through the holder, read through the
		// other node.
		write(t, v.name, v.writer, v.model, fmt.Sprintf("write -P 0x77 %d 64k", newSize-64<<10))
		if r := qemuImg(t, dir, "compare", "-f", "raw", "-F", "raw", v.model, url(v.reader, v.name)); r.code != 0 {
			t.Errorf("vdi %s through the reader after the resize: exit %d\n%s%s", v.name, r.code, r.stdout, r.stderr)
		}
	}

	// A shrink without --shrink is refused and changes nothing; with it,
	// the next connection sees the smaller size.
	if r := n3.admin(t, "vdi", "resize", "a", strconv.Itoa(shrunk)); r.code == 0 || !strings.Contains(r.stderr, "shrinking was not allowed") {
		t.Errorf("shrink without --shrink: exit %d, stderr %q", r.code, r.stderr)
	}
	if got := nbdSize(t, url(n1, "a")); got != newSize {
		t.Errorf("after a refused shrink: size %d, want %d", got, newSize)
	}
	// A client connected before the shrink keeps its size, but the node
	// refuses its writes past the new end.
	q = startQemuIO(t, url(n1, "a"))
	q.do("length", "> 16 MiB")
	n3.mustAdmin(t, "vdi", "resize", "a", strconv.Itoa(shrunk), "--shrink")
	for _, n := range []*clusterNode{n1, n2} {
		if got := nbdSize(t, url(n, "a")); got != shrunk {
			t.Errorf("after --shrink, new connection to %s: size %d, want %d", n.addr, got, shrunk)
		}
	}
	// NBD's answer to a write past the end is ENOSPC. (It is the last
	// command: qemu-io's drive stops on ENOSPC, werror=enospc.)
	q.do(fmt.Sprintf("write -P 0x99 %d 4k", shrunk+1<<20), "write failed: No space left on device")
}

// interleave puts flag before every argument: -c a -c b.
func interleave(flag string, args []string) []string {
	out := make([]string, 0, 2*len(args))
	for _, a := range args {
		out = append(out, flag, a)
	}
	return out
}
