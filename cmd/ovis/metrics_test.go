package main

import (
	"io"
	"net"
	"net/http"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// scrape fetches a Prometheus text page and returns each sample's value by
// its full name with labels, as printed ("m{a=\"b\"}").
func scrape(t *testing.T, url string) map[string]float64 {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("GET %s: %v %s\n%s", url, err, resp.Status, body)
	}
	out := map[string]float64{}
	for _, line := range strings.Split(string(body), "\n") {
		if line == "" || line[0] == '#' {
			continue
		}
		i := strings.LastIndexByte(line, ' ')
		v, err := strconv.ParseFloat(line[i+1:], 64)
		if err != nil {
			t.Fatalf("bad sample %q", line)
		}
		out[line[:i]] = v
	}
	return out
}

// TestNBDMetrics: `ovis nbd --metrics` serves Prometheus metrics whose
// counters follow what a real client did: reads, writes, FUA writes,
// flushes, connections, and the qcow2 L2 cache's misses and hits.
func TestNBDMetrics(t *testing.T) {
	dir := shortTempDir(t)
	img := filepath.Join(dir, "m.qcow2")
	// 64 MiB with 64 KiB clusters: 1 L2 table; a 64 KiB L2 cache holds it.
	runTool(t, "qemu-img", "create", "-f", "qcow2", img, "64M")
	maddr := net.JoinHostPort("127.0.0.1", freePort(t))
	s := startNBD(t, nbdRun{args: []string{"-t", "--metrics", maddr, "-f", "qcow2", img}})
	url := "http://" + maddr + "/metrics"

	before := scrape(t, url)
	if before[`ovis_block_requests_total{op="read"}`] != 0 {
		t.Fatalf("reads counted before any client: %v", before[`ovis_block_requests_total{op="read"}`])
	}
	qemuIONBD(t, s.uri, "write -P 1 0 64k", "write -f -P 2 1M 4k", "read -P 1 0 64k", "read -P 2 1M 4k", "read 8M 4k", "flush")
	m := scrape(t, url)

	for _, c := range []struct {
		name string
		min  float64
	}{
		{`ovis_block_requests_total{op="read"}`, 3},
		{`ovis_block_requests_total{op="write"}`, 2},
		{`ovis_block_requests_total{op="flush"}`, 1},
		{`ovis_block_fua_writes_total`, 1},
		{`ovis_block_bytes_total{op="write"}`, 64<<10 + 4<<10},
		{`ovis_block_bytes_total{op="read"}`, 64<<10 + 8<<10},
		{`ovis_nbd_connections_accepted_total`, 1},
		{`ovis_block_request_seconds_count{op="read"}`, 3},
		{`ovis_qcow2_cache_hits_total{cache="l2",image="` + img + `"}`, 1},
		{`ovis_qcow2_cache_writebacks_total{cache="l2",image="` + img + `"}`, 1},
		{`ovis_qcow2_cache_capacity_entries{cache="l2",image="` + img + `"}`, 1},
		{`go_goroutines`, 1},
	} {
		v, ok := m[c.name]
		if !ok || v < c.min {
			t.Errorf("%s = %v (present %v), want at least %v", c.name, v, ok, c.min)
		}
	}
	// Exactly one FUA write was sent (write -f); the rest were plain.
	if v := m[`ovis_block_fua_writes_total`]; v != 1 {
		t.Errorf("FUA writes = %v, want 1", v)
	}
	if v := m[`ovis_block_request_errors_total{op="read"}`]; v != 0 {
		t.Errorf("read errors = %v, want 0", v)
	}
	// The client has gone: soon no connection is open.
	for i := 0; ; i++ {
		v := scrape(t, url)[`ovis_nbd_connections{state="transmission"}`]
		if v == 0 {
			break
		}
		if i == 100 {
			t.Fatalf("open connections 5 s after the client left = %v", v)
		}
		time.Sleep(50 * time.Millisecond)
	}
	s.stop(syscall.SIGTERM)
}

// TestNBDMetricsBadAddr: an address that cannot be bound stops ovis nbd
// with an error naming it, before it serves.
func TestNBDMetricsBadAddr(t *testing.T) {
	dir := shortTempDir(t)
	img := filepath.Join(dir, "m.qcow2")
	runTool(t, "qemu-img", "create", "-f", "qcow2", img, "1M")
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	r := ovis(t, dir, "nbd", "-k", filepath.Join(dir, "s.sock"), "--metrics", l.Addr().String(), img)
	if r.code == 0 || !strings.Contains(r.stderr, "metrics: listen on "+l.Addr().String()) {
		t.Fatalf("exit %d, stderr %q", r.code, r.stderr)
	}
}
