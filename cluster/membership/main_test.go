package membership

import (
	"flag"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// shared is the embedded etcd most tests use, each under its own
// prefix, so that they can run in parallel.
var shared *Embedded

func TestMain(m *testing.M) {
	flag.Parse()
	// tmpfs when there is one: etcd fsyncs every write, and the tests
	// make many.
	base := ""
	if st, err := os.Stat("/dev/shm"); err == nil && st.IsDir() {
		base = "/dev/shm"
	}
	dir, err := os.MkdirTemp(base, "membership-etcd-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	start := time.Now()
	shared, err = StartEmbedded(ctx, EmbedConfig{Dir: dir, ClientURL: "http://127.0.0.1:0", PeerURL: "http://127.0.0.1:0"})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.RemoveAll(dir)
		os.Exit(1)
	}
	if testing.Verbose() {
		fmt.Printf("embedded etcd ready in %v at %v\n", time.Since(start).Round(time.Millisecond), shared.Endpoints())
	}
	code := m.Run()
	shared.Close()
	os.RemoveAll(dir)
	os.Exit(code)
}

var prefixes atomic.Int64

// newClient connects to etcd at endpoints under a fresh prefix, or under
// prefix when one is given, and closes the client at the end of the
// test.
func newClient(t testing.TB, endpoints []string, prefix string) *Client {
	t.Helper()
	if prefix == "" {
		prefix = fmt.Sprintf("/t%d-%s/", prefixes.Add(1), strings.ReplaceAll(t.Name(), "/", "_"))
	}
	c, err := Connect(ctx, Config{Endpoints: endpoints, Prefix: prefix, DialTimeout: 2 * time.Second, Logger: testLogger()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// testTTL is the lease of test registrations. It is above MinTTL so
// that a loaded machine (the race detector on 2 shared cores) does not
// delay a renewal past the fence deadline; tests of fencing itself use
// MinTTL.
const testTTL = 4 * time.Second

// join registers a node with id and fails the test on error; it leaves
// at the end of the test.
func join(t testing.TB, c *Client, id string, zone uint32) *Registration {
	t.Helper()
	r, err := c.Join(ctx, NodeInfo{ID: id, Addr: "127.0.0.1:" + id, Zone: zone, Weight: 1}, testTTL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Leave(ctx) })
	return r
}

// eventually polls f every 20 ms until it returns nil or d passes.
func eventually(t testing.TB, d time.Duration, f func() error) {
	t.Helper()
	deadline := time.Now().Add(d)
	for {
		err := f()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("after %v: %v", d, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// testLogger shows the package's logs under -v only.
func testLogger() *slog.Logger {
	if testing.Verbose() {
		return slog.Default()
	}
	return slog.New(slog.DiscardHandler)
}
