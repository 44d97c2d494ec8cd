package main

import (
	"github.com/spf13/cobra"

	"github.com/ovis-storage/ovis/cmd/ovis/internal/serve"
)

func newUpCmd() *cobra.Command {
	var (
		cfg      = serve.UpConfig{Dir: "ovis-data", Size: "20G", Listen: "127.0.0.1:" + serve.DefaultPort}
		verbose  bool
		logLevel string
		image    bool
		uc       = upCluster{Nodes: 1, NodeListen: defaultAdmin, EtcdListen: "http://127.0.0.1:2379", EtcdPeer: "http://127.0.0.1:2380"}
	)
	cmd := &cobra.Command{
		Use:   "up",
		Short: "Run a one-machine ovis cluster serving disk0 over NBD",
		Long: "up starts, in one process, an embedded etcd and one storage node (--nodes N:\n" +
			"N nodes, copies=N) with their data under DIR, formats the cluster the first\n" +
			"time, creates the VDI disk0 of SIZE when it is missing, and serves it over NBD\n" +
			"on the --listen address (cache writeback, CAN_MULTI_CONN). It prints how to\n" +
			"attach a VM and how another machine joins. Ctrl-C or SIGTERM stops every node\n" +
			"cleanly; starting it again serves the same data.\n\n" +
			"With --image, up serves a local qcow2 file instead, as before the cluster:\n" +
			"up creates DIR/disk0.qcow2 (a sparse qcow2 image of SIZE) if it is missing and\n" +
			"serves it over NBD on the --listen address as export \"disk0\" (cache writeback,\n" +
			"persistent, any number of connections with CAN_MULTI_CONN), printing how to\n" +
			"attach it (a client asking for the default, empty export name gets disk0 too).\n" +
			"It binds the port before it creates anything, so a busy port or a disk in use\n" +
			"by another ovis up leaves the folder as it was.\n\n" +
			"Ctrl-C with no client attached stops it. With clients attached (a VM), the\n" +
			"first Ctrl-C says how many and keeps serving until they disconnect, then\n" +
			"stops; a second Ctrl-C stops at once (their next I/O fails). SIGTERM stops at\n" +
			"once. Every stop lets requests in service finish and flushes and closes the\n" +
			"image cleanly.",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			// What it serves is printed on stdout; the logs repeat
			// it, so they start at warnings.
			if verbose && !cmd.Flags().Changed("log-level") {
				logLevel = "debug"
			}
			var err error
			if cfg.Logger, err = newLogger(cmd.ErrOrStderr(), logLevel); err != nil {
				return err
			}
			if !image {
				uc.Dir, uc.Size, uc.Listen, uc.Metrics, uc.Logger = cfg.Dir, cfg.Size, cfg.Listen, cfg.Metrics, cfg.Logger
				return runUpCluster(cmd.Context(), uc, cmd.OutOrStdout())
			}
			cfg.Interrupts = serveInterrupts()
			cfg.Warnings = cmd.ErrOrStderr()
			return serve.Up(cmd.Context(), cfg, cmd.OutOrStdout())
		},
	}
	cmd.Flags().StringVar(&cfg.Dir, "dir", cfg.Dir, "folder that holds the cluster's data (with --image, the disk image)")
	cmd.Flags().StringVar(&cfg.Size, "size", cfg.Size, "virtual size of a new disk")
	cmd.Flags().BoolVar(&image, "image", false, "serve DIR/disk0.qcow2, a local qcow2 image, instead of a cluster VDI")
	cmd.Flags().IntVar(&uc.Nodes, "nodes", uc.Nodes, "storage nodes to run in this process (copies = nodes when the cluster is new)")
	cmd.Flags().StringVar(&uc.NodeListen, "node-listen", uc.NodeListen, "the first node's node-to-node and admin address")
	cmd.Flags().StringVar(&uc.EtcdListen, "etcd-listen", uc.EtcdListen, "the embedded etcd's client URL")
	cmd.Flags().StringVar(&uc.EtcdPeer, "etcd-peer", uc.EtcdPeer, "the embedded etcd's peer URL")
	cmd.Flags().StringVar(&cfg.Listen, "listen", cfg.Listen, "TCP address to serve on (port 0: pick a free one)")
	cmd.Flags().StringVar(&cfg.Metrics, "metrics", "", "serve Prometheus metrics at http://ADDR/metrics")
	cmd.Flags().BoolVarP(&verbose, "verbose", "v", false, "log debugging information (--log-level=debug)")
	cmd.Flags().StringVar(&logLevel, "log-level", "warn", "logs on stderr: debug, info, warn, error or none")
	return cmd
}
