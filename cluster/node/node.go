// Package node runs one storage node of an ovis cluster: its local
// store, its registration in the membership (etcd), the node-to-node
// protocol server, and a gateway that serves the cluster's VDIs over NBD.
//
// Start assembles the pieces; the packages below do the work:
// cluster/store keeps the objects, cluster/protocol carries requests
// between nodes, cluster/membership talks to etcd, cluster/gateway turns
// a VDI into a block.Device, nbd serves it.
//
// Invariants:
//
//  1. A node serves requests only while its registration holds: when the
//     lease cannot be renewed within its TTL (Registration.Fenced), the
//     node refuses every request on objects, and its gateway's requests
//     wait, until it has registered again under a new lease, raised its
//     tokens to every lock's and taken its VDIs' locks again (member.go).
//     A partitioned node therefore stops taking writes on its own, and
//     serves again by itself once it can reach etcd.
//  2. Every request between nodes is checked against the node's epoch by
//     Handler before it reaches the store, and every mutating request's
//     token against the highest the store has seen for the VDI.
//  3. A VDI is opened once per node, and every NBD connection to it
//     shares that device (CAN_MULTI_CONN). It is writable only while this
//     node holds the VDI's lock, whose revision is the device's token.
//     Once the node learns the lock went to another owner (a stale-token
//     refusal, the lock broken in etcd while the lease lives, or a failed
//     relock) the device refuses writes for good and the next connection
//     opens the VDI afresh (vdis.go).
//  4. After a pause of the process longer than pauseGap, the store's
//     tokens are raised from the locks in etcd before it takes another
//     write (pause.go).
//
// Lock order: Node.mu, then Node.regMu, then vdis.mu; none is held
// across a call to etcd, another node or the disk.
package node

import (
	"context"
	"crypto/rand"
	"crypto/tls"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/ovis-storage/ovis/block"
	"github.com/ovis-storage/ovis/cluster/membership"
	"github.com/ovis-storage/ovis/cluster/protocol"
	"github.com/ovis-storage/ovis/cluster/store"
	"github.com/ovis-storage/ovis/cluster/store/vfs"
	"github.com/ovis-storage/ovis/cluster/view"
	"github.com/ovis-storage/ovis/nbd"
)

