package main

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net"
	"net/http"
	"net/http/pprof"
	"os/signal"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/ovis-storage/ovis/block"
	"github.com/ovis-storage/ovis/cluster/admin"
	"github.com/ovis-storage/ovis/cluster/membership"
	"github.com/ovis-storage/ovis/cluster/node"
	"github.com/ovis-storage/ovis/cluster/object"
	"github.com/ovis-storage/ovis/cluster/protocol"
	"github.com/ovis-storage/ovis/cmd/ovis/internal/img"
	"github.com/ovis-storage/ovis/image"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/schollz/progressbar/v3"
)

// This file holds the cluster's verbs: ovis node (run one, list them),
// ovis cluster, ovis vdi. Admin verbs reach a node with -a HOST:PORT, as
// Sheepdog's dog does; output is a table, or JSON with --output=json.

const defaultAdmin = "127.0.0.1:7000"

// adminFlags are the flags every admin verb takes.
type adminFlags struct {
	addr   string
	output string
	tls    tlsFlags
}

// tlsFlags are a node's or an admin command's mutual-TLS files.
type tlsFlags struct{ cert, key, ca string }

func (t *tlsFlags) add(cmd *cobra.Command) {
	cmd.Flags().StringVar(&t.cert, "tls-cert", "", "mutual TLS between nodes: this side's certificate (PEM)")
	cmd.Flags().StringVar(&t.key, "tls-key", "", "mutual TLS: the certificate's key (PEM)")
	cmd.Flags().StringVar(&t.ca, "tls-ca", "", "mutual TLS: the CA that signs every node's certificate (PEM)")
}

func (f *adminFlags) add(cmd *cobra.Command) {
	cmd.Flags().StringVarP(&f.addr, "address", "a", defaultAdmin, "a node's address (HOST:PORT)")
	cmd.Flags().StringVar(&f.output, "output", "human", "output format: human or json")
	f.tls.add(cmd)
}

// tlsConfig is the flags' client TLS, nil without them.
func (f *adminFlags) tlsConfig() (*tls.Config, error) {
	if f.tls.cert == "" && f.tls.key == "" && f.tls.ca == "" {
		return nil, nil
	}
	return protocol.ClientTLS(f.tls.cert, f.tls.key, f.tls.ca)
}

// dial checks the flags and returns a client of the node at -a; the
// caller closes it.
func (f *adminFlags) dial() (*admin.Client, error) {
	if f.output != "human" && f.output != "json" {
		return nil, fmt.Errorf("--output %q: want human or json", f.output)
	}
	tc, err := f.tlsConfig()
	if err != nil {
		return nil, err
	}
	return admin.Dial(f.addr, tc), nil
}

