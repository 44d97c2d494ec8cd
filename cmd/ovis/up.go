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
	)
	cmd := &cobra.Command{
		Use:   "up",
		Short: "Serve a local disk image over NBD",
		Long: "up creates DIR/disk0.qcow2 (a sparse qcow2 image of SIZE) if it is missing and\n" +
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
			cfg.Interrupts = serveInterrupts()
			cfg.Warnings = cmd.ErrOrStderr()
			return serve.Up(cmd.Context(), cfg, cmd.OutOrStdout())
		},
	}
	cmd.Flags().StringVar(&cfg.Dir, "dir", cfg.Dir, "folder that holds the disk images")
	cmd.Flags().StringVar(&cfg.Size, "size", cfg.Size, "virtual size of a new disk")
	cmd.Flags().StringVar(&cfg.Listen, "listen", cfg.Listen, "TCP address to serve on (port 0: pick a free one)")
	cmd.Flags().StringVar(&cfg.Metrics, "metrics", "", "serve Prometheus metrics at http://ADDR/metrics")
	cmd.Flags().BoolVarP(&verbose, "verbose", "v", false, "log debugging information (--log-level=debug)")
	cmd.Flags().StringVar(&logLevel, "log-level", "warn", "logs on stderr: debug, info, warn, error or none")
	return cmd
}