// Config is one node's settings.
type Config struct {
	// Dir holds the node's data: objects under Dir/objects, its ID in
	// Dir/node-id, the embedded etcd under Dir/etcd.
	Dir string
	// ID names the node in the membership; empty means the one kept in
	// Dir/node-id, made at the first start.
	ID string
	// Listen is the node-to-node address (host:port). Default
	// 127.0.0.1:7000; port 0 picks one.
	Listen string
	// Advertise is the node-to-node address the others are told to
	// reach this node at (a proxy, a NAT); default the one Listen got.
	Advertise string
	// Etcd lists an external etcd cluster's client URLs. Empty: the node
	// embeds a single-member etcd.
	Etcd []string
	// EtcdListen and EtcdPeer are the embedded etcd's client and peer
	// URLs (defaults http://127.0.0.1:2379 and :2380; port 0 picks one).
	EtcdListen, EtcdPeer string
	// EtcdAdvertise is the embedded etcd's URL as other machines reach
	// it, when EtcdListen listens on every address; default EtcdListen.
	EtcdAdvertise string
	Zone, Weight  uint32
	// NBD is the address the gateway serves VDIs on; empty serves none.
	NBD string
	// NBDListener, when set, is used instead of listening on NBD (so a
	// caller can bind first and change nothing when the port is taken).
	NBDListener net.Listener
	// DefaultVDI is served to an NBD client asking for the empty export
	// name; empty refuses such clients.
	DefaultVDI string
	// Cache is the gateway's cache mode (ovis nbd's --cache).
	Cache block.CacheMode
	// NBDNoFUA serves the VDIs without advertising FUA, so that a client
	// with its write cache off sends each write and then a flush (QEMU's
	// emulated writethrough) instead of FUA writes. A diagnostic, for
	// bench/guest-dd.sh's comparison of the two; the default (false)
	// advertises FUA.
	NBDNoFUA bool
	// TLSCert, TLSKey and TLSCA, when all set, make every node-to-node
	// connection (and admin command) mutual TLS: the node presents the
	// certificate and takes peers whose certificates the CA signed. The
	// same client certificate is used for an external etcd at https URLs.
	TLSCert, TLSKey, TLSCA string
	// Reserve is the space kept free on Dir's file system: writes that
	// would allocate into it get ENOSPC, and recovery pulls nothing that
	// would.
	Reserve int64
	// Dialer, when set, dials the other nodes (tests put
	// cluster/protocol/faultnet there to cut nodes off each other). The
	// default is TCP, with TLS when configured.
	Dialer protocol.Dialer
	// EtcdDialer, when set, dials etcd (tests cut a node off etcd
	// through it). The default is TCP, with TLS when configured.
	EtcdDialer func(ctx context.Context, addr string) (net.Conn, error)
	// ProbeInterval is how often the node probes the other nodes of its
	// epoch, and how long it waits for each (reach.go). The default is
	// 1 s.
	ProbeInterval time.Duration
	// SpaceInterval is how often the node reads its disk's free space,
	// to leave placement when full (space.go). The default is 1 s.
	SpaceInterval time.Duration
	// StoreFS is the file system under the store (nil: the OS's); tests
	// put cluster/store/vfs/errorfs there to fail its syncs and writes.
	StoreFS vfs.FS
	// LeaseTTL is the registration's lease; default 5 s (etcd's minimum
	// is about 2 s).
	LeaseTTL time.Duration
	// IOTimeout bounds how long a request through this node's gateway
	// waits for the cluster (a node to answer, a new epoch, an unfound
	// object's holder to return) before it fails with EIO; default 30 s
	// (gateway.Config.RetryTimeout).
	IOTimeout time.Duration
	Logger    *slog.Logger
	// Registry receives the node's metrics; nil registers none.
	Registry prometheus.Registerer
}

// Node is a running storage node.
type Node struct {
	cfg     Config
	log     *slog.Logger
	dirLock *os.File // flock on Dir/LOCK while the node runs
	addr    string   // the node-to-node address it registered
	id      string
	st      *store.Store
	embed   *membership.Embedded
	mc      *membership.Client
	views   *Views
	pool    *protocol.Pool
	net     *localCaller // the gateway's: in process to this node, the pool to others
	h       *Handler     // serves requests; recovery hides pulled copies in its gates
	psrv    *protocol.Server
	plis    net.Listener
	nsrv    *nbd.Server
	nlis    net.Listener
	vdis    *vdis
	dead    *deadNodes
	rec     *recoverer
	m       *Metrics

	cancel context.CancelFunc // ends the views watch and the recovery loop
	wg     sync.WaitGroup     // the servers' and watchers' goroutines

	// The membership: reg is the registration, live or (while the node
	// rejoins after losing its lease) the lost one; back is closed while
	// reg is live, and open while the node rejoins. regMu guards both,
	// and is taken after mu, never across I/O. keep runs the rejoins;
	// quit is closed when the node is closing, so that nothing waits for
	// a rejoin then.
	// full: the store is at its reserve (space.go); the registration
	// says so.
	full  atomic.Bool
	stuck atomic.Bool // full, but mayLeave said no (logged once)
	// reachLeft: the node dropped its registration for being cut off
	// from its peers (reach.go), and rejoins once it reaches them all.
	reachLeft atomic.Bool
	// unreachable is how many peers this node reports unreachable now.
	unreachable atomic.Int64
	regMu       sync.Mutex
	reg         *membership.Registration
	back        chan struct{}
	keepCancel  context.CancelFunc
	keepDone    chan struct{}
	quit        chan struct{}

	mu      sync.Mutex
	stopped bool
	why     error
	done    chan struct{} // closed when the node stops serving
}