// call runs one admin call against the node at -a.
func call[Req, Rep any](cmd *cobra.Command, f *adminFlags, k admin.Call[Req, Rep], req Req) (Rep, error) {
	c, err := f.dial()
	if err != nil {
		var none Rep
		return none, err
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(cmd.Context(), 10*time.Minute)
	defer cancel()
	return k.Do(ctx, c, req)
}

// print shows v as JSON or with human.
func (f *adminFlags) print(w io.Writer, v any, human func(w io.Writer)) error {
	if f.output == "json" {
		e := json.NewEncoder(w)
		e.SetIndent("", "  ")
		return e.Encode(v)
	}
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	human(tw)
	return tw.Flush()
}

func parseSizeArg(what, s string) (int64, error) {
	v, err := img.ParseSize(s)
	if err != nil || v > 1<<62 {
		return 0, fmt.Errorf("%s %q: not a size (a number with an optional k, M, G, T, P or E suffix)", what, s)
	}
	return int64(v), nil
}

// objectShift turns --object-size into a power of two, 0 for the default.
func objectShift(s string) (uint8, error) {
	if s == "" {
		return 0, nil
	}
	v, err := parseSizeArg("object size", s)
	if err != nil {
		return 0, err
	}
	for sh := uint8(0); sh < 63; sh++ {
		if int64(1)<<sh == v {
			return sh, nil
		}
	}
	return 0, fmt.Errorf("object size %s: want a power of two from 1M to 64M", s)
}

func newNodeCmd() *cobra.Command {
	var (
		cfg      node.Config
		etcd     string
		cache    = block.CacheWriteback
		metrics  string
		logLevel string
		tf       tlsFlags
		reserve  string
	)
	cmd := &cobra.Command{
		Use:   "node",
		Short: "Run a storage node of an ovis cluster",
		Long: "node runs one storage node: it keeps objects under --dir, registers in the\n" +
			"cluster's etcd (--etcd URLS, or an embedded single member whose URL it prints\n" +
			"for other nodes to join with), serves other nodes on --listen and, with\n" +
			"--nbd, serves every VDI over NBD under its name. It runs until SIGINT or\n" +
			"SIGTERM, then leaves the cluster cleanly.",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			log, err := newLogger(cmd.ErrOrStderr(), logLevel)
			if err != nil {
				return err
			}
			cfg.Logger = log
			cfg.Cache = cache
			cfg.TLSCert, cfg.TLSKey, cfg.TLSCA = tf.cert, tf.key, tf.ca
			r, err := image.ParseSize(reserve)
			if err != nil {
				return fmt.Errorf("--reserve %q: %w", reserve, err)
			}
			cfg.Reserve = int64(r)
			if etcd != "" {
				cfg.Etcd = strings.Split(etcd, ",")
			}
			reg := prometheus.NewRegistry()
			cfg.Registry = reg
			ctx, stop := signal.NotifyContext(cmd.Context(), syscall.SIGINT, syscall.SIGTERM)
			defer stop()
			n, err := node.Start(ctx, cfg)
			if err != nil {
				return err
			}
			out := cmd.OutOrStdout()
			if metrics != "" {
				addr, err := serveMetrics(ctx, metrics, reg, log)
				if err != nil {
					n.Close(context.Background())
					return err
				}
				fmt.Fprintf(out, "metrics at http://%s/metrics\n", addr)
			}
			fmt.Fprintf(out, "ovis node %s serving on %s\n", n.ID(), n.Addr())
			if len(cfg.Etcd) == 0 {
				fmt.Fprintf(out, "another node joins with: ovis node --dir DIR --etcd %s --listen HOST:PORT\n", strings.Join(n.EtcdEndpoints(), ","))
			}
			if a := n.NBDAddr(); a != "" {
				fmt.Fprintf(out, "VDIs are served at nbd://%s/NAME\n", a)
			}
			select {
			case <-ctx.Done():
			case <-n.Done():
			}
			cctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			why := n.Err()
			err = n.Close(cctx)
			if why != nil {
				return why
			}
			return err
		},
	}
	f := cmd.Flags()
	f.StringVar(&cfg.Dir, "dir", "ovis-node", "folder for the node's objects (and the embedded etcd)")
	f.StringVar(&cfg.ID, "id", "", "the node's ID (default: kept in DIR/node-id, made at the first start)")
	f.StringVar(&cfg.Listen, "listen", defaultAdmin, "node-to-node and admin address (HOST:PORT)")
	f.StringVar(&cfg.Advertise, "advertise", "", "the node-to-node address other nodes reach this one at (default: --listen's)")
	f.StringVar(&etcd, "etcd", "", "client URLs of an external etcd cluster, comma-separated (default: embed one)")
	f.StringVar(&cfg.EtcdListen, "etcd-listen", "", "the embedded etcd's client URL (default http://127.0.0.1:2379)")
	f.StringVar(&cfg.EtcdPeer, "etcd-peer", "", "the embedded etcd's peer URL (default http://127.0.0.1:2380)")
	f.StringVar(&cfg.EtcdAdvertise, "etcd-advertise", "", "the embedded etcd's URL as other machines reach it (when --etcd-listen is on 0.0.0.0)")
	f.Uint32Var(&cfg.Zone, "zone", 0, "failure domain (copies go to distinct zones; 0: the node is its own)")
	f.Uint32Var(&cfg.Weight, "weight", 1, "share of the objects, relative to the other nodes")
	f.StringVar(&cfg.NBD, "nbd", "", "serve the VDIs over NBD on this address (HOST:PORT)")
	f.Var(&cache, "cache", "the gateway's cache mode: writeback, writethrough, directsync, none or unsafe")
	f.StringVar(&reserve, "reserve", "256M", "space kept free on --dir's file system: writes and recovery that would use it are refused with ENOSPC")
	f.BoolVar(&cfg.NBDNoFUA, "nbd-no-fua", false, "diagnostic: serve VDIs without advertising FUA, so that a client with its write cache off sends write + flush (emulated writethrough; for bench/guest-dd.sh)")
	f.DurationVar(&cfg.LeaseTTL, "lease", 5*time.Second, "the membership lease: a node that cannot renew it this long stops serving")
	f.DurationVar(&cfg.IOTimeout, "io-timeout", 30*time.Second, "how long a request waits for the cluster (a node, a new epoch, the return of an unfound object's holder) before it fails with EIO")
	f.StringVar(&metrics, "metrics", "", "serve Prometheus metrics at http://ADDR/metrics")
	f.StringVar(&logLevel, "log-level", "info", "logs on stderr: debug, info, warn, error or none")
	tf.add(cmd)
	cmd.AddCommand(newNodeListCmd(), newNodeRecoveryCmd(), newNodeRemoveCmd())
	return cmd
}

