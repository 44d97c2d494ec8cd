package serve

import (
	"context"
	"errors"
	"fmt"
	"os"
	"runtime"
	"time"

	"github.com/ovis-storage/ovis/block"
	"github.com/ovis-storage/ovis/nbd"
	"github.com/ovis-storage/ovis/qcow2"
)

// Run serves the image c names over NBD until ctx ends (the caller ties
// it to SIGINT and SIGTERM), the listener fails, or — without
// c.Persistent — the last client has disconnected. Then it stops as
// doc.go describes: requests in service finish and reply, the device is
// flushed and closed, and the socket, pid file and overlay are removed.
//
// It returns Validate's error, the open, bind, TLS and pid file errors in
// qemu-nbd's words, a failed accept, or the first error of the teardown
// (a failed flush or close). A stop asked for by ctx or by the last
// client leaving is not an error.
func Run(ctx context.Context, c Config) error {
	if err := c.Validate(); err != nil {
		return err
	}
	c = c.withDefaults()
	log := c.Logger
	if c.Cache.Direct() && os.Getenv("GOMAXPROCS") == "" {
		// O_DIRECT reads block in the kernel for the device's latency.
		// A goroutine blocked in a syscall keeps its P until sysmon
		// takes it back, so with one P per core few requests reach the
		// disk at once. More Ps let the in-flight requests all be in
		// the kernel together (measured: 4 KiB random reads at queue
		// depth 16 went from 17 K to 33 K IOPS on 2 cores).
		runtime.GOMAXPROCS(max(runtime.NumCPU(), 8))
	}

	tlsCfg, clientCAs, err := loadTLS(&c)
	if err != nil {
		return err
	}
	dev, format, img, err := openDevice(ctx, &c)
	if err != nil {
		return err
	}
	var m *metrics
	if c.MetricsAddr != "" {
		m = newMetrics()
		if img != nil {
			m.watchImage(img, c.File)
		}
		// Outermost, so that it times what the client waits for.
		dev = m.Wrap(dev)
	}
	closeDev := func() error { return closeDevice(dev, c.ShutdownTimeout) }

	// The metrics listener comes up before the NBD one, so that whoever
	// waits for the NBD socket can scrape at once.
	if m != nil {
		stopMetrics, err := m.serveHTTP(c.MetricsAddr, c.MetricsListener, log)
		if err != nil {
			closeDev()
			return err
		}
		defer stopMetrics()
	}
	ln, err := listen(&c)
	if err != nil {
		closeDev()
		return err
	}
	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	var idle func()
	if !c.Persistent {
		idle = stop
	}
	g := newGate(ln, c.Shared, idle)
	connState := g.connState
	if m != nil {
		connState = m.connState(connState)
	}

	bitmaps, err := exportBitmaps(img, c.Bitmaps)
	if err != nil {
		g.Close()
		closeDev()
		return err
	}
	maxConns := nbd.DefaultMaxConnections
	if c.Shared > maxConns {
		maxConns = c.Shared
	}
	var blockStatus func(int64, time.Duration, error)
	if m != nil {
		blockStatus = m.BlockStatus
	}
	srv, err := nbd.New(nbd.Config{
		Exports: nbd.FixedExports(nbd.Export{
			Name:        c.ExportName,
			Description: c.Description,
			Device:      dev,
			ReadOnly:    c.ReadOnly || c.LoadSnapshot != "",
			MultiConn:   c.multiConn(),
			Bitmaps:     bitmaps,

			NoAllocationDepth: !c.AllocationDepth,
		}),
		TLS:            tlsCfg,
		ClientCAs:      clientCAs,
		MaxConnections: maxConns,
		IdleTimeout:    c.IdleTimeout,
		ConnState:      connState,
		BlockStatus:    blockStatus,
		ExactNames:     !c.EmptyNameDefault,
		HandshakeFailed: func(err error) {
			// qemu-nbd reports these with error_report.
			if msg, ok := nbd.QemuReport(err); ok && c.Warnings != nil {
				fmt.Fprintf(c.Warnings, "ovis: %s\n", msg)
			}
		},
		Logger: log,
	})
	if err != nil {
		g.Close()
		closeDev()
		return err
	}
	cleanupFiles := func() {
		if c.Socket != "" {
			if err := os.Remove(c.Socket); err != nil && !errors.Is(err, os.ErrNotExist) {
				log.Warn("removing socket failed", "err", err)
			}
		}
		if c.PidFile != "" {
			if err := os.Remove(c.PidFile); err != nil && !errors.Is(err, os.ErrNotExist) {
				log.Warn("removing pid file failed", "err", err)
			}
		}
	}
	if c.PidFile != "" {
		if err := writePidFile(c.PidFile); err != nil {
			g.Close()
			srv.Close()
			closeDev()
			cleanupFiles()
			return err
		}
	}

	log.Info("serving", "file", c.File, "format", format, "addr", ln.Addr().String(), "export", c.ExportName,
		"read_only", c.ReadOnly, "cache", c.Cache.String(), "shared", c.Shared, "multi_conn", c.multiConn(),
		"persistent", c.Persistent, "snapshot", c.Snapshot, "tls", tlsCfg != nil)
	if c.Ready != nil {
		c.Ready(ln.Addr())
	}

	served := make(chan error, 1)
	go func() { served <- srv.Serve(runCtx, g) }()
	var (
		serveErr error
		draining bool
		why      = "last client left"
	)
wait:
	for {
		select {
		case <-runCtx.Done():
			serveErr = <-served
			break wait
		case serveErr = <-served:
			break wait
		case <-c.Interrupts:
			// A token from clients that left before this interrupt
			// must not end the wait for those attached now.
			select {
			case <-g.empty:
			default:
			}
			n := g.clients()
			if n == 0 || draining {
				why = "interrupted"
				stop()
				continue
			}
			// Stopping now would fail the guest's next I/O: wait
			// for its clients to leave unless told again.
			draining = true
			log.Info("interrupted with clients attached; waiting for them to disconnect", "clients", n)
			if c.Warnings != nil {
				fmt.Fprintf(c.Warnings, "ovis: %s attached: serving until %s, then stopping; Ctrl-C again stops now (%s next I/O fails)\n",
					plural(n, "client is", "clients are"), pick(n, "it disconnects", "they disconnect"), pick(n, "its", "their"))
			}
		case <-g.empty:
			if draining {
				why = "clients left after interrupt"
				stop()
			}
		}
	}
	switch {
	case errors.Is(serveErr, context.Canceled), errors.Is(serveErr, context.DeadlineExceeded), errors.Is(serveErr, nbd.ErrServerClosed):
		serveErr = nil
	case serveErr != nil:
		// Returned, and reported by the command: not logged twice.
		log.Info("accept failed", "err", serveErr)
	}

	switch {
	case ctx.Err() != nil:
		why = "signal"
	case serveErr != nil:
		why = "listener failed"
	}
	log.Info("stopping", "reason", why)
	sctx, cancel := context.WithTimeout(context.Background(), c.ShutdownTimeout)
	err = srv.Shutdown(sctx)
	cancel()
	if err != nil && !errors.Is(err, nbd.ErrServerClosed) {
		log.Warn("requests in service did not finish in time; connections cut", "timeout", c.ShutdownTimeout)
	}
	devErr := closeDev()
	if devErr != nil {
		log.Info("flushing and closing the image failed", "file", c.File, "err", devErr)
		devErr = fmt.Errorf("closing %s: %w", c.File, devErr)
	}
	cleanupFiles()
	if devErr == nil && serveErr == nil {
		log.Info("stopped", "file", c.File)
	}
	return errors.Join(serveErr, devErr)
}