// Start starts a node. It returns once the node is registered and serving.
func Start(ctx context.Context, cfg Config) (_ *Node, err error) {
	if cfg.Dir == "" {
		return nil, errors.New("node: no data directory")
	}
	if cfg.Listen == "" {
		cfg.Listen = "127.0.0.1:7000"
	}
	if cfg.Weight == 0 {
		cfg.Weight = 1
	}
	if cfg.LeaseTTL == 0 {
		cfg.LeaseTTL = 5 * time.Second
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	n := &Node{cfg: cfg, log: cfg.Logger, done: make(chan struct{}), back: make(chan struct{}), quit: make(chan struct{})}
	close(n.back)
	defer func() {
		if err != nil {
			n.teardown(context.Background(), false)
		}
	}()
	if err := os.MkdirAll(cfg.Dir, 0o755); err != nil {
		return nil, fmt.Errorf("node: %w", err)
	}
	if n.dirLock, err = lockDir(cfg.Dir); err != nil {
		return nil, err
	}
	if n.id, err = nodeID(cfg.Dir, cfg.ID); err != nil {
		return nil, err
	}
	n.log = n.log.With("node", n.id)
	n.m = NewMetrics(cfg.Registry)
	if n.st, err = store.Open(filepath.Join(cfg.Dir, "objects"), store.Options{Logger: n.log, Reserve: cfg.Reserve, FS: cfg.StoreFS}); err != nil {
		return nil, fmt.Errorf("node: %w", err)
	}
	endpoints := cfg.Etcd
	if len(endpoints) == 0 {
		ec := membership.EmbedConfig{Dir: filepath.Join(cfg.Dir, "etcd"), Name: n.id,
			ClientURL: cfg.EtcdListen, AdvertiseClientURL: cfg.EtcdAdvertise, PeerURL: cfg.EtcdPeer, Logger: n.log}
		if ec.ClientURL == "" {
			ec.ClientURL = "http://127.0.0.1:2379"
		}
		if ec.PeerURL == "" {
			ec.PeerURL = "http://127.0.0.1:2380"
		}
		if cfg.TLSCert != "" && cfg.TLSKey != "" && cfg.TLSCA != "" {
			// With TLS the embedded etcd takes the node's certificates
			// too: its clients (every node) and peers must present one
			// the CA signed. Its URLs become https.
			ec.TLSCert, ec.TLSKey, ec.TLSCA = cfg.TLSCert, cfg.TLSKey, cfg.TLSCA
			ec.ClientURL = toHTTPS(ec.ClientURL)
			ec.PeerURL = toHTTPS(ec.PeerURL)
			if ec.AdvertiseClientURL != "" {
				ec.AdvertiseClientURL = toHTTPS(ec.AdvertiseClientURL)
			}
		}
		if n.embed, err = membership.StartEmbedded(ctx, ec); err != nil {
			return nil, fmt.Errorf("node: %w", err)
		}
		endpoints = n.embed.Endpoints()
	}
	var serverTLS, clientTLS *tls.Config
	switch {
	case cfg.TLSCert != "" && cfg.TLSKey != "" && cfg.TLSCA != "":
		if serverTLS, err = protocol.ServerTLS(cfg.TLSCert, cfg.TLSKey, cfg.TLSCA); err != nil {
			return nil, fmt.Errorf("node: %w", err)
		}
		if clientTLS, err = protocol.ClientTLS(cfg.TLSCert, cfg.TLSKey, cfg.TLSCA); err != nil {
			return nil, fmt.Errorf("node: %w", err)
		}
	case cfg.TLSCert != "" || cfg.TLSKey != "" || cfg.TLSCA != "":
		return nil, errors.New("node: TLS needs a certificate, its key and the CA, all three")
	}
	mcfg := membership.Config{Endpoints: endpoints, Logger: n.log, Dialer: cfg.EtcdDialer}
	if clientTLS != nil && len(endpoints) > 0 && strings.HasPrefix(endpoints[0], "https://") {
		mcfg.TLS = clientTLS
	}
	if n.mc, err = membership.Connect(ctx, mcfg); err != nil {
		return nil, fmt.Errorf("node: %w", err)
	}
	if n.plis, err = net.Listen("tcp", cfg.Listen); err != nil {
		return nil, fmt.Errorf("node: %w", err)
	}
	if serverTLS != nil {
		n.plis = tls.NewListener(n.plis, serverTLS)
	} else {
		warnOpen(n.log, n.plis.Addr(), "node-to-node")
	}
	if n.addr = cfg.Advertise; n.addr == "" {
		n.addr = n.plis.Addr().String()
	}
	n.checkSpace(ctx) // joins full when it is
	if n.reg, err = n.register(ctx); err != nil {
		return nil, err
	}
	if err := n.fenceFromLocks(ctx); err != nil {
		return nil, err
	}
	wctx, cancel := context.WithCancel(context.Background())
	n.cancel = cancel
	if n.views, err = FollowViews(wctx, n.mc, n.log); err != nil {
		return nil, err
	}
	n.m.watchNode(n)
	dial := cfg.Dialer
	if dial == nil && clientTLS != nil {
		dial = protocol.TLSDialer(clientTLS)
	}
	n.pool = protocol.NewPool(dial)
	n.vdis = newVDIs(n)
	n.dead = &deadNodes{n: n, last: map[string]time.Time{}}
	rec, err := n.mc.Recovered(ctx)
	if err != nil {
		return nil, fmt.Errorf("node: %w", err)
	}
	n.rec = newRecoverer(recoveryEnv{id: n.id, log: n.log, clock: time.Now, st: n.st, meta: n.mc, views: n.views, dead: n.dead}, newAuthority(n.views, n.mc), rec[n.id])
	guard := newPauseGuard(pauseGap, n.fenceFromLocks)
	n.wg.Add(1)
	go func() {
		defer n.wg.Done()
		guard.run(wctx)
	}()
	h := &Handler{Store: n.st, Epochs: n.views, Metrics: n.m, Admin: n.admin, Live: n.live,
		Ready: n.rec.ready, Current: n.rec.current, Agreed: n.rec.agreed, Repair: n.rec.repair, ListFor: n.listFor,
		Resync: guard.check}
	n.h = h
	n.net = &localCaller{self: n.addr, h: h, pool: n.pool}
	n.rec.h, n.rec.net = h, n.net
	n.psrv = protocol.NewServer(h, protocol.ServerOptions{Logger: n.log})
	n.goServe("node-to-node", func() error { return n.psrv.Serve(n.plis) })
	if cfg.NBD != "" || cfg.NBDListener != nil {
		n.nlis = cfg.NBDListener
		if n.nlis == nil {
			if n.nlis, err = net.Listen("tcp", cfg.NBD); err != nil {
				return nil, fmt.Errorf("node: %w", err)
			}
		}
		warnOpen(n.log, n.nlis.Addr(), "NBD")
		if n.nsrv, err = nbd.New(nbd.Config{Exports: n.vdis, ExactNames: true, Logger: n.log}); err != nil {
			return nil, fmt.Errorf("node: %w", err)
		}
		n.goServe("NBD", func() error { return n.nsrv.Serve(context.Background(), n.nlis) })
	}
	n.spawn(func() { n.watchSpace(wctx) })
	n.spawn(func() { n.watchReach(wctx) })
	kctx, kcancel := context.WithCancel(context.Background())
	n.keepCancel, n.keepDone = kcancel, make(chan struct{})
	go func() {
		defer close(n.keepDone)
		n.keepMember(kctx)
	}()
	n.wg.Add(1)
	go func() {
		defer n.wg.Done()
		n.rec.loop(wctx)
	}()
	n.log.Info("node started", "listen", n.plis.Addr().String(), "etcd", strings.Join(endpoints, ","), "epoch", n.views.Epoch())
	return n, nil
}

// pauseGap is the shortest pause of the process that pauseGuard sees:
// after one, the store's tokens are raised from the locks in etcd
// before the next write.
const pauseGap = 200 * time.Millisecond

// fenceFromLocks raises the store's token of every locked VDI to its
// lock's, before the node serves anything, and again after a pause
// (pauseGuard). A node that was away when a
// new owner took a VDI over never got that owner's fence; without this
// it would take the old owner's writes, which every other replica
// refuses.
func (n *Node) fenceFromLocks(ctx context.Context) error {
	locks, err := n.mc.Locks(ctx)
	if err != nil {
		return fmt.Errorf("node: reading the VDI locks: %w", err)
	}
	for _, l := range locks {
		if err := n.st.Fence(l.VDI, l.Token); err != nil && !errors.Is(err, store.ErrStaleToken) {
			return fmt.Errorf("node: fencing vdi %s at its lock's token: %w", l.Name, err)
		}
	}
	return nil
}

// toHTTPS turns an http:// URL into the https:// one.
func toHTTPS(u string) string {
	if rest, ok := strings.CutPrefix(u, "http://"); ok {
		return "https://" + rest
	}
	return u
}

// spawn runs f in a goroutine that Close waits for, unless the node has
// stopped.
func (n *Node) spawn(f func()) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.stopped {
		return
	}
	n.wg.Add(1)
	go func() {
		defer n.wg.Done()
		f()
	}()
}

