package serve

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"path/filepath"
	"time"

	"github.com/ovis-storage/ovis/block"
	"github.com/ovis-storage/ovis/cmd/ovis/internal/img"
	"github.com/ovis-storage/ovis/export"
	"github.com/ovis-storage/ovis/image"
	"github.com/ovis-storage/ovis/qcow2"
)

// Defaults of Config and of the ovis nbd command line.
const (
	// DefaultPort is NBD's IANA port, qemu-nbd's default.
	DefaultPort = "10809"
	// DefaultBind is qemu-nbd's default interface: all of them.
	DefaultBind = "0.0.0.0"
	// DefaultShutdownTimeout bounds how long a stop waits for requests in
	// service before connections are cut.
	DefaultShutdownTimeout = 30 * time.Second
	// DefaultCacheCleanInterval is QEMU's cache-clean-interval, in
	// seconds, which ovis nbd and ovis up pass unless told otherwise.
	DefaultCacheCleanInterval = 600
	// maxNameLen is NBD_MAX_STRING_SIZE, the longest export name or
	// description.
	maxNameLen = 4096
)

// Discard and DetectZeroes are the export middleware's policies, under
// qemu-nbd's option names.
type (
	Discard      = export.Discard
	DetectZeroes = export.DetectZeroes
)

// The values of --discard and --detect-zeroes.
const (
	DiscardIgnore     = export.DiscardIgnore
	DiscardUnmap      = export.DiscardUnmap
	DetectZeroesOff   = export.DetectZeroesOff
	DetectZeroesOn    = export.DetectZeroesOn
	DetectZeroesUnmap = export.DetectZeroesUnmap
)

// ParseDiscard parses --discard's values as QEMU does: ignore (or off)
// and unmap (or on). Any other value is qemu-nbd's "Invalid discard mode"
// error.
func ParseDiscard(s string) (Discard, error) {
	switch s {
	case "ignore", "off":
		return DiscardIgnore, nil
	case "unmap", "on":
		return DiscardUnmap, nil
	}
	return 0, fmt.Errorf("Invalid discard mode `%s'", s)
}

// ParseDetectZeroes parses --detect-zeroes's values: off, on, unmap. Any
// other value is qemu-nbd's error.
func ParseDetectZeroes(s string) (DetectZeroes, error) {
	switch s {
	case "off":
		return DetectZeroesOff, nil
	case "on":
		return DetectZeroesOn, nil
	case "unmap":
		return DetectZeroesUnmap, nil
	}
	return 0, fmt.Errorf("Failed to parse detect_zeroes mode: invalid parameter value: %s", s)
}

// ParseCacheMode parses --cache's values as qemu-nbd does, with its error
// message.
func ParseCacheMode(s string) (block.CacheMode, error) {
	m, err := block.ParseCacheMode(s)
	if err != nil {
		return 0, fmt.Errorf("Invalid cache mode `%s'", s)
	}
	return m, nil
}