func newNodeListCmd() *cobra.Command {
	var af adminFlags
	cmd := &cobra.Command{
		Use:   "list",
		Short: "List the cluster's nodes",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			nodes, err := call(cmd, &af, admin.NodeList, admin.None{})
			if err != nil {
				return err
			}
			return af.print(cmd.OutOrStdout(), nodes, func(w io.Writer) {
				fmt.Fprintln(w, "ID\tADDRESS\tZONE\tWEIGHT\tSTATE\tEPOCH\tRECOVERY\tOBJECTS\tUSED\tFREE")
				for _, n := range nodes {
					rs := n.RecoveryState()
					if n.State != "up" {
						rs = "-"
					}
					fmt.Fprintf(w, "%s\t%s\t%d\t%d\t%s\t%d\t%s\t%d\t%s\t%s\n", n.ID, n.Addr, n.Zone, n.Weight, n.State, n.Epoch, rs, n.Objects,
						img.FormatSize(uint64(n.Allocated)), img.FormatSize(uint64(max(n.Free, 0))))
				}
			})
		},
	}
	af.add(cmd)
	return cmd
}

// newNodeRemoveCmd removes a node that will never return.
func newNodeRemoveCmd() *cobra.Command {
	var af adminFlags
	cmd := &cobra.Command{
		Use:   "remove ID",
		Short: "Remove a dead node for good, so that recovery stops waiting for it",
		Long: "remove is for a node that will never come back (its disk died). Recovery keeps the tombstones of " +
			"removed data until every node that ever held copies has seen them; a node that is away holds that up. " +
			"After remove the others stop waiting for it, and the node's ID may never join again: its old copies could " +
			"bring deleted data back. A node that is still registered is refused. To bring the machine back, start it " +
			"on an empty data directory: it joins with a new ID and recovery fills it.",
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			out, err := call(cmd, &af, admin.NodeRemove, admin.NameRequest{Name: args[0]})
			if err != nil {
				return err
			}
			return af.print(cmd.OutOrStdout(), out, func(w io.Writer) { fmt.Fprintf(w, "removed node %s\n", args[0]) })
		},
	}
	af.add(cmd)
	return cmd
}

func newNodeRecoveryCmd() *cobra.Command {
	var (
		af            adminFlags
		rate          string
		pause, resume bool
	)
	cmd := &cobra.Command{
		Use:   "recovery",
		Short: "Show a node's recovery, throttle it, pause or resume it",
		Long: "Shows the recovery of the node at -a. --max-rate bounds the bytes per second it pulls (0: no bound); " +
			"--pause stops its background pulls and --resume starts them again. Objects a request touches are recovered first either way, so VMs run on.",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			var ctl admin.RecoveryControl
			if cmd.Flags().Changed("max-rate") {
				r, err := image.ParseSize(rate)
				if err != nil {
					return fmt.Errorf("--max-rate %q: %w", rate, err)
				}
				v := int64(r)
				ctl.MaxRate = &v
			}
			switch {
			case pause && resume:
				return errors.New("--pause and --resume together")
			case pause || resume:
				ctl.Paused = &pause
			}
			st, err := call(cmd, &af, admin.RecoverySet, admin.RecoverySetRequest{Recovery: &ctl})
			if err != nil {
				return err
			}
			return af.print(cmd.OutOrStdout(), st, func(w io.Writer) {
				state := "running"
				switch {
				case st.Done >= st.Epoch:
					state = "done"
				case st.Paused:
					state = "paused"
				}
				limit := "none"
				if st.MaxRate > 0 {
					limit = img.FormatSize(uint64(st.MaxRate)) + "/s"
				}
				fmt.Fprintln(w, "EPOCH\tDONE\tSTATE\tPENDING\tRECOVERED\tPULLED\tKEPT BY CHECKSUM\tDROPPED\tMAX RATE")
				fmt.Fprintf(w, "%d\t%d\t%s\t%d\t%d\t%s\t%d\t%d\t%s\n", st.Epoch, st.Done, state, st.Pending, st.Recovered, img.FormatSize(uint64(st.Bytes)), st.Verified, st.Dropped, limit)
			})
		},
	}
	af.add(cmd)
	cmd.Flags().StringVar(&rate, "max-rate", "", "bound recovery's pulls to RATE bytes per second (suffixes K, M, G; 0: no bound)")
	cmd.Flags().BoolVar(&pause, "pause", false, "pause the background pulls")
	cmd.Flags().BoolVar(&resume, "resume", false, "resume the background pulls")
	return cmd
}

