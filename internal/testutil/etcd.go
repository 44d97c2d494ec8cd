package testutil

import (
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// EtcdMember is one member of an etcd cluster run from Debian's
// etcd-server package.
type EtcdMember struct {
	Name      string
	ClientURL string
	PeerURL   string
	cmd       *exec.Cmd
	exited    chan struct{}
	log       *lockedWriter
	bin       string
	args      []string // what it was started with, for Restart
}

// Log is what the member printed.
func (m *EtcdMember) Log() string {
	m.log.mu.Lock()
	defer m.log.mu.Unlock()
	return m.log.b.String()
}

// Stop kills the member and waits for it.
func (m *EtcdMember) Stop() {
	select {
	case <-m.exited:
		return
	default:
	}
	m.cmd.Process.Signal(syscall.SIGKILL)
	<-m.exited
}

// freePorts returns n TCP ports on 127.0.0.1 that were free a moment ago.
func freePorts(t testing.TB, n int) []int {
	t.Helper()
	var ls []net.Listener
	var ports []int
	for range n {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		ls = append(ls, l)
		ports = append(ports, l.Addr().(*net.TCPAddr).Port)
	}
	for _, l := range ls {
		l.Close()
	}
	return ports
}

// StartEtcd runs an etcd cluster of n members on loopback with the etcd
// binary from Debian's etcd-server package (3.4), each with its data in
// a folder of the test's, and waits until it is healthy. The members are
// killed when the test ends. It returns the members; their ClientURLs
// joined with commas is what ovis's --etcd takes.
func StartEtcd(t testing.TB, n int) []*EtcdMember {
	t.Helper()
	return StartEtcdOn(t, n, "127.0.0.1")
}

// StartEtcdOn is StartEtcd with the members listening on host (an
// address of this machine, such as a bridge's that processes in network
// namespaces reach).
func StartEtcdOn(t testing.TB, n int, host string) []*EtcdMember {
	t.Helper()
	bin := tool(t, "etcd")
	dir := t.TempDir()
	ports := freePorts(t, 2*n)
	var members []*EtcdMember
	var initial []string
	for i := range n {
		m := &EtcdMember{
			Name:      fmt.Sprintf("e%d", i),
			ClientURL: fmt.Sprintf("http://%s:%d", host, ports[2*i]),
			PeerURL:   fmt.Sprintf("http://%s:%d", host, ports[2*i+1]),
			exited:    make(chan struct{}),
			log:       &lockedWriter{b: &strings.Builder{}},
		}
		members = append(members, m)
		initial = append(initial, m.Name+"="+m.PeerURL)
	}
	for _, m := range members {
		m.bin = bin
		m.args = []string{
			"--name", m.Name,
			"--data-dir", filepath.Join(dir, m.Name),
			"--listen-client-urls", m.ClientURL, "--advertise-client-urls", m.ClientURL,
			"--listen-peer-urls", m.PeerURL, "--initial-advertise-peer-urls", m.PeerURL,
			"--initial-cluster", strings.Join(initial, ","),
			"--initial-cluster-token", "ovis-test",
			"--heartbeat-interval", "50", "--election-timeout", "500",
			"--auto-compaction-retention", "1"}
		m.start(t, "new")
		t.Cleanup(func() {
			m.Stop()
			if t.Failed() {
				t.Logf("etcd member %s, the end of its log:\n%s", m.Name, tail(m.Log(), 3000))
			}
		})
	}
	deadline := time.Now().Add(30 * time.Second)
	for _, m := range members {
		for {
			resp, err := http.Get(m.ClientURL + "/health")
			if err == nil {
				ok := resp.StatusCode == 200
				resp.Body.Close()
				if ok {
					break
				}
			}
			if time.Now().After(deadline) {
				t.Fatalf("testutil: etcd member %s not healthy in 30 s: %v\n%s", m.Name, err, m.Log())
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
	return members
}

// start runs the member's process.
func (m *EtcdMember) start(t testing.TB, state string) {
	t.Helper()
	m.cmd = exec.Command(m.bin, append(m.args, "--initial-cluster-state", state)...)
	m.cmd.Stdout = m.log
	m.cmd.Stderr = m.cmd.Stdout
	m.exited = make(chan struct{})
	if err := m.cmd.Start(); err != nil {
		t.Fatalf("testutil: starting etcd: %v", err)
	}
	cmd, exited := m.cmd, m.exited
	go func() { cmd.Wait(); close(exited) }()
}

// Restart starts a stopped member again on its data (it rejoins its
// cluster), and returns at once.
func (m *EtcdMember) Restart(t testing.TB) {
	t.Helper()
	m.Stop()
	m.start(t, "existing")
}

// Leader returns the member that leads the cluster now, asking each
// member that answers (etcd's JSON gateway, /v3/maintenance/status).
func Leader(t testing.TB, ms []*EtcdMember) *EtcdMember {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		for _, m := range ms {
			resp, err := http.Post(m.ClientURL+"/v3/maintenance/status", "application/json", strings.NewReader("{}"))
			if err != nil {
				continue
			}
			var st struct {
				Header struct {
					MemberID string `json:"member_id"`
				} `json:"header"`
				Leader string `json:"leader"`
			}
			err = json.NewDecoder(resp.Body).Decode(&st)
			resp.Body.Close()
			if err == nil && st.Leader != "" && st.Leader != "0" && st.Leader == st.Header.MemberID {
				return m
			}
		}
		if time.Now().After(deadline) {
			t.Fatal("testutil: no etcd member says it leads in 20 s")
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// EtcdEndpoints joins the members' client URLs with commas.
func EtcdEndpoints(ms []*EtcdMember) string {
	var urls []string
	for _, m := range ms {
		urls = append(urls, m.ClientURL)
	}
	return strings.Join(urls, ",")
}

// tail is the last n bytes of s.
func tail(s string, n int) string {
	if len(s) > n {
		return s[len(s)-n:]
	}
	return s
}

// lockedWriter is a strings.Builder safe for a process's output copier
// and the test that reads it.
type lockedWriter struct {
	mu sync.Mutex
	b  *strings.Builder
}

func (w *lockedWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.Write(p)
}