// Config configures Run: one image served as one export. The zero value
// of every field but File means its default.
type Config struct {
	// File is the image to serve. Required.
	File string
	// Format is "qcow2" or "raw". The default ("") probes the file, as
	// qemu-nbd does without -f.
	Format string

	// Socket is the path of a unix socket to listen on (-k); it must be
	// absolute. When set, Bind and Port are ignored, as qemu-nbd ignores
	// them. A stale socket file there is replaced; any other file is an
	// error.
	Socket string
	// Bind is the address to listen on for TCP (-b). The default is
	// "0.0.0.0".
	Bind string
	// Port is the TCP port or service name (-p). The default is "10809";
	// "0" picks a free port, which Ready reports.
	Port string

	// ExportName is the export's name (-x). The default is "", the name
	// clients ask for when they give none. At most 4096 bytes.
	ExportName string
	// Description is shown to clients that list exports (-D). At most
	// 4096 bytes. The default is none.
	Description string

	// ReadOnly exports the image read-only (-r); writes fail with EPERM.
	ReadOnly bool
	// Persistent keeps serving after the last client left (-t). The
	// default (false) stops once the last client that completed a
	// handshake has disconnected, as qemu-nbd does.
	Persistent bool
	// Shared is the most connections open at once (-e); further clients
	// wait in the listen backlog. CAN_MULTI_CONN is advertised when it is
	// not 1. The default (0) is no limit, as qemu-nbd's -e 0; the ovis nbd
	// command passes qemu-nbd's default, 1.
	Shared int
	// Snapshot sends writes to a temporary qcow2 overlay over File (-s),
	// which is deleted when Run returns; File is opened read-only and
	// never changes.
	Snapshot bool
	// LoadSnapshot exports an internal snapshot of File instead of its
	// active layer, read-only whatever ReadOnly says (-l):
	// "snapshot.id=ID,snapshot.name=NAME" or one ID or name.
	LoadSnapshot string
	// Bitmaps are persistent dirty bitmaps of File to offer as the
	// metadata contexts qemu:dirty-bitmap:NAME (-B).
	Bitmaps []string
	// AllocationDepth offers the metadata context qemu:allocation-depth
	// (-A). The default (false) offers base:allocation and the bitmaps
	// only, as qemu-nbd does.
	AllocationDepth bool

	// Cache is QEMU's cache mode (--cache, -n): host page cache or
	// O_DIRECT, and whether writes are FUA. The default is writeback.
	Cache block.CacheMode
	// Discard is what TRIM does (--discard). The default ignores it.
	Discard Discard
	// DetectZeroes turns all-zero writes into zero writes
	// (--detect-zeroes). The default is off.
	DetectZeroes DetectZeroes

	// Untrusted refuses backing and external data files that are not
	// regular files in the image's own folder (qcow2.Options.Untrusted;
	// --untrusted, an ovis addition), and any format probing: Format must
	// be set, and a backing file's format recorded in the image. The
	// default follows them anywhere and probes, as QEMU does.
	Untrusted bool

	// ImageOpts is the option list File was named by (--image-opts):
	// errors name the image by it, and its options apply to the open
	// (image.Opts.Apply), over the fields above. The command copies its
	// cache mode, read-only, discard and detect-zeroes into this Config.
	ImageOpts *image.Opts

	// L2CacheSize, L2CacheEntrySize, RefcountCacheSize, CacheSize,
	// L2CachePolicy and CacheCleanInterval are QEMU's qcow2 runtime
	// options, passed to qcow2.Options as they are (see there for the
	// defaults of the sizes). CacheCleanInterval is in seconds; its
	// default (0) disables cleaning, and ovis nbd and ovis up pass
	// QEMU's 600. They do not apply to raw images.
	L2CacheSize        int64
	L2CacheEntrySize   int64
	RefcountCacheSize  int64
	CacheSize          int64
	L2CachePolicy      string
	CacheCleanInterval int

	// TLSCert and TLSKey are PEM files of the server's certificate and
	// key. Set both to require TLS: clients that do not start it are
	// refused before they see the export list. The default (both empty)
	// serves without TLS.
	TLSCert, TLSKey string
	// TLSCA is a PEM file of the certificate authorities that client
	// certificates must chain to; setting it makes client certificates
	// mandatory. It needs TLSCert. The default ("") asks for none.
	TLSCA string

	// MetricsAddr, when set, is a TCP address ("127.0.0.1:9100") where
	// Prometheus metrics are served at /metrics while the export is up:
	// requests by operation (count, bytes, errors, latency), FUA writes,
	// connections, the qcow2 metadata-cache counters, and the Go runtime
	// (--metrics, an ovis addition). The default serves none.
	MetricsAddr string

	// PidFile, when set, receives the server's process id once it is
	// listening (--pid-file), and is removed when Run returns.
	PidFile string

	// IdleTimeout closes a client's connection once it has had no
	// request in service and sent no request for this long, or has left a
	// reply unread or a request unfinished for this long
	// (nbd.Config.IdleTimeout; --idle-timeout, an ovis addition). A
	// closed connection counts as a client leaving: without Persistent,
	// the last one stops the server. The default (0) never closes an idle
	// connection, as qemu-nbd does.
	IdleTimeout time.Duration

	// ShutdownTimeout bounds how long a stop waits for requests in
	// service; then connections are cut (the device is still flushed and
	// closed). The final flush is bounded by as much again, for a device
	// whose flush waits on something that can be given up (a lock, a
	// replica); a flush cut short fails the stop. The default is 30
	// seconds.
	ShutdownTimeout time.Duration
	// Logger receives ovis's own logs (connections, requests that
	// failed, the lifecycle). nil means slog.Default().
	Logger *slog.Logger
	// Warnings receives what qemu-nbd itself prints on stderr, in its
	// words: warnings (a probed raw format) and reports of clients whose
	// handshake failed ("ovis: option negotiation failed: ...", the
	// prefix being the ovis command's). nil means they are not shown.
	Warnings io.Writer
	// Listener, when non-nil, is served on instead of binding Socket or
	// Bind and Port (ovis up binds before it creates the disk). Run
	// closes it.
	Listener net.Listener
	// MetricsListener, when non-nil, serves the metrics in place of
	// binding MetricsAddr (which must still be set). Run closes it.
	MetricsListener net.Listener
	// Interrupts delivers the interactive stops (SIGINT, Ctrl-C). With no
	// client attached the first one stops the server as ctx does; with
	// clients attached it reports how many on Warnings and the server
	// stops once they have all disconnected; the next one stops it at
	// once (requests in service still finish). nil means none.
	Interrupts <-chan struct{}
	// EmptyNameDefault serves the export to a client that asks for the
	// empty name too (ovis up). The default refuses it unless ExportName
	// is empty, as qemu-nbd -x does ("export '' not present").
	EmptyNameDefault bool
	// Ready, when non-nil, is called once with the listening address
	// after the pid file was written, before the first client is served.
	Ready func(addr net.Addr)
}