// goServe runs a server's Serve and stops the node when it fails.
func (n *Node) goServe(what string, serve func() error) {
	n.wg.Add(1)
	go func() {
		defer n.wg.Done()
		if err := serve(); err != nil && !errors.Is(err, protocol.ErrServerClosed) && !errors.Is(err, nbd.ErrServerClosed) && !errors.Is(err, net.ErrClosed) {
			n.stop(fmt.Errorf("node: %s server: %w", what, err))
		}
	}()
}

// warnOpen warns about a server that anyone on the network can reach.
func warnOpen(log *slog.Logger, a net.Addr, what string) {
	if ta, ok := a.(*net.TCPAddr); ok && !ta.IP.IsLoopback() {
		log.Warn("listening without TLS on a non-loopback address: anyone who can reach this port can read and write disks", "server", what, "addr", a.String())
	}
}

// nodeID returns the node's ID: given, or kept in dir.
func nodeID(dir, given string) (string, error) {
	path := filepath.Join(dir, "node-id")
	b, err := os.ReadFile(path)
	switch {
	case err == nil:
		kept := strings.TrimSpace(string(b))
		if given != "" && given != kept {
			return "", fmt.Errorf("node: %s holds the data of node %q, not %q", dir, kept, given)
		}
		return kept, nil
	case !errors.Is(err, os.ErrNotExist):
		return "", fmt.Errorf("node: %w", err)
	}
	id := given
	if id == "" {
		var r [4]byte
		rand.Read(r[:])
		host, _ := os.Hostname()
		id = strings.ToLower(strings.Split(host, ".")[0])
		if id == "" {
			id = "node"
		}
		id += "-" + hex.EncodeToString(r[:])
	}
	if err := os.WriteFile(path, []byte(id+"\n"), 0o644); err != nil {
		return "", fmt.Errorf("node: %w", err)
	}
	return id, nil
}

