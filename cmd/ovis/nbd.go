package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"strconv"

	"github.com/spf13/cobra"

	"github.com/ovis-storage/ovis/block"
	"github.com/ovis-storage/ovis/cmd/ovis/internal/img"
	"github.com/ovis-storage/ovis/cmd/ovis/internal/serve"
)

// newNBDCmd is `ovis nbd`, qemu-nbd 7.2's server mode with its options.
func newNBDCmd() *cobra.Command {
	cfg := serve.Config{Port: serve.DefaultPort, Bind: serve.DefaultBind}
	var (
		shared, cache, discard, detectZeroes   string
		l2Size, l2EntrySize, rcSize, cacheSize string
		noCache, fork, verbose                 bool
		imageOpts                              bool
		logLevel, tlsCreds, tlsHostname        string
		objects                                []string
		list                                   bool
	)
	cmd := &cobra.Command{
		Use:   "nbd [OPTIONS] FILE",
		Short: "Serve a disk image over NBD, or list a server's exports (qemu-nbd compatible)",
		Long: "ovis nbd exports FILE (qcow2 or raw) over the Network Block Device protocol with\n" +
			"qemu-nbd 7.2's options. It serves one export on a TCP port (default 0.0.0.0:10809)\n" +
			"or a unix socket (-k) and stops after the last client disconnects unless -t is\n" +
			"given. SIGTERM stops it at once, as qemu-nbd: requests in service finish, the\n" +
			"image is flushed and closed, the socket and pid file are removed, and it exits\n" +
			"0. SIGINT (Ctrl-C) does the same when no client is attached; with clients\n" +
			"attached (where qemu-nbd stops and their next I/O fails) the first one says how\n" +
			"many on stderr and serves until they disconnect, and a second stops at once.\n\n" +
			"CAN_MULTI_CONN is advertised when more than one connection is allowed (-e other\n" +
			"than 1), as qemu-nbd does; every connection shares one device, so a flush on\n" +
			"one covers the writes of all.\n\n" +
			"With -L it lists the exports of the server at -k, or -b and -p, as qemu-nbd -L\n" +
			"prints them. Like qemu-nbd it prints nothing on stderr in normal operation, -v\n" +
			"or not; ovis's own logs are behind --log-level.",
		Args: cobra.ArbitraryArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			f := cmd.Flags()
			var err error
			if cfg.Shared, err = strconv.Atoi(shared); err != nil || cfg.Shared < 0 {
				return fmt.Errorf("Invalid shared device number '%s'", shared)
			}
			if noCache && f.Changed("cache") {
				return errors.New("-n and --cache can only be specified once")
			}
			if noCache {
				cache = "none"
			}
			if cfg.Cache, err = serve.ParseCacheMode(cache); err != nil {
				return err
			}
			if cfg.Discard, err = serve.ParseDiscard(discard); err != nil {
				return err
			}
			if cfg.DetectZeroes, err = serve.ParseDetectZeroes(detectZeroes); err != nil {
				return err
			}
			var tlsObjects []*serve.TLSObject
			for _, spec := range objects {
				o, err := serve.ParseObject(spec)
				if err != nil {
					return err
				}
				tlsObjects = append(tlsObjects, o)
			}
			if cfg.Socket != "" && !filepath.IsAbs(cfg.Socket) {
				return errors.New("socket path must be absolute")
			}
			if list {
				return runList(cmd, args, cfg, fork, tlsObjects, tlsCreds, tlsHostname)
			}
			if len(args) != 1 {
				return errors.New("Invalid number of arguments\nTry `ovis nbd --help' for more information.")
			}
			cfg.File = args[0]
			switch {
			case tlsCreds != "" && tlsHostname != "":
				return errors.New("TLS hostname is only supported with export list")
			case tlsCreds != "":
				o, err := serve.FindTLSObject(tlsObjects, tlsCreds, false)
				if err != nil {
					return err
				}
				cfg.TLSCert, cfg.TLSKey, cfg.TLSCA = o.ServerFiles()
			case tlsHostname != "":
				return errors.New("--tls-hostname is not permitted without --tls-creds")
			}
			for _, s := range []struct {
				name string
				val  string
				dst  *int64
			}{
				{"l2-cache-size", l2Size, &cfg.L2CacheSize},
				{"l2-cache-entry-size", l2EntrySize, &cfg.L2CacheEntrySize},
				{"refcount-cache-size", rcSize, &cfg.RefcountCacheSize},
				{"cache-size", cacheSize, &cfg.CacheSize},
			} {
				if s.val == "" {
					continue
				}
				v, err := img.ParseSize(s.val)
				if err != nil || v > 1<<62 {
					return fmt.Errorf("Parameter '%s' expects a non-negative number below 2^64", s.name)
				}
				*s.dst = int64(v)
			}
			if imageOpts {
				if err := applyImageOpts(cmd, &cfg); err != nil {
					return err
				}
			}
			if _, err := newLogger(io.Discard, logLevel); err != nil {
				return err
			}
			if err := cfg.Validate(); err != nil {
				return err
			}
			if fork && !serve.IsDaemonChild() {
				err := serve.Daemonize(cmd.ErrOrStderr())
				var exit *serve.ExitError
				if errors.As(err, &exit) {
					os.Exit(exit.Code) // the server printed why
				}
				return err
			}
			// -v is qemu-nbd's: it only matters to the kernel client
			// (-c), so a server prints nothing more. ovis's own logs
			// are behind --log-level.
			_ = verbose
			cfg.Logger, err = newLogger(cmd.ErrOrStderr(), logLevel)
			if err != nil {
				return err
			}
			cfg.Warnings = cmd.ErrOrStderr()
			cfg.Interrupts = serveInterrupts()
			// A server started by --fork tells its parent it is ready; if
			// it cannot, it stops rather than leave the parent waiting.
			ctx, cancel := context.WithCancel(cmd.Context())
			defer cancel()
			var notifyErr error
			cfg.Ready = func(net.Addr) {
				if notifyErr = serve.NotifyReady(); notifyErr != nil {
					cancel()
				}
			}
			if err := serve.Run(ctx, cfg); err != nil {
				return err
			}
			return notifyErr
		},
	}
	cmd.SetFlagErrorFunc(nbdGetoptError)
	f := cmd.Flags()
	f.SortFlags = false
	f.StringVarP(&cfg.Socket, "socket", "k", "", "path of the unix socket to listen on (instead of TCP)")
	f.StringVarP(&cfg.Port, "port", "p", cfg.Port, "TCP port to listen on")
	f.StringVarP(&cfg.Bind, "bind", "b", cfg.Bind, "interface to bind to")
	f.StringVarP(&shared, "shared", "e", "1", "serve up to NUM connections at once (0: no limit); CAN_MULTI_CONN unless 1")
	f.BoolVarP(&cfg.Persistent, "persistent", "t", false, "don't exit on the last connection")
	f.StringVarP(&cfg.ExportName, "export-name", "x", "", "export name")
	f.StringVarP(&cfg.Description, "description", "D", "", "export description for humans")
	f.StringVarP(&cfg.Format, "format", "f", "", "image format: qcow2 or raw (default: probe)")
	f.BoolVarP(&cfg.ReadOnly, "read-only", "r", false, "export read-only")
	f.BoolVarP(&cfg.Snapshot, "snapshot", "s", false, "send writes to a temporary qcow2 overlay, deleted on exit; FILE is not changed")
	f.StringArrayVarP(&cfg.Bitmaps, "bitmap", "B", nil, "offer persistent dirty bitmap NAME as the metadata context qemu:dirty-bitmap:NAME (repeatable)")
	f.StringVarP(&cfg.LoadSnapshot, "load-snapshot", "l", "", "export an internal snapshot of FILE, read-only: snapshot.id=ID,snapshot.name=NAME or ID_OR_NAME")
	f.BoolVarP(&noCache, "nocache", "n", false, "disable host cache (--cache=none)")
	f.StringVar(&cache, "cache", block.CacheWriteback.String(), "cache mode: writeback, writethrough, none, directsync or unsafe")
	f.StringVar(&discard, "discard", "ignore", "discard mode: ignore (TRIM does nothing) or unmap")
	f.StringVar(&detectZeroes, "detect-zeroes", "off", "turn all-zero writes into zero writes: off, on or unmap (needs --discard=unmap)")
	f.BoolVarP(&cfg.AllocationDepth, "allocation-depth", "A", false, "expose the allocation depth (the qemu:allocation-depth metadata context)")
	f.BoolVarP(&list, "list", "L", false, "list exports available from another NBD server (at -k, or -b and -p), as qemu-nbd -L")
	f.StringArrayVar(&objects, "object", nil, "define an object: tls-creds-x509,id=ID,endpoint=server|client,dir=DIR[,verify-peer=on|off] (QEMU's file names in DIR)")
	f.StringVar(&tlsCreds, "tls-creds", "", "use the tls-creds-x509 --object of this id: serve TLS, or list over TLS")
	f.StringVar(&tlsHostname, "tls-hostname", "", "with -L, the name the server's certificate must carry (default: -b)")
	f.BoolVar(&fork, "fork", false, "fork off the server process and exit once it is serving")
	f.StringVar(&cfg.PidFile, "pid-file", "", "write the server's process ID to this file")
	f.BoolVarP(&verbose, "verbose", "v", false, "display extra debugging information (as qemu-nbd: nothing more for a server; see --log-level)")
	f.StringVar(&logLevel, "log-level", "warn", "ovis's own logs on stderr: debug, info, warn, error or none")
	f.StringVar(&l2Size, "l2-cache-size", "", "qcow2 L2 cache size in bytes (default: whole disk, at most 32M)")
	f.StringVar(&l2EntrySize, "l2-cache-entry-size", "", "qcow2 L2 cache entry size in bytes (default: the cluster size, or 4 KiB when the L2 cache cannot cover the disk, as in QEMU)")
	f.StringVar(&rcSize, "refcount-cache-size", "", "qcow2 refcount cache size in bytes (default: 4 clusters)")
	f.StringVar(&cacheSize, "cache-size", "", "qcow2 L2 and refcount caches together, in bytes")
	f.IntVar(&cfg.CacheCleanInterval, "cache-clean-interval", serve.DefaultCacheCleanInterval, "drop qcow2 cache entries unused for this many seconds (0: never)")
	f.StringVar(&cfg.L2CachePolicy, "l2-cache-policy", "lru", "qcow2 L2 cache eviction: lru, hitcount or hitcount-floor")
	f.BoolVar(&imageOpts, "image-opts", false, "treat FILE as an option list: driver=qcow2,file.filename=FILE,cache.direct=on,l2-cache-size=...")
	f.StringVar(&cfg.TLSCert, "tls-cert", "", "PEM certificate: require TLS")
	f.StringVar(&cfg.TLSKey, "tls-key", "", "PEM private key of --tls-cert")
	f.StringVar(&cfg.TLSCA, "tls-ca", "", "PEM CA certificates: require client certificates signed by them")
	f.DurationVar(&cfg.ShutdownTimeout, "shutdown-timeout", serve.DefaultShutdownTimeout, "how long a stop waits for requests in service, and then for the final flush")
	f.BoolVar(&cfg.Untrusted, "untrusted", false, "refuse format probing (-f required), and backing and data files outside the image's folder or not regular files")
	f.StringVar(&cfg.MetricsAddr, "metrics", "", "serve Prometheus metrics (requests, cache counters) at http://ADDR/metrics")
	f.DurationVar(&cfg.IdleTimeout, "idle-timeout", 0, "close a connection idle (no request, unread reply or unfinished request) this long (0: never)")
	return cmd
}