func newClusterCmd() *cobra.Command {
	cmd := &cobra.Command{Use: "cluster", Short: "Format, inspect and check the cluster"}
	{
		var (
			af     adminFlags
			copies int
			osize  string
			force  bool
			strict bool
		)
		c := &cobra.Command{
			Use:   "format",
			Short: "Format the cluster: its default copies and object size",
			Args:  cobra.NoArgs,
			RunE: func(cmd *cobra.Command, args []string) error {
				sh, err := objectShift(osize)
				if err != nil {
					return err
				}
				f, err := call(cmd, &af, admin.Format, admin.FormatRequest{Copies: copies, ObjectShift: sh, Force: force, Strict: strict})
				if err != nil {
					return err
				}
				return af.print(cmd.OutOrStdout(), f, func(w io.Writer) {
					mode := ""
					if f.Strict {
						mode = ", strict"
					}
					fmt.Fprintf(w, "formatted cluster %s: copies %d, object size %s%s\n", f.ClusterID, f.Copies, img.FormatSize(1<<f.ObjectShift), mode)
				})
			},
		}
		af.add(c)
		c.Flags().IntVar(&copies, "copies", 1, "default copies of each object")
		c.Flags().StringVar(&osize, "object-size", "", "default object size, a power of two from 1M to 64M (default 4M)")
		c.Flags().BoolVar(&force, "force", false, "format a cluster that is already formatted")
		c.Flags().BoolVar(&strict, "strict", false, "refuse writes while fewer nodes (zones) are live than a VDI's copies, rather than write fewer copies until recovery makes the rest")
		cmd.AddCommand(c)
	}
	{
		var af adminFlags
		c := &cobra.Command{
			Use:   "info",
			Short: "Show the format, the nodes and the epoch history",
			Args:  cobra.NoArgs,
			RunE: func(cmd *cobra.Command, args []string) error {
				info, err := call(cmd, &af, admin.GetInfo, admin.None{})
				if err != nil {
					return err
				}
				return af.print(cmd.OutOrStdout(), info, func(w io.Writer) {
					if info.Format == nil {
						fmt.Fprintln(w, "cluster: not formatted (ovis cluster format)")
					} else {
						fmt.Fprintf(w, "cluster %s: copies %d, object size %s, formatted %s\n", info.Format.ClusterID, info.Format.Copies,
							img.FormatSize(1<<info.Format.ObjectShift), info.Format.Created.Format(time.RFC3339))
					}
					fmt.Fprintf(w, "etcd: %s\nepoch %d, %d nodes\n", strings.Join(info.Etcd, ","), info.Epoch, len(info.Nodes))
					if len(info.Full) > 0 {
						fmt.Fprintf(w, "full, out of placement: %s\n", strings.Join(info.Full, " "))
					}
					for _, from := range slices.Sorted(maps.Keys(info.Unreachable)) {
						fmt.Fprintf(w, "unreachable from %s: %s\n", from, strings.Join(info.Unreachable[from], " "))
					}
					if info.Unfound > 0 {
						fmt.Fprintf(w, "UNFOUND: %d objects: their newest copy may be on %s, which are away; nobody serves them until one returns (ovis cluster check names them)\n",
							info.Unfound, strings.Join(info.UnfoundOn, " "))
					}
					fmt.Fprintf(w, "\nEPOCH\tCREATED\tNODES\n")
					for _, v := range info.History {
						ids := make([]string, len(v.Nodes))
						for i, n := range v.Nodes {
							ids[i] = n.ID
						}
						fmt.Fprintf(w, "%d\t%s\t%s\n", v.Epoch, v.Created.Format(time.RFC3339), strings.Join(ids, " "))
					}
				})
			},
		}
		af.add(c)
		cmd.AddCommand(c)
	}
	{
		var af adminFlags
		var repair bool
		c := &cobra.Command{
			Use:   "check",
			Short: "Compare every copy of every object; exit 0 only when all are present and equal",
			Long: "Compares every copy of every object by checksum and reports missing, diverging and extra copies. " +
				"With --repair it then fixes them (a missing copy is recovered from the newest; among differing copies the one most nodes hold wins; " +
				"extra copies are dropped once the replicas have them), says what it did, and checks again.",
			Args: cobra.NoArgs,
			RunE: func(cmd *cobra.Command, args []string) error {
				c, err := af.dial()
				if err != nil {
					return err
				}
				defer c.Close()
				tc, err := af.tlsConfig()
				if err != nil {
					return err
				}
				var dial protocol.Dialer
				if tc != nil {
					dial = protocol.TLSDialer(tc)
				}
				pool := protocol.NewPool(dial)
				defer pool.Close()
				var progress func(done, total int)
				if w := cmd.ErrOrStderr(); isTerminal(w) && af.output == "human" {
					progress = progressBar(w)
				}
				r, actions, err := node.CheckVia(cmd.Context(), c, pool, repair, progress)
				if err != nil {
					return err
				}
				err = af.print(cmd.OutOrStdout(), struct {
					*admin.CheckReport
					Repaired []string `json:"repaired,omitempty"`
				}{r, actions}, func(w io.Writer) {
					for _, a := range actions {
						fmt.Fprintf(w, "repaired: %s\n", a)
					}
					fmt.Fprintf(w, "%d objects, %d copies compared, %d problems\n", r.Objects, r.Copies, len(r.Bad))
					for _, b := range r.Bad {
						fmt.Fprintf(w, "vdi %s object %s: %s %s\n", b.VDI, b.Object, b.Problem, strings.Join(b.Nodes, " "))
					}
				})
				if err != nil {
					return err
				}
				if len(r.Bad) > 0 {
					return &img.ExitError{Code: 1}
				}
				return nil
			},
		}
		af.add(c)
		c.Flags().BoolVar(&repair, "repair", false, "fix missing, diverging and extra copies, then check again")
		cmd.AddCommand(c)
	}
	cmd.AddCommand(newClusterMarkLostCmd())
	return cmd
}