// ID is the node's ID.
func (n *Node) ID() string { return n.id }

// Addr is the node-to-node address, where admin commands go too.
func (n *Node) Addr() string { return n.plis.Addr().String() }

// NBDAddr is the NBD address, or "".
func (n *Node) NBDAddr() string {
	if n.nlis == nil {
		return ""
	}
	return n.nlis.Addr().String()
}

// EtcdEndpoints are the URLs other nodes join with (the embedded etcd's,
// or the external cluster's).
func (n *Node) EtcdEndpoints() []string {
	if n.embed != nil {
		return []string{n.embed.AdvertisedURL()}
	}
	return append([]string(nil), n.cfg.Etcd...)
}

// Open returns the VDI called name as this node's gateway serves it to
// an NBD client: writable when this node holds (or takes) its lock,
// read-only while another node holds it.
func (n *Node) Open(ctx context.Context, name string) (*nbd.Export, error) {
	return n.vdis.Lookup(ctx, name)
}

// View returns the newest epoch the node follows.
func (n *Node) View() *view.View { return n.views.View() }

// Membership is the node's etcd client.
func (n *Node) Membership() *membership.Client { return n.mc }

// Done is closed when the node stops serving; Err says why.
func (n *Node) Done() <-chan struct{} { return n.done }

// Err is why the node stopped: nil after Close.
func (n *Node) Err() error {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.why
}

