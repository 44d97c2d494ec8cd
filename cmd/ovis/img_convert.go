package main

import (
	"errors"

	"github.com/spf13/cobra"

	"github.com/ovis-storage/ovis/block"
	"github.com/ovis-storage/ovis/cmd/ovis/internal/img"
)

func newImgConvertCmd() *cobra.Command {
	var (
		cfg                   img.ConvertConfig
		forceShare, unordered bool
		cache, srcCache       block.CacheMode
	)
	cmd := &cobra.Command{
		Use:   "convert [-f FMT] [-O FMT] [-o OPTIONS] [-c] [-p] [-S SIZE] [-B BACKING_FILE [-F BACKING_FMT]] [-n] [-m N] SRC DST",
		Short: "Copy an image into a new image, sparsely",
		Long: "Copy SRC into DST as qemu-img convert does. Ranges that read as zeros are not\n" +
			"written, nor are all-zero runs of at least -S bytes (default 4k; 0 writes\n" +
			"everything). -c writes every cluster compressed (qcow2 output only).",
		Args: cobra.ArbitraryArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if len(args) > 2 {
				return errors.New("ovis img convert takes one source image")
			}
			if len(args) == 2 {
				cfg.Source, cfg.Dest = args[0], args[1]
			} else if len(args) == 1 {
				cfg.Dest = args[0]
			}
			cfg.ProgressTo = cmd.ErrOrStderr()
			return img.Convert(cmd.Context(), cfg, cmd.OutOrStdout())
		},
	}
	f := cmd.Flags()
	f.StringVarP(&cfg.SourceFormat, "format", "f", "", "source format (default: probe)")
	f.StringVarP(&cfg.DestFormat, "output-format", "O", "raw", "output format: qcow2 or raw")
	f.StringArrayVarP(&cfg.Options, "options", "o", nil, "output format options, name=value[,...] (repeatable; 'help' lists them)")
	f.BoolVarP(&cfg.Compress, "compress", "c", false, "write compressed clusters (qcow2)")
	f.BoolVarP(&cfg.Progress, "progress", "p", false, "show a progress bar on stderr")
	f.StringVarP(&cfg.SparseSize, "sparse-size", "S", "", "least run of zeros left unwritten (default 4k, 0 disables)")
	f.StringVarP(&cfg.BackingFile, "backing", "B", "", "backing file of the output; only the source's top layer is copied")
	f.StringVarP(&cfg.BackingFormat, "backing-format", "F", "", "format of the output's backing file")
	f.BoolVarP(&cfg.NoCreate, "no-create", "n", false, "write into an existing output image")
	f.IntVarP(&cfg.Workers, "parallel", "m", img.DefaultWorkers, "requests in flight (1-16)")
	// Accepted for qemu-img compatibility; ovis always copies in
	// parallel and takes no locks.
	f.BoolVarP(&unordered, "unordered", "W", false, "allow out-of-order writes (always on in ovis)")
	f.BoolVarP(&forceShare, "force-share", "U", false, "open the source even if it is in use (ovis never locks)")
	f.VarP(&cache, "cache", "t", "output cache mode (accepted; ovis writes through the page cache and flushes at the end)")
	f.VarP(&srcCache, "source-cache", "T", "source cache mode (accepted)")
	return cmd
}
