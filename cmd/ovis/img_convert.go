package main

import (
	"io"
	"os"

	"github.com/spf13/cobra"
	"golang.org/x/sys/unix"

	"github.com/ovis-storage/ovis/cmd/ovis/internal/img"
)

// isTerminal reports whether w is a terminal.
func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	_, err := unix.IoctlGetTermios(int(f.Fd()), unix.TCGETS)
	return err == nil
}

func newImgConvertCmd() *cobra.Command {
	var (
		cfg        img.ConvertConfig
		forceShare bool
	)
	var imageOpts, targetImageOpts bool
	cmd := &cobra.Command{
		Use:   "convert [-f FMT] [-O FMT] [-o OPTIONS] [-c] [-p] [-q] [-S SIZE] [-B BACKING_FILE [-F BACKING_FMT]] [-n [--target-is-zero]] [-m N] [-W] [-C] [-r RATE] [-l SNAPSHOT] [--salvage] SRC [SRC2...] DST",
		Short: "Copy an image into a new image, sparsely",
		Long: "Copy SRC into DST as qemu-img convert does. Ranges that read as zeros are not\n" +
			"written, nor are all-zero runs of at least -S bytes (default 4k; 0 writes\n" +
			"everything). -c writes every cluster compressed (qcow2 output only).\n" +
			"Reads run -m requests in parallel; writes are made in offset order unless -W\n" +
			"allows them to overlap (faster, and -c then compresses on all cores).\n" +
			"Several sources are copied one after the other into one output.",
		Args: cobra.ArbitraryArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			env := newEnv(cmd, forceShare)
			if len(args) >= 1 {
				cfg.Dest = args[len(args)-1]
			}
			for _, a := range args[:max(0, len(args)-1)] {
				src, err := imageOptsArg(cmd, env, imageOpts, a, &cfg.SourceFormat, "format")
				if err != nil {
					return err
				}
				cfg.Sources = append(cfg.Sources, src)
			}
			cfg.TargetImageOpts = targetImageOpts
			if targetImageOpts && cfg.NoCreate && cfg.Dest != "" {
				if !cmd.Flags().Changed("output-format") {
					cfg.DestFormat = ""
				}
				dst, err := imageOptsArg(cmd, env, true, cfg.Dest, &cfg.DestFormat, "output-format")
				if err != nil {
					return err
				}
				cfg.Dest = dst
			}
			cfg.BackingFileSet = cmd.Flags().Changed("backing")
			cfg.BackingFormatSet = cmd.Flags().Changed("backing-format")
			cfg.ProgressTerminal = isTerminal(cmd.OutOrStdout())
			return env.Convert(cmd.Context(), cfg)
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
	f.BoolVarP(&cfg.Unordered, "unordered", "W", false, "allow out-of-order writes (faster; compresses on all cores)")
	f.BoolVar(&cfg.TargetIsZero, "target-is-zero", false, "with -n: the output reads as zeros already, so zeros are not written")
	f.BoolVarP(&forceShare, "force-share", "U", false, "open the source even if it is in use")
	f.StringVarP(&cfg.Cache, "cache", "t", "", "output cache mode (default unsafe: no sync; writeback, writethrough, none, directsync sync at the end)")
	f.StringVarP(&cfg.SourceCache, "source-cache", "T", "", "source cache mode (default writeback; none and directsync read with O_DIRECT)")
	f.BoolVarP(&cfg.Quiet, "quiet", "q", false, "no progress bar and no warnings")
	f.BoolVarP(&cfg.CopyRange, "copy-range-offloading", "C", false, "copy data between raw files inside the kernel (copy_file_range)")
	f.StringVarP(&cfg.RateLimit, "rate-limit", "r", "", "most bytes written per second (k, M, G suffixes)")
	f.StringVarP(&cfg.Snapshot, "snapshot", "l", "", "copy an internal snapshot of SRC: snapshot.id=ID,snapshot.name=NAME or ID_OR_NAME")
	f.BoolVar(&cfg.Salvage, "salvage", false, "write what cannot be read as zeros, with a warning, instead of failing")
	f.BoolVar(&cfg.Bitmaps, "bitmaps", false, "also copy the source's persistent bitmaps")
	f.BoolVar(&cfg.SkipBrokenBitmaps, "skip-broken-bitmaps", false, "with --bitmaps, leave out inconsistent bitmaps instead of failing")
	f.BoolVar(&targetImageOpts, "target-image-opts", false, "treat DST as an option list (needs -n)")
	addImageOpts(cmd.Flags(), &imageOpts)
	return cmd
}
