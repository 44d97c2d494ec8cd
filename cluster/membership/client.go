package membership

import (
	"context"
	"crypto/tls"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"google.golang.org/grpc"
)

// Config says how to reach etcd.
type Config struct {
	// Endpoints are etcd's client URLs, such as "http://127.0.0.1:2379".
	// At least one is required.
	Endpoints []string
	// Prefix is put before every key. It must start and end with '/'.
	// The default is "/ovis/".
	Prefix string
	// DialTimeout bounds Connect's first round trip. The default is 5 s.
	DialTimeout time.Duration
	// TLS, when not nil, is used for every connection to etcd.
	TLS *tls.Config
	// Logger receives the package's logs. Nil means slog.Default().
	Logger *slog.Logger
	// Dialer, when set, opens the client's connections to etcd (tests
	// cut a node off etcd through it: cluster/protocol/faultnet). The
	// default is TCP.
	Dialer func(ctx context.Context, addr string) (net.Conn, error)
}

// DefaultPrefix is the Prefix when Config leaves it empty.
const DefaultPrefix = "/ovis/"

// defaultDialTimeout is the DialTimeout when Config leaves it zero.
const defaultDialTimeout = 5 * time.Second

// withDefaults fills the zero fields.
func (cfg Config) withDefaults() Config {
	if cfg.Prefix == "" {
		cfg.Prefix = DefaultPrefix
	}
	if cfg.DialTimeout == 0 {
		cfg.DialTimeout = defaultDialTimeout
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	return cfg
}

// Validate reports the first bad field, naming its value.
func (cfg Config) Validate() error {
	cfg = cfg.withDefaults()
	if len(cfg.Endpoints) == 0 {
		return fmt.Errorf("membership: config: no etcd endpoints")
	}
	for _, e := range cfg.Endpoints {
		if e == "" {
			return fmt.Errorf("membership: config: empty etcd endpoint in %q", cfg.Endpoints)
		}
	}
	if !strings.HasPrefix(cfg.Prefix, "/") || !strings.HasSuffix(cfg.Prefix, "/") {
		return fmt.Errorf("membership: config: prefix %q: want it to start and end with '/'", cfg.Prefix)
	}
	if cfg.DialTimeout < 0 {
		return fmt.Errorf("membership: config: dial timeout %v is negative", cfg.DialTimeout)
	}
	return nil
}

// Client is the cluster's one etcd client: format, nodes and epochs,
// the VDI table and the VDI locks.
//
// Locking: mu guards the fields in it only; it is never held across a
// call to etcd. A Registration's mutex is taken after the Client's,
// never before.
//
// Safe for concurrent use. Release with Close.
type Client struct {
	cli *clientv3.Client
	k   keys
	log *slog.Logger
	// now is the clock, time.Now outside tests.
	now func() time.Time

	// bg is cancelled by Close; the goroutines of Watch, StartCompactor
	// and every Registration derive from it.
	bg     context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup

	mu struct {
		sync.Mutex
		closed bool
		// regs are the live registrations, which Close stops.
		regs map[*Registration]struct{}
	}
}

// Connect dials etcd and makes one round trip to check that it answers
// within cfg.DialTimeout (or ctx's deadline, if sooner).
func Connect(ctx context.Context, cfg Config) (*Client, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg = cfg.withDefaults()
	ccfg := clientv3.Config{
		Endpoints:   cfg.Endpoints,
		DialTimeout: cfg.DialTimeout,
		TLS:         cfg.TLS,
		Logger:      zap.NewNop(),
	}
	if cfg.Dialer != nil {
		ccfg.DialOptions = []grpc.DialOption{grpc.WithContextDialer(cfg.Dialer)}
	}
	cli, err := clientv3.New(ccfg)
	if err != nil {
		return nil, fmt.Errorf("membership: connect to etcd %q: %w", cfg.Endpoints, err)
	}
	pctx, cancel := context.WithTimeout(ctx, cfg.DialTimeout)
	_, err = cli.Get(pctx, cfg.Prefix+keyFormat, clientv3.WithCountOnly())
	cancel()
	if err != nil {
		cli.Close()
		return nil, fmt.Errorf("membership: connect to etcd %q: %w", cfg.Endpoints, err)
	}
	c := &Client{cli: cli, k: keys{cfg.Prefix}, log: cfg.Logger, now: time.Now}
	c.bg, c.cancel = context.WithCancel(context.Background())
	c.mu.regs = make(map[*Registration]struct{})
	return c, nil
}

// Etcd returns the underlying etcd client, for tools and tests. The
// Client owns it: do not close it.
func (c *Client) Etcd() *clientv3.Client { return c.cli }

// Close stops every goroutine the Client started (watches, compactor,
// the loops of registrations not yet left, whose leases then expire on
// their own after their TTL) and closes the connection. A second call
// returns ErrClosed.
func (c *Client) Close() error {
	c.mu.Lock()
	if c.mu.closed {
		c.mu.Unlock()
		return ErrClosed
	}
	c.mu.closed = true
	regs := make([]*Registration, 0, len(c.mu.regs))
	for r := range c.mu.regs {
		regs = append(regs, r)
	}
	c.mu.Unlock()
	c.cancel()
	for _, r := range regs {
		r.stop()
	}
	c.wg.Wait()
	return c.cli.Close()
}

// goTracked runs f on a goroutine Close waits for, or reports false when
// the client is closed.
func (c *Client) goTracked(f func()) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.mu.closed {
		return false
	}
	c.wg.Add(1)
	go func() {
		defer c.wg.Done()
		f()
	}()
	return true
}

func (c *Client) checkOpen() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.mu.closed {
		return ErrClosed
	}
	return nil
}
