package img

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"runtime"
	"time"

	"github.com/schollz/progressbar/v3"

	"github.com/ovis-storage/ovis/block"
	"github.com/ovis-storage/ovis/qcow2"
)

// ConvertConfig is what `ovis img convert` was given, as qemu-img
// convert's arguments: convert [-f FMT] [-O FMT] [-o OPTIONS] [-c] [-p]
// [-S SIZE] [-B BACKING [-F BACKING_FMT]] [-n] [-m N] SRC DST.
type ConvertConfig struct {
	// Source is the image to copy (SRC).
	Source string
	// SourceFormat (-f) is "qcow2", "raw" or "" to probe.
	SourceFormat string
	// Dest is the image to write (DST).
	Dest string
	// DestFormat (-O) defaults to raw.
	DestFormat string
	// Options are the -o arguments in order.
	Options []string
	// Compress (-c) writes every cluster compressed; qcow2 only.
	Compress bool
	// Progress (-p) draws a progress bar on ProgressTo (nil: stderr).
	Progress   bool
	ProgressTo io.Writer
	// SparseSize (-S) is the -S argument as typed: all-zero runs of at
	// least this many bytes inside data are not written. "" means the
	// default, 4k; "0" writes everything and allocates the whole output.
	SparseSize string
	// BackingFile (-B) and BackingFormat (-F) give the output a backing
	// file, which must hold what the source's backing file holds: only
	// the source's own layer is copied.
	BackingFile   string
	BackingFormat string
	// NoCreate (-n) writes into an existing DST instead of creating it.
	NoCreate bool
	// Workers (-m) is how many requests run in parallel, 1 to 16;
	// qemu-img's default is 8 (DefaultWorkers). Compression uses at least
	// one worker per CPU.
	Workers int
	// Unordered (-W) lets writes complete in any order. Without it, as in
	// qemu-img, reads (and zero detection) run in parallel but the writes
	// are made one at a time in ascending offset order: a qcow2 output
	// gets its clusters in guest order, so its layout does not depend on
	// timing, and an interrupted conversion leaves a prefix of the
	// source. With -W writes overlap, which is faster. Either way the
	// workers compress (-c) on every core at once: the writes only store
	// what they compressed.
	Unordered bool
	// TargetIsZero (--target-is-zero, with NoCreate) promises that the
	// existing output reads as zeros, so zero ranges are not written.
	TargetIsZero bool
	// Cache (-t) is the output's cache mode. "" is qemu-img convert's
	// default, unsafe: nothing is synced, the output is complete in the
	// page cache when the command returns (a host crash may lose it).
	// writeback and the others sync the output at the end.
	Cache string
	// SourceCache (-T) is the source's cache mode; "" is writeback.
	// none and directsync read with O_DIRECT.
	SourceCache string
}

// DefaultWorkers is qemu-img convert's default for -m.
const DefaultWorkers = 8

// Defaults and limits of qemu-img convert.
const (
	defaultMinSparse = 4096
	maxBufBytes      = 32768 * 512 // MAX_BUF_SECTORS
	maxWorkers       = 16          // MAX_COROUTINES
	// copyChunk is the largest read or write one worker makes.
	copyChunk = 2 << 20
	// zeroChunk is the largest WriteZeroes one worker makes, so that
	// progress and cancellation stay responsive.
	zeroChunk = 256 << 20
)