// stop ends serving, once, recording why.
func (n *Node) stop(why error) {
	n.mu.Lock()
	if n.stopped {
		n.mu.Unlock()
		return
	}
	n.stopped, n.why = true, why
	n.mu.Unlock()
	if n.nsrv != nil {
		n.nsrv.Close()
	}
	if n.psrv != nil {
		// An ended context makes Shutdown close every connection at once.
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		n.psrv.Shutdown(ctx)
	}
	close(n.done)
}

// Close stops the node cleanly: NBD clients get their last flush, the
// VDIs' locks are released, the node leaves the membership (the others
// move to a new epoch), and the store is closed clean.
func (n *Node) Close(ctx context.Context) error {
	return n.teardown(ctx, false)
}

// Kill stops the node as SIGKILL would, for in-process tests: it stops
// serving at once (NBD connections drop unflushed), keeps its
// registration and its VDIs' locks until their lease runs out, and
// leaves its store as a crash does (store.Store.Crash), so that a node
// started again on its directory recovers as after a crash. A node
// that embeds etcd takes it down with it.
func (n *Node) Kill() error {
	return n.teardown(context.Background(), true)
}

func (n *Node) teardown(ctx context.Context, crash bool) error {
	var errs []error
	close(n.quit)
	if n.keepCancel != nil {
		// No rejoin from now on, so that the registration Leave ends is
		// the last one.
		n.keepCancel()
		<-n.keepDone
	}
	if n.vdis != nil {
		// Requests held for a relock that will not come now fail
		// rather than hold the NBD server's shutdown up.
		n.vdis.abandon(errors.New("node: closing before the VDI's lock was taken again"))
	}
	switch {
	case crash:
		n.stop(errors.New("node: killed"))
	case n.nsrv != nil:
		if err := n.nsrv.Shutdown(ctx); err != nil && !errors.Is(err, nbd.ErrServerClosed) {
			errs = append(errs, err)
		}
	}
	if n.vdis != nil {
		errs = append(errs, n.vdis.closeAll(ctx, crash))
	}
	if reg := n.registration(); reg != nil && !crash {
		if err := reg.Leave(ctx); err != nil && reg.Err() == nil {
			errs = append(errs, fmt.Errorf("node: leaving: %w", err))
		}
	}
	if n.psrv != nil {
		n.psrv.Shutdown(ctx)
	}
	n.stop(nil)
	if n.cancel != nil {
		n.cancel()
	}
	n.wg.Wait()
	if n.views != nil {
		n.views.Wait()
	}
	if n.pool != nil {
		n.pool.Close()
	}
	if n.mc != nil {
		errs = append(errs, n.mc.Close())
	}
	if n.embed != nil {
		errs = append(errs, n.embed.Close())
	}
	if n.st != nil && crash {
		n.st.Crash()
	} else if n.st != nil {
		errs = append(errs, n.st.Close())
	}
	if n.dirLock != nil {
		n.dirLock.Close()
	}
	return errors.Join(errs...)
}

// ErrDirInUse is returned by Start when another process runs a node on
// the same data directory.
var ErrDirInUse = errors.New("in use by another ovis node")

// lockDir takes an exclusive flock on dir/LOCK, so that two nodes never
// share a store (or an embedded etcd's data).
func lockDir(dir string) (*os.File, error) {
	f, err := os.OpenFile(filepath.Join(dir, "LOCK"), os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		return nil, fmt.Errorf("node: %w", err)
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		f.Close()
		if errors.Is(err, syscall.EWOULDBLOCK) {
			return nil, fmt.Errorf("node: %s: %w", dir, ErrDirInUse)
		}
		return nil, fmt.Errorf("node: locking %s: %w", dir, err)
	}
	return f, nil
}