func newVDICmd() *cobra.Command {
	cmd := &cobra.Command{Use: "vdi", Short: "Create, list, delete, resize, read and write virtual disks"}
	{
		var (
			af     adminFlags
			copies int
			osize  string
		)
		c := &cobra.Command{
			Use:   "create NAME SIZE",
			Short: "Create a VDI",
			Args:  cobra.ExactArgs(2),
			RunE: func(cmd *cobra.Command, args []string) error {
				size, err := parseSizeArg("size", args[1])
				if err != nil {
					return err
				}
				sh, err := objectShift(osize)
				if err != nil {
					return err
				}
				v, err := call(cmd, &af, admin.VDICreate, admin.VDICreateRequest{Name: args[0], Size: size, Copies: copies, ObjectShift: sh})
				if err != nil {
					return err
				}
				return af.print(cmd.OutOrStdout(), v, func(w io.Writer) {
					fmt.Fprintf(w, "created vdi %s (id %d): %s, %d copies, objects of %s\n", v.Name, v.ID, img.FormatSize(uint64(v.Size)), v.Copies, img.FormatSize(1<<v.ObjectShift))
				})
			},
		}
		af.add(c)
		c.Flags().IntVar(&copies, "copies", 0, "copies of each object (default: the cluster's)")
		c.Flags().StringVar(&osize, "object-size", "", "object size, a power of two from 1M to 64M (default: the cluster's)")
		cmd.AddCommand(c)
	}
	{
		var af adminFlags
		c := &cobra.Command{
			Use: "list", Short: "List the VDIs", Args: cobra.NoArgs,
			RunE: func(cmd *cobra.Command, args []string) error {
				c, err := af.dial()
				if err != nil {
					return err
				}
				defer c.Close()
				ctx, cancel := context.WithTimeout(cmd.Context(), 10*time.Minute)
				defer cancel()
				vs, err := admin.VDIList.Do(ctx, c, admin.None{})
				if err != nil {
					return err
				}
				// Allocated is what the VDI's allocation map says was
				// written: whole objects, at most the size; none for a
				// VDI made before maps.
				type listed struct {
					membership.VDI
					Allocated *int64 `json:"allocated,omitempty"`
				}
				out := make([]listed, len(vs))
				allocated := node.AllocatedVia(c)
				for i, v := range vs {
					out[i].VDI = v
					if !v.Allocation {
						continue
					}
					s, err := allocated(ctx, v)
					if err != nil {
						return err
					}
					n := min(int64(s.Len())*v.ObjectSize(), v.Size)
					out[i].Allocated = &n
				}
				return af.print(cmd.OutOrStdout(), out, func(w io.Writer) {
					fmt.Fprintln(w, "NAME\tID\tSIZE\tALLOCATED\tCOPIES\tOBJECT SIZE\tSTATE\tCREATED")
					for _, v := range out {
						alloc := "-"
						if v.Allocated != nil {
							alloc = img.FormatSize(uint64(*v.Allocated))
						}
						fmt.Fprintf(w, "%s\t%d\t%s\t%s\t%d\t%s\t%s\t%s\n", v.Name, v.ID, img.FormatSize(uint64(v.Size)), alloc, v.Copies, img.FormatSize(1<<v.ObjectShift), v.State, v.Created.Format(time.RFC3339))
					}
				})
			},
		}
		af.add(c)
		cmd.AddCommand(c)
	}
	{
		var af adminFlags
		c := &cobra.Command{
			Use: "delete NAME", Short: "Delete a VDI and its objects", Args: cobra.ExactArgs(1),
			RunE: func(cmd *cobra.Command, args []string) error {
				v, err := call(cmd, &af, admin.VDIDelete, admin.NameRequest{Name: args[0]})
				if err != nil {
					return err
				}
				return af.print(cmd.OutOrStdout(), v, func(w io.Writer) { fmt.Fprintf(w, "deleted vdi %s (id %d)\n", v.Name, v.ID) })
			},
		}
		af.add(c)
		cmd.AddCommand(c)
	}
	{
		var (
			af     adminFlags
			shrink bool
		)
		c := &cobra.Command{
			Use: "resize NAME SIZE", Short: "Change a VDI's size", Args: cobra.ExactArgs(2),
			RunE: func(cmd *cobra.Command, args []string) error {
				size, err := parseSizeArg("size", args[1])
				if err != nil {
					return err
				}
				v, err := call(cmd, &af, admin.VDIResize, admin.VDIResizeRequest{Name: args[0], Size: size, Shrink: shrink})
				if err != nil {
					return err
				}
				return af.print(cmd.OutOrStdout(), v, func(w io.Writer) { fmt.Fprintf(w, "vdi %s: %s\n", v.Name, img.FormatSize(uint64(v.Size))) })
			},
		}
		af.add(c)
		c.Flags().BoolVar(&shrink, "shrink", false, "allow the VDI to shrink (data past the new end is lost)")
		cmd.AddCommand(c)
	}
	cmd.AddCommand(newVDIAlterCopyCmd(), newVDIReadCmd(), newVDIWriteCmd(), newVDILockCmd())
	return cmd
}