// Convert copies an image into a new (or, with NoCreate, existing) image as
// qemu-img convert does. The output is sparse: ranges the source reports
// as zero are not written to a fresh output, nor are all-zero runs of at
// least SparseSize bytes inside data. stdout receives -o help.
func Convert(ctx context.Context, cfg ConvertConfig, stdout io.Writer) error {
	minSparse, workers, err := convertLimits(cfg)
	if err != nil {
		return err
	}
	if cfg.TargetIsZero && !cfg.NoCreate {
		return errors.New("--target-is-zero requires use of -n flag")
	}
	outFmt := cfg.DestFormat
	if outFmt == "" {
		outFmt = "raw"
	}
	options, err := accumulateOptions(cfg.Options)
	if err != nil {
		return err
	}
	if hasHelpOption(options) {
		return printOptionHelp(stdout, outFmt, cfg.Dest)
	}
	if cfg.Source == "" || cfg.Dest == "" {
		return errors.New("Must specify image file name")
	}
	if _, ok := formatOpts(cfg.SourceFormat); !ok && cfg.SourceFormat != "" {
		return fmt.Errorf("Could not open '%s': Unknown driver '%s'", cfg.Source, cfg.SourceFormat)
	}
	cache, srcCache := block.CacheUnsafe, block.CacheWriteback
	if cfg.Cache != "" {
		if cache, err = block.ParseCacheMode(cfg.Cache); err != nil {
			return fmt.Errorf("Invalid cache option: %s", cfg.Cache)
		}
	}
	if cfg.SourceCache != "" {
		if srcCache, err = block.ParseCacheMode(cfg.SourceCache); err != nil {
			return fmt.Errorf("Invalid source cache option: %s", cfg.SourceCache)
		}
	}
	if err := requireFormat(cfg.Source, cfg.SourceFormat); err != nil {
		return err
	}
	src, err := qcow2.OpenDevice(cfg.Source, cfg.SourceFormat, trust(cfg.Source, qcow2.Options{ReadOnly: true, OpenFile: block.OpenFileFor(srcCache)}))
	if err != nil {
		return openError(cfg.Source, err)
	}
	defer src.Close()

	targetHasBacking := cfg.BackingFile != ""
	if cfg.TargetIsZero && targetHasBacking {
		// qemu-img reports this and then exits with status 0, without
		// converting.
		return exitWith(0, errors.New("Cannot use --target-is-zero when the destination image has a backing file"))
	}
	if !cfg.NoCreate {
		if targetHasBacking, err = prepareTarget(cfg, outFmt, options, src.Size()); err != nil {
			return err
		}
	}
	dst, err := openTarget(cfg.Dest, outFmt, cfg.NoCreate, cache)
	if err != nil {
		return openError(cfg.Dest, err)
	}
	c := &copier{
		src:         src,
		dst:         dst,
		minSparse:   minSparse,
		workers:     workers,
		hasZeroInit: (!cfg.NoCreate || cfg.TargetIsZero) && !targetHasBacking && minSparse > 0,
		ordered:     !cfg.Unordered,
	}
	if img, ok := src.(*qcow2.Image); ok && targetHasBacking && img.Backing() != nil {
		c.copyTopOnly = true
	}
	err = runCopy(ctx, c, cfg)
	if cerr := dst.Close(); err == nil && cerr != nil {
		err = fmt.Errorf("%s: %w", cfg.Dest, cerr)
	}
	return err
}

// convertLimits checks -S and -m with qemu-img's messages. Compression
// gets at least one worker per CPU.
func convertLimits(cfg ConvertConfig) (minSparse int64, workers int, err error) {
	minSparse = defaultMinSparse
	if cfg.SparseSize != "" {
		if minSparse, err = cvtnum("buffer size for sparse output", cfg.SparseSize, math.MaxInt64); err != nil {
			return 0, 0, err
		}
		if minSparse%512 != 0 || minSparse > maxBufBytes {
			return 0, 0, fmt.Errorf("Invalid buffer size for sparse output specified. Valid sizes are multiples of %d up to %d. "+
				"Select 0 to disable sparse detection (fully allocates output).", 512, maxBufBytes)
		}
	}
	workers = cfg.Workers
	if workers < 1 || workers > maxWorkers {
		return 0, 0, fmt.Errorf("Invalid number of coroutines. Allowed number of coroutines is between 1 and %d", maxWorkers)
	}
	if cfg.Compress {
		workers = max(workers, runtime.NumCPU())
	}
	return minSparse, workers, nil
}

// prepareTarget creates the output for a source of srcSize bytes, in the
// order and with the messages of qemu-img convert, and reports whether it
// has a backing file (from -B or -o backing_file).
func prepareTarget(cfg ConvertConfig, outFmt, options string, srcSize int64) (hasBacking bool, err error) {
	desc, ok := formatOpts(outFmt)
	if !ok {
		return false, fmt.Errorf("Unknown file format '%s'", outFmt)
	}
	o, err := parseOptions(desc, options)
	if err != nil {
		return false, err
	}
	size := (srcSize + 511) &^ 511
	o.setNumber(optKeySize, uint64(size))
	if cfg.BackingFile != "" || cfg.BackingFormat != "" {
		if outFmt != "qcow2" {
			return false, fmt.Errorf("Backing file not supported for file format '%s'", outFmt)
		}
		if cfg.BackingFile != "" {
			o.vals[optKeyBackingFile] = optValue{str: cfg.BackingFile}
		}
		if cfg.BackingFormat != "" {
			o.vals[optKeyBackingFmt] = optValue{str: cfg.BackingFormat}
		}
	}
	hasBacking = o.has(optKeyBackingFile)
	if hasBacking && !o.has(optKeyBackingFmt) {
		return false, errors.New("Use of backing file requires explicit backing format")
	}
	if cfg.Compress {
		if outFmt != "qcow2" {
			return false, errors.New("Compression not supported for this file format")
		}
		if p := o.str(optKeyPrealloc); p != "" && p != "off" {
			return false, errors.New("Compression and preallocation not supported at the same time")
		}
	}
	if err := createTarget(cfg.Dest, outFmt, o, size); err != nil {
		return false, fmt.Errorf("%s: error while converting %s: %w", cfg.Dest, outFmt, err)
	}
	return hasBacking, nil
}

