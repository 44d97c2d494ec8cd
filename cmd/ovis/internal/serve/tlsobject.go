package serve

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
)

// TLSObject is qemu-nbd's --object tls-creds-x509: a folder of PEM files
// named as QEMU names them (ca-cert.pem; server-cert.pem and
// server-key.pem for a server; client-cert.pem and client-key.pem, both
// optional, for a client).
type TLSObject struct {
	ID string
	// Endpoint is "server" or "client" (the default).
	Endpoint string
	Dir      string
	// VerifyPeer checks the other end's certificate against ca-cert.pem
	// (a server then requires client certificates). The default is on.
	VerifyPeer bool
}

// ParseObject parses an --object option list in QEMU's words. Only
// tls-creds-x509 is known; its files are checked as QEMU loads them, with
// its "Unable to access credentials" message.
func ParseObject(spec string) (*TLSObject, error) {
	o := &TLSObject{Endpoint: "client", VerifyPeer: true}
	typ := ""
	for i, kv := range strings.Split(spec, ",") {
		k, v, ok := strings.Cut(kv, "=")
		if !ok && i == 0 {
			k, v = "qom-type", kv
		}
		switch k {
		case "qom-type":
			typ = v
		case "id":
			o.ID = v
		case "endpoint":
			if v != "client" && v != "server" {
				return nil, fmt.Errorf("Parameter 'endpoint' does not accept value '%s'", v)
			}
			o.Endpoint = v
		case "dir":
			o.Dir = v
		case "verify-peer":
			switch v {
			case "on", "yes", "true":
				o.VerifyPeer = true
			case "off", "no", "false":
				o.VerifyPeer = false
			default:
				return nil, fmt.Errorf("Parameter 'verify-peer' expects 'on' or 'off'")
			}
		default:
			if typ == "tls-creds-x509" {
				return nil, fmt.Errorf("Property 'tls-creds-x509.%s' not found", k)
			}
		}
	}
	switch {
	case typ == "":
		return nil, errors.New("Parameter 'qom-type' is missing")
	case typ != "tls-creds-x509":
		return nil, fmt.Errorf("Parameter 'qom-type' does not accept value '%s'", typ)
	case o.ID == "":
		return nil, errors.New("Parameter 'id' is missing")
	case o.Dir == "":
		return nil, errors.New("Missing 'dir' property value")
	}
	need := []string{}
	if o.VerifyPeer {
		need = append(need, "ca-cert.pem")
	}
	if o.Endpoint == "server" {
		need = append(need, "server-cert.pem", "server-key.pem")
	}
	for _, f := range need {
		p := filepath.Join(o.Dir, f)
		if _, err := os.Stat(p); err != nil {
			var pe *os.PathError
			if errors.As(err, &pe) {
				err = pe.Err
			}
			return nil, fmt.Errorf("Unable to access credentials %s: %s", p, strerror(err))
		}
	}
	return o, nil
}

// FindTLSObject is qemu-nbd's lookup of --tls-creds ID among the objects,
// for a client (list) or a server, with its messages.
func FindTLSObject(objects []*TLSObject, id string, client bool) (*TLSObject, error) {
	want := "server"
	if client {
		want = "client"
	}
	for _, o := range objects {
		if o.ID == id {
			if o.Endpoint != want {
				return nil, fmt.Errorf("Failed to get TLS creds: Expected TLS credentials for a %s endpoint", want)
			}
			return o, nil
		}
	}
	return nil, fmt.Errorf("Failed to get TLS creds: No TLS credentials with id '%s'", id)
}

// ServerFiles returns the PEM files of a server object for Config's
// TLSCert, TLSKey and TLSCA (empty without verify-peer).
func (o *TLSObject) ServerFiles() (cert, key, ca string) {
	cert, key = filepath.Join(o.Dir, "server-cert.pem"), filepath.Join(o.Dir, "server-key.pem")
	if o.VerifyPeer {
		ca = filepath.Join(o.Dir, "ca-cert.pem")
	}
	return cert, key, ca
}

// ClientConfig returns the TLS configuration of a client object that
// checks the server's certificate for hostname.
func (o *TLSObject) ClientConfig(hostname string) (*tls.Config, error) {
	cfg := &tls.Config{ServerName: hostname, MinVersion: tls.VersionTLS12}
	if o.VerifyPeer {
		pem, err := os.ReadFile(filepath.Join(o.Dir, "ca-cert.pem"))
		if err != nil {
			return nil, fmt.Errorf("Unable to read CA certificate: %w", err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("Unable to import CA certificate list %s", filepath.Join(o.Dir, "ca-cert.pem"))
		}
		cfg.RootCAs = pool
	} else {
		cfg.InsecureSkipVerify = true
	}
	cert, key := filepath.Join(o.Dir, "client-cert.pem"), filepath.Join(o.Dir, "client-key.pem")
	if _, err := os.Stat(cert); err == nil {
		c, err := tls.LoadX509KeyPair(cert, key)
		if err != nil {
			return nil, fmt.Errorf("Unable to load client certificate %s and key %s: %w", cert, key, err)
		}
		cfg.Certificates = []tls.Certificate{c}
	}
	return cfg, nil
}
