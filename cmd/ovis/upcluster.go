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
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/ovis-storage/ovis/block"
	"github.com/ovis-storage/ovis/cluster/membership"
	"github.com/ovis-storage/ovis/cluster/node"
	"github.com/ovis-storage/ovis/cmd/ovis/internal/img"
	"github.com/ovis-storage/ovis/cmd/ovis/internal/serve"
)

// upCluster is `ovis up`'s cluster: what it starts in one process.
type upCluster struct {
	Dir        string // ovis-data
	Nodes      int    // storage nodes in this process
	Size       string // disk0's size when it is created
	Listen     string // NBD
	NodeListen string // the first node's node-to-node and admin address
	EtcdListen string
	EtcdPeer   string
	Metrics    string
	Logger     *slog.Logger
}

const upVDI = serve.UpExport

// runUpCluster starts an embedded etcd and cfg.Nodes storage nodes under
// cfg.Dir, formats the cluster the first time (copies = the number of
// nodes), creates disk0 when it is missing, serves it over NBD and prints
// how to attach it and how another machine joins. It runs until ctx ends,
// then stops every node cleanly.
func runUpCluster(ctx context.Context, cfg upCluster, w io.Writer) (err error) {
	if cfg.Nodes < 1 || cfg.Nodes > 16 {
		return fmt.Errorf("up: --nodes %d: want 1 to 16", cfg.Nodes)
	}
	size, err := parseSizeArg("--size", cfg.Size)
	if err != nil {
		return fmt.Errorf("up: %w", err)
	}
	// Bind the ports before anything is created, so that a port in use
	// leaves the folder as it was.
	nl, err := net.Listen("tcp", cfg.Listen)
	if err != nil {
		return serve.UpListenError("--listen", cfg.Listen, err)
	}
	defer func() {
		if err != nil {
			nl.Close()
		}
	}()
	var ml net.Listener
	if cfg.Metrics != "" {
		if ml, err = net.Listen("tcp", cfg.Metrics); err != nil {
			return serve.UpListenError("--metrics", cfg.Metrics, err)
		}
		ml.Close() // reopened by serveMetrics below
	}
	if probe, perr := net.Listen("tcp", cfg.NodeListen); perr != nil {
		return serve.UpListenError("--node-listen", cfg.NodeListen, perr)
	} else {
		probe.Close()
	}
	reg := prometheus.NewRegistry()
	var nodes []*node.Node
	defer func() {
		// Stop in reverse: the first node holds the embedded etcd the
		// others need to leave cleanly.
		cctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		for i := len(nodes) - 1; i >= 0; i-- {
			if cerr := nodes[i].Close(cctx); cerr != nil && err == nil {
				err = cerr
			}
		}
		if err == nil {
			fmt.Fprintf(w, "stopped: every node left the cluster cleanly; the data is in %s\n", cfg.Dir)
		}
	}()
	for i := 1; i <= cfg.Nodes; i++ {
		nc := node.Config{
			Dir:      filepath.Join(cfg.Dir, fmt.Sprintf("node%d", i)),
			Listen:   "127.0.0.1:0",
			LeaseTTL: 5 * time.Second,
			Logger:   cfg.Logger.With("up-node", i),
			Cache:    block.CacheWriteback,
		}
		if i == 1 {
			nc.Listen, nc.EtcdListen, nc.EtcdPeer = cfg.NodeListen, cfg.EtcdListen, cfg.EtcdPeer
			nc.NBDListener, nc.DefaultVDI = nl, upVDI
			nc.Registry = reg
		} else {
			nc.Etcd = nodes[0].EtcdEndpoints()
		}
		n, err := node.Start(ctx, nc)
		if errors.Is(err, node.ErrDirInUse) {
			return fmt.Errorf("up: %s is in use by another process (another ovis up in this folder?); stop it or pass --dir DIR", nc.Dir)
		}
		if err != nil {
			return fmt.Errorf("up: %w", err)
		}
		nodes = append(nodes, n)
	}
	mc := nodes[0].Membership()
	f, err := mc.GetFormat(ctx)
	switch {
	case errors.Is(err, membership.ErrNotFormatted):
		// The same rules as ovis cluster format: every node started here
		// is its own zone, so copies = nodes passes the zone check.
		v, err := mc.View(ctx)
		if err != nil {
			return fmt.Errorf("up: %w", err)
		}
		if f, err = mc.FormatIn(ctx, v, membership.Format{Copies: cfg.Nodes}, false); err != nil {
			return fmt.Errorf("up: formatting the cluster: %w", err)
		}
		fmt.Fprintf(w, "%s: formatted a new cluster: %d node(s), %d copies, objects of %s\n", cfg.Dir, cfg.Nodes, f.Copies, img.FormatSize(1<<f.ObjectShift))
	case err != nil:
		return fmt.Errorf("up: %w", err)
	default:
		fmt.Fprintf(w, "%s: cluster %s (%d copies), %d node(s) here\n", cfg.Dir, f.ClusterID, f.Copies, cfg.Nodes)
	}
	v, err := mc.GetVDI(ctx, upVDI)
	switch {
	case errors.Is(err, membership.ErrNoVDI):
		if v, err = mc.CreateVDI(ctx, membership.VDI{Name: upVDI, Size: size}); err != nil {
			return fmt.Errorf("up: creating %s: %w", upVDI, err)
		}
		fmt.Fprintf(w, "%s (created, %s VDI, %d copies)\n", upVDI, img.FormatSize(uint64(v.Size)), v.Copies)
	case err != nil:
		return fmt.Errorf("up: %w", err)
	default:
		fmt.Fprintf(w, "%s (exists, %s VDI, %d copies)\n", upVDI, img.FormatSize(uint64(v.Size)), v.Copies)
	}
	if cfg.Metrics != "" {
		if _, err := serveMetrics(ctx, cfg.Metrics, reg, cfg.Logger); err != nil {
			return err
		}
	}
	printUpAttach(w, nl.Addr(), nodes[0])
	select {
	case <-ctx.Done():
	case <-nodes[0].Done():
		if why := nodes[0].Err(); why != nil {
			return why
		}
	}
	return nil
}

// printUpAttach prints the served disk's URL and the commands that use
// it, as the image's ovis up does, then the one with which another
// machine joins.
func printUpAttach(w io.Writer, addr net.Addr, first *node.Node) {
	serve.PrintAttach(w, addr)
	etcd := strings.Join(first.EtcdEndpoints(), ",")
	fmt.Fprintf(w, "another machine joins this cluster with:\n")
	fmt.Fprintf(w, "ovis node --dir ovis-node --etcd %s --listen HOST:7000 --nbd HOST:10809\n", etcd)
	if strings.Contains(etcd, "127.0.0.1") || strings.Contains(etcd, "localhost") {
		fmt.Fprintf(w, "  (the embedded etcd listens on loopback only: start ovis up with --etcd-listen http://IP:2379 --etcd-peer http://IP:2380 --node-listen IP:7000 for other machines to reach it)\n")
	}
	fmt.Fprintf(w, "admin commands: ovis node list -a %s, ovis vdi list -a %s\n", first.Addr(), first.Addr())
}

var _ = os.Stdout
