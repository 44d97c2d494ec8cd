package main

import (
	"github.com/spf13/cobra"

	"github.com/ovis-storage/ovis/cmd/ovis/internal/img"
)

func newImgBenchCmd() *cobra.Command {
	var (
		cfg                img.BenchConfig
		native, forceShare bool
		aio                string
	)
	var imageOpts bool
	cmd := &cobra.Command{
		Use:   "bench [-c COUNT] [-d DEPTH] [-f FMT] [--flush-interval=N] [--no-drain] [-n] [-o OFFSET] [--pattern=N] [-q] [-s SIZE] [-S STEP] [-t CACHE] [-w] [-U] FILENAME",
		Short: "Time a run of sequential requests",
		Long: "Send COUNT reads (or writes with -w) of SIZE bytes, DEPTH in flight, at offsets\n" +
			"STEP apart from OFFSET, as qemu-img bench does, and print the time the run took\n" +
			"and, for qcow2 images, the hits, misses, evictions and writebacks of the L2\n" +
			"and refcount caches.",
		Args: cobra.ArbitraryArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			env := newEnv(cmd, forceShare)
			if len(args) != 1 {
				return img.UsageError("Expecting one image file name")
			}
			var err error
			if cfg.Filename, err = imageOptsArg(cmd, env, imageOpts, args[0], &cfg.Format, "format"); err != nil {
				return err
			}
			return env.Bench(cmd.Context(), cfg)
		},
	}
	f := cmd.Flags()
	f.StringVarP(&cfg.Count, "count", "c", "", "number of requests (default 75000)")
	f.StringVarP(&cfg.Depth, "depth", "d", "", "requests in flight (default 64)")
	f.StringVarP(&cfg.Format, "format", "f", "", "image format (default: probe)")
	f.StringVar(&cfg.FlushInterval, "flush-interval", "", "flush every N requests (write tests)")
	f.BoolVar(&cfg.NoDrain, "no-drain", false, "keep requests in flight while flushing")
	f.StringVarP(&cfg.Offset, "offset", "o", "", "offset of the first request")
	f.StringVar(&cfg.Pattern, "pattern", "", "byte to write (default 0)")
	f.BoolVarP(&cfg.Quiet, "quiet", "q", false, "do not print the cache counters")
	f.StringVarP(&cfg.BufSize, "size", "s", "", "size of each request (default 4k)")
	f.StringVarP(&cfg.Step, "step", "S", "", "distance between request offsets (default: the size)")
	f.StringVarP(&cfg.Cache, "cache", "t", "", "cache mode: writeback (default), writethrough, none, directsync, unsafe")
	f.BoolVarP(&cfg.Write, "write", "w", false, "send writes")
	// Accepted for qemu-img compatibility: ovis has one I/O engine.
	f.BoolVarP(&native, "native", "n", false, "native AIO (accepted; ovis uses its own I/O)")
	f.StringVarP(&aio, "aio", "i", "", "AIO mode (accepted; ovis uses its own I/O)")
	f.BoolVarP(&forceShare, "force-share", "U", false, "open the image even if it is in use")
	addImageOpts(cmd.Flags(), &imageOpts)
	return cmd
}