// closeDevice flushes dev and closes it, as the last step of a stop. The
// flush may wait at most grace for what its context can end (a lock, a
// replica, a network): a device that never answers must not keep the
// process from exiting, as the requests in service cannot (Shutdown cuts
// them after the same grace). The flush has a grace of its own rather
// than what is left of Shutdown's, so that requests that used all of
// theirs do not fail the flush too. A flush cut short is an error, and
// the device is closed all the same.
func closeDevice(dev block.Device, grace time.Duration) error {
	ctx, cancel := context.WithTimeout(context.Background(), grace)
	defer cancel()
	ferr := dev.Flush(ctx)
	if ferr != nil {
		ferr = fmt.Errorf("flush: %w", ferr)
	}
	return errors.Join(ferr, dev.Close())
}

// plural is "1 client is" or "N clients are".
func plural(n int, one, many string) string {
	if n == 1 {
		return "1 " + one
	}
	return fmt.Sprintf("%d %s", n, many)
}

// pick chooses the singular or plural wording for n.
func pick(n int, one, many string) string {
	if n == 1 {
		return one
	}
	return many
}

// exportBitmaps makes the -B bitmaps of img exportable, with qemu-nbd's
// messages for one that is missing or inconsistent. As in QEMU, a name is
// looked up down the backing chain (so -s exports the bitmaps of the image
// under its overlay), the first image that has it wins, and the bitmaps
// are listed in the reverse of their order on the command line.
func exportBitmaps(img *qcow2.Image, names []string) ([]nbd.ExportBitmap, error) {
	var out []nbd.ExportBitmap
	for i := len(names) - 1; i >= 0; i-- {
		name := names[i]
		owner, found := findBitmap(img, name)
		switch {
		case found == nil:
			return nil, fmt.Errorf("Bitmap '%s' is not found", name)
		case found.InUse:
			return nil, fmt.Errorf("Bitmap '%s' is inconsistent and cannot be used", name)
		}
		out = append(out, nbd.ExportBitmap{Name: name, Extent: func(off, n int64) (int64, bool, error) {
			// A backing image may be shorter than the export; past
			// its end the bitmap reads clean, as QEMU's does.
			if size := owner.Size(); off >= size {
				return n, false, nil
			}
			return owner.BitmapExtent(name, off, n)
		}})
	}
	return out, nil
}

// findBitmap returns the first image down img's backing chain that holds
// a bitmap called name, and that bitmap.
func findBitmap(img *qcow2.Image, name string) (*qcow2.Image, *qcow2.Bitmap) {
	for img != nil {
		for _, b := range img.Bitmaps() {
			if b.Name == name {
				return img, &b
			}
		}
		img, _ = block.As[*qcow2.Image](img.Backing())
	}
	return nil, nil
}