// runList is ovis nbd -L: qemu-nbd --list's checks of the command line,
// with its messages, then serve.List.
func runList(cmd *cobra.Command, args []string, cfg serve.Config, fork bool, objects []*serve.TLSObject, tlsCreds, tlsHostname string) error {
	f := cmd.Flags()
	if len(args) != 0 {
		return errors.New("List mode is incompatible with a file name")
	}
	for _, name := range []string{"export-name", "description", "format", "load-snapshot", "bitmap",
		"allocation-depth", "discard", "cache", "nocache"} {
		if f.Changed(name) {
			return errors.New("List mode is incompatible with per-device settings")
		}
	}
	if fork {
		return errors.New("List mode is incompatible with forking")
	}
	lc := serve.ListConfig{Socket: cfg.Socket, Bind: cfg.Bind, Port: cfg.Port}
	switch {
	case tlsCreds != "":
		o, err := serve.FindTLSObject(objects, tlsCreds, true)
		if err != nil {
			return err
		}
		// QEMU checks the certificate for -b unless told otherwise,
		// even over a unix socket.
		host := tlsHostname
		if host == "" {
			host = cfg.Bind
		}
		if lc.TLS, err = o.ClientConfig(host); err != nil {
			return err
		}
	case tlsHostname != "":
		return errors.New("--tls-hostname is not permitted without --tls-creds")
	}
	return serve.List(cmd.Context(), lc, cmd.OutOrStdout())
}

