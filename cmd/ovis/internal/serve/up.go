package serve

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"

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
	// Interrupts delivers Ctrl-C (see Config.Interrupts); nil means
	// none.
	Interrupts <-chan struct{}
	// Warnings receives what an interrupt with clients attached says.
	Warnings io.Writer
	// Logger receives the server's logs. nil means slog.Default().
	Logger *slog.Logger
}

// Up is `ovis up`: it binds Listen, makes sure Dir/disk0.qcow2 exists (a
// sparse qcow2 image of Size when it is new), serves it over NBD as export
// "disk0" (also to a client asking for the default, empty name) —
// writeback cache, persistent, any number of connections with
// CAN_MULTI_CONN — and prints to w how to attach it. It serves until ctx
// ends or Interrupts says so (see Config.Interrupts), then stops as Run
// does: the image is flushed and closed cleanly.
//
// The port (and the metrics port) is bound before the folder or the disk
// is created, so an Up that cannot serve changes nothing. Its errors are
// its own, not qemu-nbd's: they say what is in the way and what to do.
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
	ln, err := net.Listen("tcp", net.JoinHostPort(host, port))
	if err != nil {
		return UpListenError("--listen", net.JoinHostPort(host, port), err)
	}
	defer ln.Close()
	var mln net.Listener
	if cfg.Metrics != "" {
		if mln, err = net.Listen("tcp", cfg.Metrics); err != nil {
			return UpListenError("--metrics", cfg.Metrics, err)
		}
		defer mln.Close()
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
		Listener:           ln,
		ExportName:         UpExport,
		EmptyNameDefault:   true,
		AllocationDepth:    true,
		Persistent:         true,
		Shared:             0,
		Cache:              block.CacheWriteback,
		CacheCleanInterval: DefaultCacheCleanInterval,
		MetricsAddr:        cfg.Metrics,
		MetricsListener:    mln,
		Interrupts:         cfg.Interrupts,
		Warnings:           cfg.Warnings,
		Logger:             cfg.Logger,
		Ready: func(addr net.Addr) {
			PrintAttach(w, addr)
		},
	})
	if le := (*block.LockError)(nil); errors.As(err, &le) && le.Path == path {
		return fmt.Errorf("up: %s is in use by another process (another ovis up in this folder?); stop it or pass --dir DIR", displayPath(path))
	}
	if err != nil {
		return err
	}
	fmt.Fprintf(w, "stopped: %s is flushed and closed\n", path)
	return nil
}

// UpListenError says why ovis up (either kind) cannot serve on addr, and
// what to do.
func UpListenError(flag, addr string, err error) error {
	if errors.Is(err, syscall.EADDRINUSE) {
		return fmt.Errorf("up: %s is in use (another ovis up or NBD server?); stop it or pass %s HOST:PORT", addr, flag)
	}
	return fmt.Errorf("up: cannot listen on %s (%s): %v", addr, flag, err)
}

// displayPath is path relative to the working directory when it lies
// under it, as the user named the folder.
func displayPath(path string) string {
	if wd, err := os.Getwd(); err == nil {
		if rel, err := filepath.Rel(wd, path); err == nil && !strings.HasPrefix(rel, "..") {
			return rel
		}
	}
	return path
}

// PrintAttach prints the URL of disk0 served at addr and the commands
// that use it, for both kinds of ovis up (an image, a cluster's VDI).
// The VM line is complete but for the guest's boot disk: an NBD disk
// holds no operating system of its own, so it is a virtio data disk.
func PrintAttach(w io.Writer, addr net.Addr) {
	host, port, err := net.SplitHostPort(addr.String())
	if err != nil {
		host, port = "127.0.0.1", DefaultPort
	}
	if ip := net.ParseIP(host); ip != nil && ip.IsUnspecified() {
		host = "127.0.0.1"
	}
	hp := net.JoinHostPort(host, port)
	uri := fmt.Sprintf("nbd://%s/%s", hp, UpExport)
	fmt.Fprintf(w, "serving %s at %s (cache writeback); stop with Ctrl-C\n", UpExport, uri)
	fmt.Fprintf(w, "(a client asking for the default export, nbd://%s/, gets %s too)\n", hp, UpExport)
	fmt.Fprintf(w, "attach it to a VM as a virtio data disk next to the guest's own boot disk (BOOT.qcow2 here; or -kernel/-initrd):\n")
	fmt.Fprintf(w, "%s\n", AttachCommand(uri))
	fmt.Fprintln(w, "  (cache=writeback: the guest's flushes reach the disk; cache=unsafe drops them, faster but a crash can lose data)")
	fmt.Fprintln(w, "or look at it with:")
	fmt.Fprintf(w, "nbdinfo %s\n", uri)
	fmt.Fprintf(w, "qemu-img info %s\n", uri)
}

// AttachCommand is the qemu-system-x86_64 line PrintAttach shows for uri.
func AttachCommand(uri string) string {
	return "qemu-system-x86_64 -m 2G -drive file=BOOT.qcow2,format=qcow2,if=virtio -drive file=" + uri + ",format=raw,if=virtio,cache=writeback"
}
