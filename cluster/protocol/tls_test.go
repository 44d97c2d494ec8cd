package protocol

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// pki is a CA and the files of certificates it signed.
type pki struct {
	dir  string
	cert *x509.Certificate
	key  *ecdsa.PrivateKey
}

func newPKI(t *testing.T, name string) *pki {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: name},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(time.Hour),
		IsCA:                  true,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageCertSign,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, _ := x509.ParseCertificate(der)
	p := &pki{dir: t.TempDir(), cert: cert, key: key}
	p.write(t, name+"-ca.pem", "CERTIFICATE", der)
	return p
}

func (p *pki) write(t *testing.T, file, typ string, der []byte) string {
	t.Helper()
	path := filepath.Join(p.dir, file)
	if err := os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

func (p *pki) caFile() string { return filepath.Join(p.dir, p.cert.Subject.CommonName+"-ca.pem") }

// issue writes a certificate for name (also valid for 127.0.0.1) and
// its key, and returns their files.
func (p *pki) issue(t *testing.T, name string, serial int64) (cert, key string) {
	t.Helper()
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(serial),
		Subject:      pkix.Name{CommonName: name},
		DNSNames:     []string{name},
		IPAddresses:  []net.IP{net.IPv4(127, 0, 0, 1)},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, p.cert, &k.PublicKey, p.key)
	if err != nil {
		t.Fatal(err)
	}
	kder, err := x509.MarshalECPrivateKey(k)
	if err != nil {
		t.Fatal(err)
	}
	return p.write(t, name+".pem", "CERTIFICATE", der), p.write(t, name+"-key.pem", "EC PRIVATE KEY", kder)
}

// TestTLS: calls over mutual TLS work; a peer without a certificate of
// the cluster's CA is refused.
func TestTLS(t *testing.T) {
	noLeaks(t)
	ca := newPKI(t, "cluster")
	srvCert, srvKey := ca.issue(t, "node1", 2)
	cliCert, cliKey := ca.issue(t, "node2", 3)
	scfg, err := ServerTLS(srvCert, srvKey, ca.caFile())
	if err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ts := &testServer{log: new(logBuffer), served: make(chan error, 1), addr: l.Addr().String()}
	ts.s = NewServer(&echoHandler{}, ServerOptions{Logger: discardLogger()})
	go func() { ts.served <- ts.s.Serve(tls.NewListener(l, scfg)) }()
	t.Cleanup(func() { ts.stop(t) })

	ccfg, err := ClientTLS(cliCert, cliKey, ca.caFile())
	if err != nil {
		t.Fatal(err)
	}
	p := NewPool(TLSDialer(ccfg))
	defer p.Close()
	var resp Response
	payload := []byte("over mutual TLS")
	if err := p.Call(ctx, ts.addr, &Request{Op: OpWrite, Object: 1, Payload: payload}, &resp); err != nil {
		t.Fatal(err)
	}
	if string(resp.Payload) != string(reversed(payload)) {
		t.Fatalf("reply %q", resp.Payload)
	}

	// A client of another CA, and a client with no certificate.
	other := newPKI(t, "other")
	oCert, oKey := other.issue(t, "intruder", 4)
	ocfg, err := ClientTLS(oCert, oKey, ca.caFile())
	if err != nil {
		t.Fatal(err)
	}
	nocert := &tls.Config{RootCAs: ccfg.RootCAs, MinVersion: tls.VersionTLS13}
	for name, cfg := range map[string]*tls.Config{"other CA": ocfg, "no certificate": nocert} {
		p := NewPool(TLSDialer(cfg))
		err := p.Call(ctx, ts.addr, &Request{Op: OpStat}, &resp)
		p.Close()
		if err == nil {
			t.Errorf("%s: call succeeded", name)
		}
	}
	// The client checks the server too.
	bad := ccfg.Clone()
	bad.ServerName = "not-node1"
	p2 := NewPool(TLSDialer(bad))
	defer p2.Close()
	var certErr x509.HostnameError
	if err := p2.Call(ctx, ts.addr, &Request{Op: OpStat}, &resp); !errors.As(err, &certErr) {
		t.Errorf("wrong server name: %v", err)
	}
}

func TestTLSFiles(t *testing.T) {
	ca := newPKI(t, "c")
	cert, key := ca.issue(t, "n", 2)
	missing := filepath.Join(t.TempDir(), "missing.pem")
	for _, f := range []func() error{
		func() error { _, err := ServerTLS(missing, key, ca.caFile()); return err },
		func() error { _, err := ServerTLS(cert, key, missing); return err },
		func() error { _, err := ClientTLS(cert, key, key); return err }, // a key is no CA
	} {
		if err := f(); err == nil {
			t.Error("no error")
		}
	}
	if _, err := ClientTLS(cert, key, ca.caFile()); err != nil {
		t.Fatal(err)
	}
}