// pflag's messages and getopt's, which qemu-nbd prints.
var nbdGetoptErrors = []struct {
	re     *regexp.Regexp
	format string
}{
	{regexp.MustCompile(`^unknown flag: (--\S+)$`), "unrecognized option '%s'"},
	{regexp.MustCompile(`^unknown shorthand flag: '(.)' in -\S*$`), "invalid option -- '%s'"},
	{regexp.MustCompile(`^flag needs an argument: '(.)' in -\S*$`), "option requires an argument -- '%s'"},
	{regexp.MustCompile(`^flag needs an argument: (--\S+)$`), "option '%s' requires an argument"},
	{regexp.MustCompile(`^invalid argument ".*" for "(?:-., )?(--\S+)" flag: strconv.ParseBool`), "option '%s' doesn't allow an argument"},
}

// nbdGetoptError words a command-line error as getopt does for
// qemu-nbd, followed by its pointer to --help, each line an error report.
func nbdGetoptError(cmd *cobra.Command, err error) error {
	for _, g := range nbdGetoptErrors {
		if m := g.re.FindStringSubmatch(err.Error()); m != nil {
			return errors.Join(fmt.Errorf(g.format, m[1]), errors.New("Try `ovis nbd --help' for more information."))
		}
	}
	return err
}

// newLogger returns the logger of --log-level: slog's text lines on w at
// that level and above, or none at all for "none".
func newLogger(w io.Writer, level string) (*slog.Logger, error) {
	var l slog.Level
	switch level {
	case "none":
		return slog.New(slog.DiscardHandler), nil
	case "debug":
		l = slog.LevelDebug
	case "info":
		l = slog.LevelInfo
	case "warn":
		l = slog.LevelWarn
	case "error":
		l = slog.LevelError
	default:
		return nil, fmt.Errorf("Invalid log level '%s' (want debug, info, warn, error or none)", level)
	}
	return slog.New(slog.NewTextHandler(w, &slog.HandlerOptions{Level: l})), nil
}

// applyImageOpts reads cfg.File as qemu-nbd reads it under --image-opts:
// an option list naming the file, its format and its options, which take
// the place of -f and of the matching flags (the qcow2 cache options are
// applied when the image is opened).
func applyImageOpts(cmd *cobra.Command, cfg *serve.Config) error {
	if cmd.Flags().Changed("format") {
		return errors.New("--image-opts and -f are mutually exclusive")
	}
	io, err := img.ParseImageOpts(cfg.File)
	if err != nil {
		return fmt.Errorf("Failed to blk_new_open '%s': %w", cfg.File, err)
	}
	cfg.ImageOpts = io
	cfg.File, cfg.Format = io.Filename, io.Driver
	cfg.ReadOnly = cfg.ReadOnly || io.ReadOnly
	if io.HasCache {
		cfg.Cache = io.Cache
	}
	if io.Discard != "" {
		if cfg.Discard, err = serve.ParseDiscard(io.Discard); err != nil {
			return err
		}
	}
	if io.DetectZeroes != "" {
		if cfg.DetectZeroes, err = serve.ParseDetectZeroes(io.DetectZeroes); err != nil {
			return err
		}
	}
	return nil
}
