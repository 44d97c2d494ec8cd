package serve

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"

	"github.com/ovis-storage/ovis/block"
	"github.com/ovis-storage/ovis/cmd/ovis/internal/img"
)

// UpExport is the export name ovis up serves its disk under.
const UpExport = "disk0"

// UpConfig configures Up. The zero value of every field means its
// default.
type UpConfig struct {
	// Dir holds the disk images. The default is "ovis-data".
	Dir string
	// Size is the virtual size of a new disk, with qemu-img's suffixes.
	// The default is "20G". An existing disk keeps its size.
	Size string
	// Listen is the TCP address to serve on. The default is
	// "127.0.0.1:10809"; port 0 picks a free port, which the printed
	// URLs show.
	Listen string
	// Metrics, when set, is the address of the Prometheus endpoint (see
	// Config.MetricsAddr). The default serves none.
	Metrics string
	// Logger receives the server's logs. nil means slog.Default().
	Logger *slog.Logger
}

// Up is `ovis up`: it makes sure Dir/disk0.qcow2 exists (a sparse qcow2
// image of Size when it is new), serves it over NBD on Listen as export
// "disk0" — writeback cache, persistent, any number of connections with
// CAN_MULTI_CONN — and prints to w how to attach it. It serves until ctx
// ends, then stops as Run does: the image is flushed and closed cleanly.
// It returns PrepareDisk's and Run's errors, and a bad Listen address.
func Up(ctx context.Context, cfg UpConfig, w io.Writer) error {
	if cfg.Listen == "" {
		cfg.Listen = "127.0.0.1:" + DefaultPort
	}
	host, port, err := net.SplitHostPort(cfg.Listen)
	if err != nil {
		return fmt.Errorf("up: --listen %q: %w", cfg.Listen, err)
	}
	if host == "" {
		host = DefaultBind
	}
	path, err := img.PrepareDisk(img.UpConfig{Dir: cfg.Dir, Size: cfg.Size}, w)
	if err != nil {
		return err
	}
	err = Run(ctx, Config{
		File:               path,
		Format:             "qcow2",
		Bind:               host,
		Port:               port,
		ExportName:         UpExport,
		AllocationDepth:    true,
		Persistent:         true,
		Shared:             0,
		Cache:              block.CacheWriteback,
		CacheCleanInterval: DefaultCacheCleanInterval,
		MetricsAddr:        cfg.Metrics,
		Logger:             cfg.Logger,
		Ready: func(addr net.Addr) {
			printAttach(w, addr)
		},
	})
	if err != nil {
		return err
	}
	fmt.Fprintf(w, "stopped: %s is flushed and closed\n", path)
	return nil
}

// printAttach prints the URL of the served disk and the commands that use
// it.
func printAttach(w io.Writer, addr net.Addr) {
	host, port, err := net.SplitHostPort(addr.String())
	if err != nil {
		host, port = "127.0.0.1", DefaultPort
	}
	if ip := net.ParseIP(host); ip != nil && ip.IsUnspecified() {
		host = "127.0.0.1"
	}
	uri := fmt.Sprintf("nbd://%s/%s", net.JoinHostPort(host, port), UpExport)
	fmt.Fprintf(w, "serving %s at %s (cache writeback); stop with Ctrl-C\n", UpExport, uri)
	fmt.Fprintln(w, "attach it with one of:")
	fmt.Fprintf(w, "qemu-system-x86_64 -drive file=%s,format=raw,cache=writeback\n", uri)
	fmt.Fprintf(w, "nbdinfo %s\n", uri)
	fmt.Fprintf(w, "qemu-img info %s\n", uri)
}
