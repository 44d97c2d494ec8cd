package membership

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/url"
	"sync"
	"time"

	"go.etcd.io/etcd/client/pkg/v3/transport"
	"go.etcd.io/etcd/server/v3/embed"
	"go.uber.org/zap"
)

// EmbedConfig configures a single-member etcd run inside the process.
type EmbedConfig struct {
	// Dir holds etcd's data. Required.
	Dir string
	// Name is the member's name. The default is "ovis".
	Name string
	// ClientURL is where clients connect. Port 0 picks a free port;
	// Endpoints reports the real one. The default is
	// "http://127.0.0.1:2379".
	ClientURL string
	// AdvertiseClientURL is the URL other machines reach etcd at, when
	// ClientURL listens on all addresses ("http://0.0.0.0:2379"). Port 0
	// stands for the port ClientURL got. The default is ClientURL.
	AdvertiseClientURL string
	// PeerURL is where other members would connect. Port 0 is allowed.
	// The default is "http://127.0.0.1:2380".
	PeerURL string
	// Logger, when not nil, receives etcd's warnings and errors.
	// Nil discards etcd's logs.
	Logger *slog.Logger
	// TLSCert, TLSKey and TLSCA, when all set, make etcd serve its client
	// and peer URLs (which must then be https://) with mutual TLS: it
	// presents the certificate and takes only clients and peers whose
	// certificates the CA signed.
	TLSCert, TLSKey, TLSCA string
	// CompactionRetention is how much history etcd keeps: it compacts
	// periodically, keeping this much time of revisions. The default is
	// one hour; a negative value turns compaction off.
	CompactionRetention time.Duration
}

// Embedded is a running single-member etcd.
//
// Safe for concurrent use. Release with Close.
type Embedded struct {
	e          *embed.Etcd
	endpoints  []string
	advertised string
	once       sync.Once
}

// StartEmbedded starts etcd and returns once it serves clients, or
// when ctx ends.
func StartEmbedded(ctx context.Context, cfg EmbedConfig) (*Embedded, error) {
	if cfg.Dir == "" {
		return nil, fmt.Errorf("membership: embedded etcd: no data dir")
	}
	if cfg.Name == "" {
		cfg.Name = "ovis"
	}
	if cfg.ClientURL == "" {
		cfg.ClientURL = "http://127.0.0.1:2379"
	}
	if cfg.PeerURL == "" {
		cfg.PeerURL = "http://127.0.0.1:2380"
	}
	if cfg.CompactionRetention == 0 {
		cfg.CompactionRetention = time.Hour
	}
	curl, err := url.Parse(cfg.ClientURL)
	if err != nil {
		return nil, fmt.Errorf("membership: embedded etcd: client url %q: %w", cfg.ClientURL, err)
	}
	purl, err := url.Parse(cfg.PeerURL)
	if err != nil {
		return nil, fmt.Errorf("membership: embedded etcd: peer url %q: %w", cfg.PeerURL, err)
	}
	ec := embed.NewConfig()
	ec.Name = cfg.Name
	ec.Dir = cfg.Dir
	ec.ListenClientUrls = []url.URL{*curl}
	aurl := curl
	if cfg.AdvertiseClientURL != "" {
		if aurl, err = url.Parse(cfg.AdvertiseClientURL); err != nil {
			return nil, fmt.Errorf("membership: embedded etcd: advertised client url %q: %w", cfg.AdvertiseClientURL, err)
		}
	}
	ec.AdvertiseClientUrls = []url.URL{*aurl}
	ec.ListenPeerUrls = []url.URL{*purl}
	ec.AdvertisePeerUrls = []url.URL{*purl}
	ec.InitialCluster = ec.InitialClusterFromName(ec.Name)
	if cfg.TLSCert != "" || cfg.TLSKey != "" || cfg.TLSCA != "" {
		if cfg.TLSCert == "" || cfg.TLSKey == "" || cfg.TLSCA == "" {
			return nil, errors.New("membership: embedded etcd: TLS needs a certificate, its key and the CA, all three")
		}
		if curl.Scheme != "https" || purl.Scheme != "https" {
			return nil, fmt.Errorf("membership: embedded etcd: with TLS the client and peer URLs must be https:// (have %s and %s)", cfg.ClientURL, cfg.PeerURL)
		}
		info := transport.TLSInfo{CertFile: cfg.TLSCert, KeyFile: cfg.TLSKey, TrustedCAFile: cfg.TLSCA, ClientCertAuth: true}
		ec.ClientTLSInfo, ec.PeerTLSInfo = info, info
	}
	if cfg.CompactionRetention > 0 {
		ec.AutoCompactionMode = embed.CompactorModePeriodic
		ec.AutoCompactionRetention = cfg.CompactionRetention.String()
	}
	lg := zap.NewNop()
	if cfg.Logger != nil {
		lg = zap.New(slogCore{log: cfg.Logger, min: zap.WarnLevel})
	}
	ec.ZapLoggerBuilder = embed.NewZapLoggerBuilder(lg)
	e, err := embed.StartEtcd(ec)
	if err != nil {
		return nil, fmt.Errorf("membership: embedded etcd in %s: %w", cfg.Dir, err)
	}
	select {
	case <-e.Server.ReadyNotify():
		// Ready and cancelled at once: select picks either, and a
		// cancelled start must fail whichever it picked.
		if err := ctx.Err(); err != nil {
			e.Close()
			return nil, fmt.Errorf("membership: embedded etcd in %s: %w", cfg.Dir, err)
		}
	case err := <-e.Err():
		e.Close()
		return nil, fmt.Errorf("membership: embedded etcd in %s: %w", cfg.Dir, err)
	case <-ctx.Done():
		e.Close()
		return nil, fmt.Errorf("membership: embedded etcd in %s: %w", cfg.Dir, ctx.Err())
	}
	m := &Embedded{e: e}
	for _, l := range e.Clients {
		m.endpoints = append(m.endpoints, curl.Scheme+"://"+l.Addr().String())
	}
	if len(m.endpoints) == 0 {
		e.Close()
		return nil, errors.New("membership: embedded etcd: no client listener")
	}
	m.advertised = m.endpoints[0]
	if cfg.AdvertiseClientURL != "" {
		u := *aurl
		if u.Port() == "0" {
			_, port, _ := net.SplitHostPort(e.Clients[0].Addr().String())
			u.Host = net.JoinHostPort(u.Hostname(), port)
		}
		m.advertised = u.String()
	}
	return m, nil
}

// AdvertisedURL returns the URL other machines connect to: the
// AdvertiseClientURL (with the real port for port 0), or the first
// endpoint.
func (m *Embedded) AdvertisedURL() string { return m.advertised }

// Endpoints returns the client URLs etcd serves, with the real ports.
// The caller owns the slice.
func (m *Embedded) Endpoints() []string { return append([]string(nil), m.endpoints...) }

// Err returns a channel that gets etcd's fatal errors while it runs.
func (m *Embedded) Err() <-chan error { return m.e.Err() }

// Close stops etcd and waits for it. A second call returns ErrClosed.
func (m *Embedded) Close() error {
	err := ErrClosed
	m.once.Do(func() {
		m.e.Close()
		err = nil
	})
	return err
}

// randomID returns 16 random hex digits.
func randomID() string {
	var b [8]byte
	rand.Read(b[:])
	return hex.EncodeToString(b[:])
}
