package serve

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"strconv"
	"strings"
	"syscall"

	"github.com/ovis-storage/ovis/nbd"
)

// ListConfig says which server List asks, as qemu-nbd --list's -k, -b
// and -p do.
type ListConfig struct {
	// Socket is the path of the server's unix socket. When set, Bind and
	// Port are ignored.
	Socket string
	// Bind and Port are the server's host and TCP port or service name.
	// The defaults are "0.0.0.0" (which Linux connects to as the local
	// host) and "10809", qemu-nbd's.
	Bind, Port string
	// TLS, when set, starts TLS before listing (qemu-nbd --tls-creds).
	// The default lists in the clear.
	TLS *tls.Config
}

// List is qemu-nbd --list: it connects to the server, lists its exports
// (nbd.ListExports) and prints them to w as qemu-nbd 7.2 does. Its
// errors are qemu-nbd's: "Failed to connect to '0.0.0.0:10809':
// Connection refused", "address resolution failed for HOST:PORT: Name or
// service not known", and the handshake's (see nbd.ListExports); nothing
// is printed then.
func List(ctx context.Context, c ListConfig, w io.Writer) error {
	conn, err := dialList(ctx, c)
	if err != nil {
		return err
	}
	list, err := nbd.ListExports(conn, c.TLS)
	conn.Close()
	if err != nil {
		return err
	}
	return nbd.WriteExportList(w, list)
}

// dialList connects as QEMU's socket_connect does, with its messages.
func dialList(ctx context.Context, c ListConfig) (net.Conn, error) {
	var d net.Dialer
	if c.Socket != "" {
		conn, err := d.DialContext(ctx, "unix", c.Socket)
		if err != nil {
			return nil, fmt.Errorf("Failed to connect to '%s': %s", c.Socket, errnoText(err))
		}
		return conn, nil
	}
	host, port := c.Bind, c.Port
	if host == "" {
		host = DefaultBind
	}
	if port == "" {
		port = DefaultPort
	}
	ips, portNum, err := resolve(ctx, host, port)
	if err != nil {
		return nil, fmt.Errorf("address resolution failed for %s:%s: %s", host, port, err)
	}
	// Every address is tried in turn; the last failure is the one told.
	var last error
	for _, ip := range ips {
		conn, err := d.DialContext(ctx, "tcp", net.JoinHostPort(ip.String(), strconv.Itoa(portNum)))
		if err == nil {
			return conn, nil
		}
		last = err
	}
	return nil, fmt.Errorf("Failed to connect to '%s:%s': %s", host, port, errnoText(last))
}

// resolve looks host and port up as getaddrinfo does, with its messages
// (gai_strerror): a numeric port is taken modulo 2^16, as glibc does.
func resolve(ctx context.Context, host, port string) ([]net.IP, int, error) {
	var p int
	if port != "" && strings.Trim(port, "0123456789") == "" {
		v, err := strconv.ParseUint(port, 10, 64)
		if err != nil {
			v = math.MaxUint64 // strtoul saturates
		}
		p = int(v & 0xffff)
	} else {
		v, err := net.DefaultResolver.LookupPort(ctx, "tcp", port)
		if err != nil {
			return nil, 0, errors.New("Servname not supported for ai_socktype")
		}
		p = v
	}
	if ip := net.ParseIP(host); ip != nil {
		return []net.IP{ip}, p, nil
	}
	addrs, err := net.DefaultResolver.LookupIPAddr(ctx, host)
	if err != nil || len(addrs) == 0 {
		var dns *net.DNSError
		if errors.As(err, &dns) && (dns.IsTemporary || dns.IsTimeout) {
			return nil, 0, errors.New("Temporary failure in name resolution")
		}
		return nil, 0, errors.New("Name or service not known")
	}
	ips := make([]net.IP, len(addrs))
	for i, a := range addrs {
		ips[i] = a.IP
	}
	return ips, p, nil
}

// errnoText is a dial error's cause as strerror words it.
func errnoText(err error) string {
	var errno syscall.Errno
	if errors.As(err, &errno) {
		return strerror(errno)
	}
	return err.Error()
}