// newVDIAlterCopyCmd is Sheepdog's `dog vdi alter-copy`: the cluster
// moves to the new copies from the next epoch on.
func newVDIAlterCopyCmd() *cobra.Command {
	var af adminFlags
	c := &cobra.Command{
		Use:   "alter-copy NAME COPIES",
		Short: "Change a VDI's copies; recovery then makes or drops copies to match",
		Long: "alter-copy sets the copies of every object of the VDI. The change comes with a new epoch: " +
			"every node recovers it (new holders pull their copies, extra ones are dropped once the others have theirs), " +
			"and requests go on meanwhile. `ovis cluster check` shows when every object has its copies.",
		Args: cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			n, err := strconv.Atoi(args[1])
			if err != nil || n < 1 {
				return fmt.Errorf("copies %q: want a whole number from 1 to %d", args[1], membership.MaxCopies)
			}
			v, err := call(cmd, &af, admin.VDIAlterCopy, admin.VDIAlterCopyRequest{Name: args[0], Copies: n})
			if err != nil {
				return err
			}
			return af.print(cmd.OutOrStdout(), v, func(w io.Writer) {
				from := "unchanged"
				if k := len(v.CopiesBefore); k > 0 && v.CopiesBefore[k-1].Copies != v.Copies {
					from = fmt.Sprintf("from epoch %d (was %d)", v.CopiesBefore[k-1].Until, v.CopiesBefore[k-1].Copies)
				}
				fmt.Fprintf(w, "vdi %s: %d copies, %s\n", v.Name, v.Copies, from)
			})
		},
	}
	af.add(c)
	return c
}