// runCopy checks the output against the copy's needs and runs it, with a
// progress bar for -p.
func runCopy(ctx context.Context, c *copier, cfg ConvertConfig) error {
	if cfg.Compress {
		img, ok := c.dst.(*qcow2.Image)
		if !ok {
			return errors.New("Compression not supported for this file format")
		}
		c.compressed = img
		c.clusterSize = img.ClusterSize()
	}
	if c.dst.Size() < c.src.Size() {
		return errors.New("output file is smaller than input file")
	}
	progressTo := cfg.ProgressTo
	if progressTo == nil {
		progressTo = os.Stderr
	}
	if cfg.Progress {
		c.bar = newProgressBar(c.src.Size(), progressTo)
	}
	err := c.run(ctx)
	if err != nil && ctx.Err() != nil {
		err = fmt.Errorf("interrupted; %s is incomplete: %w", cfg.Dest, ctx.Err())
	}
	if c.bar != nil {
		if err == nil {
			c.bar.Finish()
		}
		fmt.Fprintln(progressTo)
	}
	return err
}

// createTarget creates the output image from parsed options.
func createTarget(path, format string, o *opts, size int64) error {
	if format == "raw" {
		return createRaw(path, size, o.str(optKeyPrealloc))
	}
	co, err := qcow2CreateOptions(o, size)
	if err != nil {
		return err
	}
	if err := qcow2.Create(path, co); err != nil {
		return createError(format, err)
	}
	return nil
}

// openTarget opens the output for writing in a cache mode, with its
// backing file so that partial cluster writes can copy from it.
func openTarget(path, format string, existing bool, cache block.CacheMode) (block.Device, error) {
	if existing {
		if _, err := os.Stat(path); err != nil {
			return nil, err
		}
	}
	open := block.OpenFileFor(cache)
	if cache.IgnoreFlush() {
		open = func(name string, readOnly bool) (block.File, error) {
			f, err := block.OpenFile(name, readOnly)
			if err != nil {
				return nil, err
			}
			return noSyncFile{f}, nil
		}
	}
	var dev block.Device
	if format == "raw" {
		f, err := open(path, false)
		if err != nil {
			return nil, err
		}
		r, err := block.NewRaw(f, false)
		if err != nil {
			f.Close()
			return nil, err
		}
		dev = r
	} else {
		img, err := qcow2.Open(path, qcow2.Options{OpenFile: open})
		if err != nil {
			return nil, err
		}
		dev = img
	}
	if cache.IgnoreFlush() {
		return dev, nil // syncs are dropped already; keep the engine's type
	}
	return block.WithCacheMode(dev, cache), nil
}

// noSyncFile is a file whose Sync does nothing: QEMU's cache.no-flush,
// the unsafe cache mode qemu-img convert writes its output with.
type noSyncFile struct{ *block.OSFile }

func (noSyncFile) Sync() error { return nil }

// newProgressBar draws bytes done, throughput and ETA on w.
func newProgressBar(total int64, w io.Writer) *progressbar.ProgressBar {
	return progressbar.NewOptions64(total,
		progressbar.OptionSetWriter(w),
		progressbar.OptionSetDescription("converting"),
		progressbar.OptionShowBytes(true),
		progressbar.OptionShowCount(),
		progressbar.OptionSetPredictTime(true),
		progressbar.OptionSetElapsedTime(true),
		progressbar.OptionThrottle(100*time.Millisecond),
		progressbar.OptionSetWidth(30),
		progressbar.OptionUseIECUnits(true),
	)
}
