package nbd

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// TestPKI is a certificate authority with a server and a client
// certificate, made fresh for one test. It is exported for the interop
// tests in package nbd_test.
type TestPKI struct {
	CAPool *x509.CertPool
	// Server is the server's certificate, for localhost and 127.0.0.1.
	Server tls.Certificate
	// Client is a client certificate signed by the CA.
	Client tls.Certificate
	// Stranger is a client certificate signed by another CA.
	Stranger tls.Certificate
	// ClientDir holds ca-cert.pem, client-cert.pem and client-key.pem, as
	// libnbd's tls-certificates expects; CADir holds only ca-cert.pem.
	ClientDir, CADir string
}

// NewTestPKI makes a CA, a server and client certificates and the libnbd
// certificate folders.
func NewTestPKI(t testing.TB) *TestPKI {
	t.Helper()
	caKey, caCert, caDER := makeCA(t, "ovis test CA")
	p := &TestPKI{CAPool: x509.NewCertPool()}
	p.CAPool.AddCert(caCert)
	p.Server = leaf(t, caKey, caCert, &x509.Certificate{
		Subject:     pkix.Name{CommonName: "localhost"},
		DNSNames:    []string{"localhost"},
		IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1), net.IPv6loopback},
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	})
	p.Client = leaf(t, caKey, caCert, &x509.Certificate{
		Subject:     pkix.Name{CommonName: "ovis client"},
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	})
	otherKey, otherCert, _ := makeCA(t, "someone else's CA")
	p.Stranger = leaf(t, otherKey, otherCert, &x509.Certificate{
		Subject:     pkix.Name{CommonName: "stranger"},
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	})

	p.ClientDir, p.CADir = t.TempDir(), t.TempDir()
	caPEM := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: caDER})
	keyDER, err := x509.MarshalPKCS8PrivateKey(p.Client.PrivateKey)
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range []struct {
		dir, name string
		data      []byte
	}{
		{p.ClientDir, "ca-cert.pem", caPEM},
		{p.ClientDir, "client-cert.pem", pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: p.Client.Certificate[0]})},
		{p.ClientDir, "client-key.pem", pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER})},
		{p.CADir, "ca-cert.pem", caPEM},
	} {
		if err := os.WriteFile(filepath.Join(f.dir, f.name), f.data, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	return p
}

// serialNumber returns a random certificate serial number.
func serialNumber(t testing.TB) *big.Int {
	n, err := rand.Int(rand.Reader, big.NewInt(1<<62))
	if err != nil {
		t.Fatal(err)
	}
	return n
}

func makeCA(t testing.TB, name string) (*ecdsa.PrivateKey, *x509.Certificate, []byte) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber:          serialNumber(t),
		Subject:               pkix.Name{CommonName: name},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(24 * time.Hour),
		IsCA:                  true,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	return key, cert, der
}

func leaf(t testing.TB, caKey *ecdsa.PrivateKey, ca *x509.Certificate, tmpl *x509.Certificate) tls.Certificate {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl.SerialNumber = serialNumber(t)
	tmpl.NotBefore = time.Now().Add(-time.Hour)
	tmpl.NotAfter = time.Now().Add(24 * time.Hour)
	tmpl.KeyUsage = x509.KeyUsageDigitalSignature
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}
}