// rangeArgs parses [OFFSET [LEN]].
func rangeArgs(args []string) (off, n int64, err error) {
	n = -1
	if len(args) > 0 {
		if off, err = parseSizeArg("offset", args[0]); err != nil {
			return
		}
	}
	if len(args) > 1 {
		n, err = parseSizeArg("length", args[1])
	}
	return
}

func newVDIReadCmd() *cobra.Command {
	var af adminFlags
	c := &cobra.Command{
		Use: "read NAME [OFFSET [LEN]]", Short: "Write a VDI's bytes to stdout", Args: cobra.RangeArgs(1, 3),
		RunE: func(cmd *cobra.Command, args []string) error {
			off, n, err := rangeArgs(args[1:])
			if err != nil {
				return err
			}
			out := cmd.OutOrStdout()
			for n != 0 {
				chunk := int64(admin.MaxData)
				if n > 0 {
					chunk = min(chunk, n)
				}
				r, err := call(cmd, &af, admin.VDIRead, admin.VDIReadRequest{Name: args[0], Offset: off, Length: chunk})
				if err != nil {
					return err
				}
				data := r.Data
				if len(data) == 0 {
					if n > 0 {
						return fmt.Errorf("vdi %s: %d bytes past its end (%d bytes)", args[0], n, r.Size)
					}
					return nil
				}
				if _, err := out.Write(data); err != nil {
					return err
				}
				off += int64(len(data))
				if n > 0 {
					n -= int64(len(data))
				}
			}
			return nil
		},
	}
	af.add(c)
	return c
}

func newVDIWriteCmd() *cobra.Command {
	var af adminFlags
	c := &cobra.Command{
		Use: "write NAME [OFFSET [LEN]]", Short: "Write stdin to a VDI (durably, through the node's gateway)", Args: cobra.RangeArgs(1, 3),
		RunE: func(cmd *cobra.Command, args []string) error {
			off, n, err := rangeArgs(args[1:])
			if err != nil {
				return err
			}
			in := cmd.InOrStdin()
			buf := make([]byte, admin.MaxData)
			for n != 0 {
				want := int64(len(buf))
				if n > 0 {
					want = min(want, n)
				}
				k, rerr := io.ReadFull(in, buf[:want])
				if k > 0 {
					if _, err := call(cmd, &af, admin.VDIWrite, admin.VDIWriteRequest{Name: args[0], Offset: off, Data: buf[:k]}); err != nil {
						return err
					}
					off += int64(k)
					if n > 0 {
						n -= int64(k)
					}
				}
				if rerr == io.EOF || rerr == io.ErrUnexpectedEOF {
					if n > 0 {
						return fmt.Errorf("stdin ended %d bytes short of the length", n)
					}
					return nil
				}
				if rerr != nil {
					return rerr
				}
			}
			return nil
		},
	}
	af.add(c)
	return c
}

func newVDILockCmd() *cobra.Command {
	cmd := &cobra.Command{Use: "lock", Short: "List VDI locks, or break a dead holder's"}
	{
		var af adminFlags
		c := &cobra.Command{
			Use: "list", Short: "List the VDIs' locks and their holders", Args: cobra.NoArgs,
			RunE: func(cmd *cobra.Command, args []string) error {
				ls, err := call(cmd, &af, admin.LockList, admin.None{})
				if err != nil {
					return err
				}
				return af.print(cmd.OutOrStdout(), ls, func(w io.Writer) {
					fmt.Fprintln(w, "VDI\tHOLDER\tTOKEN")
					for _, l := range ls {
						fmt.Fprintf(w, "%s\t%s\t%s\n", l.Name, l.Holder, strconv.FormatUint(l.Token, 10))
					}
				})
			},
		}
		af.add(c)
		cmd.AddCommand(c)
	}
	{
		var af adminFlags
		c := &cobra.Command{
			Use: "break NAME", Short: "Take a VDI's lock from its holder; the holder is fenced", Args: cobra.ExactArgs(1),
			RunE: func(cmd *cobra.Command, args []string) error {
				l, err := call(cmd, &af, admin.LockBreak, admin.NameRequest{Name: args[0]})
				if err != nil {
					return err
				}
				return af.print(cmd.OutOrStdout(), l, func(w io.Writer) {
					fmt.Fprintf(w, "broke the lock of vdi %s held by %s (token %d)\n", l.Name, l.Holder, l.Token)
				})
			},
		}
		af.add(c)
		cmd.AddCommand(c)
	}
	return cmd
}

