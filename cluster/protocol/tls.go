package protocol

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"net"
	"os"
)

// loadPair and loadPool read the files of a mutual-TLS config.
func loadPair(cert, key string) (tls.Certificate, error) {
	c, err := tls.LoadX509KeyPair(cert, key)
	if err != nil {
		return tls.Certificate{}, fmt.Errorf("protocol: tls: certificate %s, key %s: %w", cert, key, err)
	}
	return c, nil
}

func loadPool(ca string) (*x509.CertPool, error) {
	pem, err := os.ReadFile(ca)
	if err != nil {
		return nil, fmt.Errorf("protocol: tls: CA file: %w", err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return nil, fmt.Errorf("protocol: tls: CA file %s: no PEM certificate", ca)
	}
	return pool, nil
}

// ServerTLS returns the config of a node's listener for mutual TLS: it
// presents cert (PEM, with key) and requires every peer to present a
// client certificate signed by the CAs in ca (PEM). TLS 1.3 only.
// Wrap the listener with tls.NewListener before Server.Serve.
func ServerTLS(cert, key, ca string) (*tls.Config, error) {
	pair, err := loadPair(cert, key)
	if err != nil {
		return nil, err
	}
	pool, err := loadPool(ca)
	if err != nil {
		return nil, err
	}
	return &tls.Config{
		Certificates: []tls.Certificate{pair},
		ClientAuth:   tls.RequireAndVerifyClientCert,
		ClientCAs:    pool,
		MinVersion:   tls.VersionTLS13,
	}, nil
}

// ClientTLS returns the config a node dials its peers with for mutual
// TLS: it presents cert (PEM, with key) and verifies the peer's
// certificate against the CAs in ca (PEM). TLS 1.3 only. The peer's
// name is checked as usual: set ServerName, or let TLSDialer take it
// from the address.
func ClientTLS(cert, key, ca string) (*tls.Config, error) {
	pair, err := loadPair(cert, key)
	if err != nil {
		return nil, err
	}
	pool, err := loadPool(ca)
	if err != nil {
		return nil, err
	}
	return &tls.Config{
		Certificates: []tls.Certificate{pair},
		RootCAs:      pool,
		MinVersion:   tls.VersionTLS13,
	}, nil
}

// TLSDialer returns a Dialer for Pool that dials TCP with keepalive and
// does the TLS handshake of cfg (from ClientTLS) before returning. When
// cfg.ServerName is empty the host of the address is verified.
func TLSDialer(cfg *tls.Config) Dialer {
	d := &tls.Dialer{NetDialer: &net.Dialer{KeepAlive: keepAlive}, Config: cfg}
	return func(ctx context.Context, addr string) (net.Conn, error) {
		return d.DialContext(ctx, "tcp", addr)
	}
}