// Validate reports the first invalid field, quoting the bad value in
// qemu-nbd's words where qemu-nbd has them. It accepts zero values, which
// mean defaults.
func (c *Config) Validate() error {
	switch {
	case c.File == "":
		return errors.New("serve: config: no image file")
	case c.Format != "" && c.Format != "qcow2" && c.Format != "raw":
		return fmt.Errorf("Failed to blk_new_open '%s': Unknown driver '%s'", c.File, c.Format)
	case c.Untrusted && c.Format == "":
		return fmt.Errorf("Failed to blk_new_open '%s': %w", c.File, qcow2.ErrProbeUntrusted)
	case c.Socket != "" && !filepath.IsAbs(c.Socket):
		return errors.New("socket path must be absolute")
	case len(c.ExportName) > maxNameLen:
		return fmt.Errorf("export name '%s' too long", c.ExportName)
	case len(c.Description) > maxNameLen:
		return fmt.Errorf("export description '%s' too long", c.Description)
	case c.Shared < 0:
		return fmt.Errorf("Invalid shared device number '%d'", c.Shared)
	case c.Cache > block.CacheUnsafe:
		return fmt.Errorf("Invalid cache mode `%s'", c.Cache)
	case c.Discard > DiscardUnmap:
		return fmt.Errorf("Invalid discard mode `%d'", c.Discard)
	case c.DetectZeroes > DetectZeroesUnmap:
		return fmt.Errorf("Failed to parse detect_zeroes mode: invalid parameter value: %d", c.DetectZeroes)
	case c.DetectZeroes == DetectZeroesUnmap && c.Discard != DiscardUnmap:
		return errors.New("setting detect-zeroes to unmap is not allowed without setting discard operation to unmap")
	case c.L2CacheSize < 0, c.L2CacheEntrySize < 0, c.RefcountCacheSize < 0, c.CacheSize < 0:
		return fmt.Errorf("cache sizes must not be negative (l2-cache-size %d, l2-cache-entry-size %d, refcount-cache-size %d, cache-size %d)",
			c.L2CacheSize, c.L2CacheEntrySize, c.RefcountCacheSize, c.CacheSize)
	case c.CacheCleanInterval < 0:
		return fmt.Errorf("cache-clean-interval %d is negative", c.CacheCleanInterval)
	case (c.TLSCert == "") != (c.TLSKey == ""):
		return errors.New("--tls-cert and --tls-key must be given together")
	case c.TLSCA != "" && c.TLSCert == "":
		return errors.New("--tls-ca needs --tls-cert and --tls-key")
	case c.ShutdownTimeout < 0:
		return fmt.Errorf("serve: config: shutdown timeout %v is negative", c.ShutdownTimeout)
	case c.IdleTimeout < 0:
		return fmt.Errorf("Invalid idle timeout '%v': it must not be negative", c.IdleTimeout)
	}
	if c.LoadSnapshot != "" {
		if _, err := img.ParseSnapshotParam(c.LoadSnapshot); err != nil {
			return err
		}
	}
	switch c.L2CachePolicy {
	case "", "lru", "hitcount", "hitcount-floor":
	default:
		return fmt.Errorf("Invalid l2-cache-policy '%s' (want lru, hitcount or hitcount-floor)", c.L2CachePolicy)
	}
	return nil
}

// withDefaults returns c with zero fields replaced by their defaults.
func (c Config) withDefaults() Config {
	if c.Bind == "" {
		c.Bind = DefaultBind
	}
	if c.Port == "" {
		c.Port = DefaultPort
	}
	if c.ShutdownTimeout == 0 {
		c.ShutdownTimeout = DefaultShutdownTimeout
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c
}

// multiConn reports whether CAN_MULTI_CONN is advertised: whenever more
// than one connection is allowed, read-only or not, as qemu-nbd 7.2 does
// (-e 2 and -e 0 advertise it, -r too; -e 1, the default, does not). Every
// connection gets the one device, so a flush on one covers all.
func (c *Config) multiConn() bool { return c.Shared != 1 }
