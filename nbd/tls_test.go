package nbd

import (
	"bufio"
	"crypto/tls"
	"testing"
)

// TestTLSWire checks FORCEDTLS on the wire: before STARTTLS every option
// but STARTTLS and ABORT is refused with TLS_REQD (no export is listed)
// and EXPORT_NAME ends the connection; after it, the handshake and
// transmission run over TLS; client certificates are checked when a CA
// pool is configured.
func TestTLSWire(t *testing.T) {
	t.Parallel()
	pki := NewTestPKI(t)
	rw, _ := newRawDevice(t, wireSize, false)
	exports := FixedExports(Export{Name: "secret-export", Device: rw})
	_, sock := startWire(t, Config{Exports: exports, TLS: &tls.Config{Certificates: []tls.Certificate{pki.Server}}})
	_, sockCA := startWire(t, Config{Exports: exports, TLS: &tls.Config{Certificates: []tls.Certificate{pki.Server}}, ClientCAs: pki.CAPool})

	w := dialWire(t, "unix", sock)
	w.hello(flagCFixedNewstyle | flagCNoZeroes)
	for _, opt := range []struct {
		opt  optType
		data []byte
	}{
		{optList, nil},
		{optInfo, infoData("secret-export")},
		{optGo, infoData("")},
		{optStructuredReply, nil},
		{optListMetaContext, metaData("")},
		{1000, nil},
	} {
		w.sendOpt(opt.opt, opt.data)
		if r := w.readOptReply(); r.typ != repErrTLSReqd {
			t.Errorf("%v before STARTTLS: reply %#x %q, want TLS_REQD", opt.opt, r.typ, r.data)
		}
	}
	w.sendOpt(optStartTLS, []byte("x"))
	if r := w.readOptReply(); r.typ != repErrInvalid {
		t.Errorf("STARTTLS with data: %#x", r.typ)
	}
	w.sendOpt(optStartTLS, nil)
	if r := w.readOptReply(); r.typ != repAck {
		t.Fatalf("STARTTLS: %#x", r.typ)
	}
	tc := tls.Client(w.c, &tls.Config{RootCAs: pki.CAPool, ServerName: "localhost"})
	if err := tc.Handshake(); err != nil {
		t.Fatal(err)
	}
	w.c, w.r = tc, bufio.NewReader(tc)
	w.sendOpt(optStartTLS, nil)
	if r := w.readOptReply(); r.typ != repErrInvalid {
		t.Errorf("second STARTTLS: %#x", r.typ)
	}
	w.sendOpt(optList, nil)
	if r := w.replies(); len(r) != 2 || r[0].typ != repServer || string(r[0].data[4:]) != "secret-export" {
		t.Errorf("LIST over TLS: %+v", r)
	}
	w.sendOpt(optGo, infoData("secret-export"))
	if r := w.replies(); r[len(r)-1].typ != repAck {
		t.Fatalf("GO over TLS: %#x", r[len(r)-1].typ)
	}
	w.request(0, cmdWrite, 1, 0, 4096, pattern(9, 4096))
	if r := w.mustReply(0, 0); r.errno != 0 {
		t.Fatal(r.errno)
	}
	w.request(0, cmdDisc, 2, 0, 0, nil)
	w.expectClosed()

	// EXPORT_NAME cannot be refused politely: the connection ends.
	w = dialWire(t, "unix", sock)
	w.hello(flagCFixedNewstyle)
	w.sendOpt(optExportName, []byte("secret-export"))
	w.expectClosed()

	// Without fixed newstyle there is no TLS, so no service.
	w = dialWire(t, "unix", sock)
	w.hello(0)
	w.expectClosed()

	checkClientCerts(t, pki, sockCA)
}

// checkClientCerts: the server at sock, configured with pki's CA as
// ClientCAs, completes the TLS session only for a client certificate that
// CA signed.
func checkClientCerts(t *testing.T, pki *TestPKI, sock string) {
	t.Helper()
	for _, c := range []struct {
		name  string
		certs []tls.Certificate
		ok    bool
	}{
		{"no certificate", nil, false},
		{"stranger", []tls.Certificate{pki.Stranger}, false},
		{"client", []tls.Certificate{pki.Client}, true},
	} {
		w := dialWire(t, "unix", sock)
		w.hello(flagCFixedNewstyle | flagCNoZeroes)
		w.sendOpt(optStartTLS, nil)
		if r := w.readOptReply(); r.typ != repAck {
			t.Fatalf("STARTTLS: %#x", r.typ)
		}
		tc := tls.Client(w.c, &tls.Config{RootCAs: pki.CAPool, ServerName: "localhost", Certificates: c.certs})
		w.c, w.r = tc, bufio.NewReader(tc)
		err := tc.Handshake()
		if err == nil {
			// TLS 1.3 reports a refused client certificate on the
			// first read.
			if _, err = tc.Write(optBytes(optList, nil)); err == nil {
				_, err = w.r.ReadByte()
			}
		}
		if (err == nil) != c.ok {
			t.Errorf("%s: err %v, want ok=%v", c.name, err, c.ok)
		}
	}
}
