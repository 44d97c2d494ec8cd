package serve

import (
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"os"
)

// loadTLS reads the certificate, key and optional client CA files of c.
// It returns nil, nil when TLS is not configured.
func loadTLS(c *Config) (*tls.Config, *x509.CertPool, error) {
	if c.TLSCert == "" {
		return nil, nil, nil
	}
	cert, err := tls.LoadX509KeyPair(c.TLSCert, c.TLSKey)
	if err != nil {
		return nil, nil, fmt.Errorf("Failed to load TLS certificate %s and key %s: %w", c.TLSCert, c.TLSKey, err)
	}
	cfg := &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12}
	if c.TLSCA == "" {
		return cfg, nil, nil
	}
	pem, err := os.ReadFile(c.TLSCA)
	if err != nil {
		return nil, nil, fmt.Errorf("Failed to load TLS CA: %w", err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return nil, nil, fmt.Errorf("Failed to load TLS CA: no PEM certificate in %s", c.TLSCA)
	}
	return cfg, pool, nil
}