// serveMetrics serves reg at http://addr/metrics until ctx ends.
func serveMetrics(ctx context.Context, addr string, reg *prometheus.Registry, log *slog.Logger) (string, error) {
	l, err := net.Listen("tcp", addr)
	if err != nil {
		return "", fmt.Errorf("--metrics: %w", err)
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{ErrorLog: slog.NewLogLogger(log.Handler(), slog.LevelWarn)}))
	// Profiles of a running node, on the same (operator's) address.
	mux.HandleFunc("/debug/pprof/", pprof.Index)
	mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
	mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
	mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	go srv.Serve(l)
	context.AfterFunc(ctx, func() { srv.Close() })
	return l.Addr().String(), nil
}

// progressBar returns a progress callback that draws a bar on w.
func progressBar(w io.Writer) func(done, total int) {
	var bar *progressbar.ProgressBar
	return func(done, total int) {
		if bar == nil {
			bar = progressbar.NewOptions(total, progressbar.OptionSetWriter(w), progressbar.OptionSetDescription("checking"),
				progressbar.OptionShowCount(), progressbar.OptionSetWidth(30), progressbar.OptionThrottle(100*time.Millisecond),
				progressbar.OptionClearOnFinish())
		}
		bar.Set(done)
	}
}

// newClusterMarkLostCmd gives unfound objects up: Ceph's
// mark_unfound_lost revert.
func newClusterMarkLostCmd() *cobra.Command {
	var (
		af  adminFlags
		all bool
	)
	cmd := &cobra.Command{
		Use:   "mark-lost OBJECT | --all-unfound",
		Short: "Give unfound objects up: serve the best copy the nodes that are up hold, or zeros",
		Long: "An object is unfound when every node that may hold its newest copy is away: nobody serves it, and requests " +
			"for it wait (then fail with EIO) until one of those nodes returns. mark-lost gives that newest copy up for good: " +
			"the object is then decided from the copies the nodes that are up hold (the best of them, or zeros when none holds it), " +
			"and a copy a returning node brings back is replaced. It prints every object it gives up, with the nodes that may " +
			"have held it. Use it only for nodes that will not return (`ovis node remove` them too).",
		Args: cobra.MaximumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			ar := admin.LostMarkRequest{All: all}
			switch {
			case len(args) == 1 && all:
				return errors.New("mark-lost: name an object or give --all-unfound, not both")
			case len(args) == 1:
				id, err := object.Parse(args[0])
				if err != nil {
					return fmt.Errorf("mark-lost: %w", err)
				}
				ar.Object = id
			case !all:
				return errors.New("mark-lost: name an object (as cluster check prints it), or give every unfound object up with --all-unfound")
			}
			lost, err := call(cmd, &af, admin.LostMark, ar)
			if err != nil {
				return err
			}
			return af.print(cmd.OutOrStdout(), lost, func(w io.Writer) {
				if len(lost) == 0 {
					fmt.Fprintln(w, "no unfound objects: nothing given up")
					return
				}
				for _, u := range lost {
					on := "unknown nodes"
					if len(u.On) > 0 {
						on = strings.Join(u.On, " ")
					}
					fmt.Fprintf(w, "gave up object %s of vdi %s as of epoch %d: its newest copy may have been on %s\n", u.Object, u.VDI, u.Epoch, on)
				}
				fmt.Fprintf(w, "%d objects given up: each now reads as the best copy the nodes that are up hold, or as zeros\n", len(lost))
			})
		},
	}
	af.add(cmd)
	cmd.Flags().BoolVar(&all, "all-unfound", false, "give up every object some node reports unfound")
	return cmd
}
