package img

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"time"

	"github.com/schollz/progressbar/v3"

	"github.com/ovis-storage/ovis/block"
	"github.com/ovis-storage/ovis/convert"
	"github.com/ovis-storage/ovis/export"
	"github.com/ovis-storage/ovis/image"
	"github.com/ovis-storage/ovis/qcow2"
)

// ConvertConfig is what `ovis img convert` was given, as qemu-img
// convert's arguments: convert [-f FMT] [-O FMT] [-o OPTIONS] [-c] [-p]
// [-q] [-S SIZE] [-B BACKING [-F BACKING_FMT]] [-n] [-m N] [-W] [-C]
// [-r RATE] [-l SNAPSHOT] [--salvage] SRC [SRC2...] DST.
type ConvertConfig struct {
	// Sources are the images to copy (SRC...). Several are concatenated,
	// each rounded up to whole sectors.
	Sources []string
	// SourceFormat (-f) is "qcow2", "raw" or "" to probe.
	SourceFormat string
	// Snapshot (-l) copies an internal snapshot of the (first) source
	// instead of its current state: "snapshot.id=ID,snapshot.name=NAME"
	// or one ID or name.
	Snapshot string
	// Dest is the image to write (DST). With TargetImageOpts
	// (--target-image-opts, which needs NoCreate) it is an option list.
	Dest            string
	TargetImageOpts bool
	// DestFormat (-O) defaults to raw.
	DestFormat string
	// Options are the -o arguments in order.
	Options []string
	// Compress (-c) writes every cluster compressed; qcow2 only.
	Compress bool
	// Progress (-p) draws a progress bar on the Env's Stderr, where the
	// warnings of Salvage go too.
	Progress bool
	// ProgressTerminal says stdout is a terminal: -p then draws a bar on
	// Stderr. Otherwise it prints qemu-img's "    (12.34/100%)\r"
	// lines on stdout, which the programs that drive qemu-img parse.
	ProgressTerminal bool
	// Quiet (-q) draws no progress bar and prints no warnings.
	Quiet bool
	// Salvage (--salvage) reads what can be read: a range that fails to
	// read is retried sector by sector, and each sector that still fails
	// is written as zeros, with a warning.
	Salvage bool
	// RateLimit (-r) caps the bytes written per second ("" or "0": no
	// cap), as qemu-img's write throttling does.
	RateLimit string
	// CopyRange (-C) copies data between raw files inside the kernel
	// (copy_file_range) where it can, and through memory where not.
	CopyRange bool
	// Bitmaps (--bitmaps) copies the source's persistent bitmaps into a
	// qcow2 output; SkipBrokenBitmaps (--skip-broken-bitmaps) leaves out
	// the inconsistent ones instead of failing.
	Bitmaps, SkipBrokenBitmaps bool
	// SparseSize (-S) is the -S argument as typed: all-zero runs of at
	// least this many bytes inside data are not written. "" means the
	// default, 4k; "0" writes everything and allocates the whole output.
	SparseSize string
	// BackingFile (-B) and BackingFormat (-F) give the output a backing
	// file, which must hold what the source's backing file holds: only
	// the source's own layer is copied.
	BackingFile   string
	BackingFormat string
	// BackingFileSet and BackingFormatSet say that -B and -F were given,
	// even as empty strings.
	BackingFileSet, BackingFormatSet bool
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
const DefaultWorkers = convert.DefaultWorkers

// Convert copies an image into a new (or, with NoCreate, existing) image as
// qemu-img convert does. The output is sparse: ranges the source reports
// as zero are not written to a fresh output, nor are all-zero runs of at
// least SparseSize bytes inside data. stdout receives -o help.
func (e *Env) Convert(ctx context.Context, cfg ConvertConfig) (err error) {
	stdout := e.stdout()
	minSparse, workers, err := convertLimits(cfg)
	if err != nil {
		return err
	}
	var rate int64
	if cfg.RateLimit != "" {
		if rate, err = cvtnum("rate limit", cfg.RateLimit, math.MaxInt64); err != nil {
			return err
		}
	}
	if err := convertConflicts(cfg); err != nil {
		return err
	}
	outFmt := cfg.DestFormat
	if outFmt == "" && !cfg.TargetImageOpts {
		// An option list without a driver is probed, as qemu-img does.
		outFmt = "raw"
	}
	options, err := accumulateOptions(cfg.Options)
	if err != nil {
		return err
	}
	if hasHelpOption(options) {
		if outFmt == "" {
			return errors.New("Option help requires a format be specified")
		}
		return printOptionHelp(stdout, outFmt, cfg.Dest)
	}
	if len(cfg.Sources) == 0 || cfg.Dest == "" {
		return errors.New("Must specify image file name")
	}
	cache, srcCache := block.CacheUnsafe, block.CacheWriteback
	if cfg.SourceCache != "" {
		if srcCache, err = block.ParseCacheMode(cfg.SourceCache); err != nil {
			return fmt.Errorf("Invalid source cache option: %s", cfg.SourceCache)
		}
	}
	// qemu-img starts its progress here: what fails from now on still
	// prints the first line and the newline, success also the last line.
	var qprog *qemuProgress
	if cfg.Progress && !cfg.Quiet && !cfg.ProgressTerminal {
		qprog = newQemuProgress(true, stdout, 1)
		qprog.print(0, 100)
		defer func() {
			if ee := (*ExitError)(nil); err == nil || errors.As(err, &ee) && ee.Code == 0 {
				qprog.print(100, 0)
			}
			qprog.end()
		}()
	}
	if _, ok := formatOpts(cfg.SourceFormat); !ok && cfg.SourceFormat != "" {
		return fmt.Errorf("Could not open '%s': Unknown driver '%s'", cfg.Sources[0], cfg.SourceFormat)
	}
	if cfg.Cache != "" {
		if cache, err = block.ParseCacheMode(cfg.Cache); err != nil {
			return fmt.Errorf("Invalid cache option: %s", cfg.Cache)
		}
	}
	src, err := e.openSources(cfg, srcCache)
	if err != nil {
		return err
	}
	defer src.Close()
	if cfg.Bitmaps {
		if err := checkBitmaps(cfg, src); err != nil {
			return err
		}
	}

	// The output's name as QEMU takes it (file:, and json: for -n).
	if !cfg.NoCreate {
		if cfg.Dest, err = newImagePath(cfg.Dest); err != nil {
			return err
		}
	} else if !cfg.TargetImageOpts {
		if cfg.Dest, err = e.ResolveFilename(cfg.Dest, nil); err != nil {
			return err
		}
	}
	targetHasBacking := cfg.BackingFile != "" || cfg.BackingFileSet
	if cfg.TargetIsZero && targetHasBacking {
		// qemu-img reports this and then exits with status 0, without
		// converting.
		return exitWith(0, errors.New("Cannot use --target-is-zero when the destination image has a backing file"))
	}
	if cfg.NoCreate && targetHasBacking && len(cfg.Sources) > 1 {
		return errConcatBacking
	}
	if !cfg.NoCreate {
		if targetHasBacking, err = prepareTarget(cfg, outFmt, options, src.Size()); err != nil {
			return err
		}
	}
	dst, err := e.openTarget(cfg.Dest, outFmt, cfg.NoCreate, cache)
	if err != nil {
		return e.writerOpenError(cfg.Dest, outFmt, err)
	}
	if cfg.NoCreate {
		// An existing dirty target is repaired as it opens, aloud even
		// under -q, as qemu-img.
		if err := repairDirty(ctx, dst, cfg.Dest, e.stderr()); err != nil {
			dst.Close()
			return err
		}
	}
	if cfg.Bitmaps {
		if img, ok := block.As[*qcow2.Image](dst); !ok || img.Header().Version < 3 {
			format := "raw"
			if ok {
				format = "qcow2"
			}
			dst.Close()
			return fmt.Errorf("Format driver '%s' does not support bitmaps", format)
		}
	}
	o := convert.Options{
		Workers:    workers,
		OutOfOrder: cfg.Unordered,
		MinSparse:  minSparse,
		// qemu-img's has_zero_init: a new output, or one the caller
		// vouches for, that has no backing file.
		TargetIsZero: (!cfg.NoCreate || cfg.TargetIsZero) && !targetHasBacking,
		Compress:     cfg.Compress,
		CopyRange:    cfg.CopyRange,
		Salvage:      cfg.Salvage,
		RateLimit:    rate,
	}
	if minSparse == 0 {
		o.MinSparse = -1 // -S 0: no zero detection
	}
	if !cfg.Quiet {
		w := e.warnTo(cfg)
		o.Salvaged = func(err *convert.Error) {
			what := "reading"
			if err.Op == convert.OpBlockStatus {
				what = "reading block status at"
			}
			fmt.Fprintf(w, "ovis: warning: error while %s offset %d: %s\n", what, err.Off, strerror(err.Err))
		}
	}
	if img, ok := block.As[*qcow2.Image](src); ok && targetHasBacking && img.Backing() != nil {
		o.TopOnly = true
	}
	if img, ok := block.As[*qcow2.Image](dst); ok && !cfg.NoCreate && img.Backing() != nil {
		// qemu-img knows the backing file's length only for a new target.
		// In sectors, rounded up as QEMU's total_sectors.
		o.BackingEnd = (img.Backing().Size() + 511) / 512 * 512
		o.HasBackingEnd = true
	}
	err = e.runCopy(ctx, dst, src, o, cfg, qprog)
	if cerr := dst.Close(); err == nil && cerr != nil {
		err = fmt.Errorf("%s: %w", cfg.Dest, cerr)
	}
	if err == nil && cfg.Bitmaps {
		err = e.copyBitmaps(ctx, cfg, src, outFmt, cache)
	}
	return err
}

// checkBitmaps refuses --bitmaps as qemu-img does before it converts:
// several sources, a source without bitmaps support, an inconsistent
// bitmap without --skip-broken-bitmaps.
func checkBitmaps(cfg ConvertConfig, src block.Device) error {
	if len(cfg.Sources) > 1 {
		return errors.New("Copying bitmaps only possible with single source")
	}
	img, ok := block.As[*qcow2.Image](src)
	if !ok || img.Header().Version < 3 {
		return errors.New("Source lacks bitmap support")
	}
	for _, b := range img.Bitmaps() {
		if b.InUse && !cfg.SkipBrokenBitmaps {
			return fmt.Errorf("Cannot copy inconsistent bitmap '%s'\n"+
				"Try --skip-broken-bitmaps, or use 'qemu-img bitmap --remove' to delete it", b.Name)
		}
	}
	return nil
}

// copyBitmaps adds the source's consistent bitmaps to the finished output,
// with their granularity, enabled state and bits.
func (e *Env) copyBitmaps(ctx context.Context, cfg ConvertConfig, src block.Device, outFmt string, cache block.CacheMode) error {
	simg, _ := block.As[*qcow2.Image](src) // checkBitmaps made sure
	dev, err := e.openTarget(cfg.Dest, outFmt, true, cache)
	if err != nil {
		return e.openError(cfg.Dest, err)
	}
	dst, _ := block.As[*qcow2.Image](dev)
	for _, b := range simg.Bitmaps() {
		if b.InUse {
			fmt.Fprintf(e.warnTo(cfg), "ovis: warning: Skipping inconsistent bitmap '%s'\n", b.Name)
			continue
		}
		if dst == nil {
			err = fmt.Errorf("Failed to create bitmap %s: Can't store persistent bitmaps to %s: Operation not supported", b.Name, cfg.Dest)
			break
		}
		if err = dst.AddBitmap(ctx, b.Name, b.Granularity, !b.Auto); err != nil {
			err = fmt.Errorf("Failed to create bitmap %s: %s", b.Name, bitmapReason(err))
			break
		}
		bits, g, rerr := simg.BitmapBits(b.Name)
		if rerr == nil {
			rerr = dst.MergeBitmap(ctx, b.Name, bits, g)
		}
		if rerr != nil {
			dst.RemoveBitmap(ctx, b.Name)
			err = fmt.Errorf("Failed to populate bitmap %s: %s", b.Name, bitmapReason(rerr))
			break
		}
	}
	if cerr := dev.Close(); err == nil && cerr != nil {
		err = fmt.Errorf("%s: %w", cfg.Dest, cerr)
	}
	return err
}

// warnTo is where warnings go: nowhere under -q.
func (e *Env) warnTo(cfg ConvertConfig) io.Writer {
	if cfg.Quiet {
		return io.Discard
	}
	return e.stderr()
}

var errConcatBacking = errors.New("Having a backing file for the target makes no sense when concatenating multiple input images")

// convertConflicts refuses the combinations of options qemu-img convert
// refuses, with its messages and in its order.
func convertConflicts(cfg ConvertConfig) error {
	switch {
	case cfg.SkipBrokenBitmaps && !cfg.Bitmaps:
		return errors.New("Use of --skip-broken-bitmaps requires --bitmaps")
	case cfg.Compress && cfg.CopyRange:
		return errors.New("Cannot enable copy offloading when -c is used")
	case cfg.SparseSize != "" && cfg.CopyRange:
		return errors.New("Cannot enable copy offloading when -S is used")
	case cfg.CopyRange && cfg.Salvage:
		return errors.New("Cannot use copy offloading in salvaging mode")
	case cfg.TargetImageOpts && !cfg.NoCreate:
		return errors.New("--target-image-opts requires use of -n flag")
	case cfg.NoCreate && len(cfg.Options) > 0:
		return errors.New("-o has no effect when skipping image creation")
	case cfg.TargetIsZero && !cfg.NoCreate:
		return errors.New("--target-is-zero requires use of -n flag")
	}
	return nil
}

// openSources opens the sources read-only, loads the snapshot -l names,
// and joins several into one device.
func (e *Env) openSources(cfg ConvertConfig, cache block.CacheMode) (block.Device, error) {
	var snap SnapshotParam
	if cfg.Snapshot != "" {
		var err error
		if snap, err = parseSnapshotParam(cfg.Snapshot, "'"); err != nil {
			return nil, err
		}
	}
	parts := make([]block.Device, 0, len(cfg.Sources))
	fail := func(err error) (block.Device, error) {
		for _, p := range parts {
			p.Close()
		}
		return nil, err
	}
	for _, name := range cfg.Sources {
		if err := e.requireFormat(name, cfg.SourceFormat); err != nil {
			return fail(err)
		}
		// As qemu-img's BDRV_O_NO_SHARE: no other holder, in this
		// process or another, may write the source chain meanwhile.
		dev, err := image.Open(name, cfg.SourceFormat, e.trust(name, qcow2.Options{ReadOnly: true, NoShare: true, OpenFile: block.OpenFileFor(cache)}))
		if err != nil {
			// The layer that failed, as openImage names it.
			return fail(wrapMsg(err, "Could not open '%s': %s", e.displayName(name), e.chainReason(name, cfg.SourceFormat, err, 0)))
		}
		parts = append(parts, dev)
	}
	if cfg.Snapshot != "" {
		// As qemu-img: an ID or name with several sources is refused;
		// the option form loads the snapshot of the first source only.
		if snap.IDOrName != "" && len(parts) > 1 {
			return fail(errors.New("No support for concatenating multiple snapshot"))
		}
		if err := LoadSnapshot(parts[0], snap); err != nil {
			return fail(err)
		}
	}
	if len(parts) == 1 {
		return parts[0], nil
	}
	return convert.Concat(parts...), nil
}

// convertLimits checks -S and -m with qemu-img's messages.
func convertLimits(cfg ConvertConfig) (minSparse int64, workers int, err error) {
	minSparse = convert.DefaultMinSparse
	if cfg.SparseSize != "" {
		if minSparse, err = cvtnum("buffer size for sparse output", cfg.SparseSize, math.MaxInt64); err != nil {
			return 0, 0, err
		}
		if minSparse%512 != 0 || minSparse > convert.MaxMinSparse {
			return 0, 0, fmt.Errorf("Invalid buffer size for sparse output specified. Valid sizes are multiples of %d up to %d. "+
				"Select 0 to disable sparse detection (fully allocates output).", 512, convert.MaxMinSparse)
		}
	}
	workers = cfg.Workers
	if workers < 1 || workers > convert.MaxWorkers {
		return 0, 0, fmt.Errorf("Invalid number of coroutines. Allowed number of coroutines is between 1 and %d", convert.MaxWorkers)
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
	if cfg.BackingFile != "" || cfg.BackingFormat != "" || cfg.BackingFileSet || cfg.BackingFormatSet {
		if outFmt != "qcow2" {
			return false, fmt.Errorf("Backing file not supported for file format '%s'", outFmt)
		}
		if cfg.BackingFile != "" || cfg.BackingFileSet {
			o.vals[optKeyBackingFile] = optValue{str: cfg.BackingFile}
		}
		if cfg.BackingFormat != "" || cfg.BackingFormatSet {
			o.vals[optKeyBackingFmt] = optValue{str: cfg.BackingFormat}
		}
	}
	hasBacking = o.has(optKeyBackingFile)
	if hasBacking && len(cfg.Sources) > 1 {
		return false, errConcatBacking
	}
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
	err = nil
	if hasBacking && o.str(optKeyBackingFile) == "" {
		// qemu-img 7.2 crashes here; this is its create's refusal.
		err = errors.New("Expected backing file name, got empty string")
	}
	if err == nil {
		err = createTarget(cfg.Dest, outFmt, o, size)
	}
	if err != nil {
		return false, fmt.Errorf("%s: error while converting %s: %w", cfg.Dest, outFmt, err)
	}
	return hasBacking, nil
}

// runCopy checks the output against the copy's needs, with qemu-img's
// messages, and runs it, with a progress bar or qemu-img's figures for -p.
func (e *Env) runCopy(ctx context.Context, dst, src block.Device, o convert.Options, cfg ConvertConfig, qprog *qemuProgress) error {
	if _, ok := block.As[*qcow2.Image](dst); cfg.Compress && !ok {
		return errors.New("Compression not supported for this file format")
	}
	if dst.Size() < src.Size() {
		return errors.New("output file is smaller than input file")
	}
	progressTo := e.stderr()
	var bar *progressbar.ProgressBar
	switch {
	case qprog != nil:
		o.DataProgress = func(queued, total int64) {
			qprog.print(float32(100*float64(queued)/float64(total)), 0)
		}
	case cfg.Progress && !cfg.Quiet:
		bar = newProgressBar(src.Size(), progressTo)
		o.Progress = func(done, _ int64) { bar.Set64(done) }
	}
	err := qemuCopyError(convert.Copy(ctx, dst, src, o))
	if err != nil && ctx.Err() != nil {
		err = fmt.Errorf("interrupted; %s is incomplete: %w", cfg.Dest, ctx.Err())
	}
	if bar != nil {
		if err == nil {
			bar.Finish()
		}
		fmt.Fprintln(progressTo)
	}
	return err
}

// qemuCopyError words a failed step of the copy as qemu-img convert does.
func qemuCopyError(err error) error {
	var ce *convert.Error
	if !errors.As(err, &ce) {
		return err
	}
	switch ce.Op {
	case convert.OpBlockStatus:
		return fmt.Errorf("error while reading block status at offset %d: %w", ce.Off, ce.Err)
	case convert.OpRead:
		return fmt.Errorf("error while reading at byte %d: %w", ce.Off, ce.Err)
	case convert.OpWrite:
		return fmt.Errorf("error while writing at byte %d: %w", ce.Off, ce.Err)
	case convert.OpCompress:
		if ce.Off < 0 {
			return fmt.Errorf("error while compressing: %w", ce.Err)
		}
		return fmt.Errorf("error while compressing cluster at byte %d: %w", ce.Off, ce.Err)
	case convert.OpWriteCompressed:
		return fmt.Errorf("error while writing compressed cluster at byte %d: %w", ce.Off, ce.Err)
	case convert.OpFlush:
		return fmt.Errorf("error while flushing the output: %w", ce.Err)
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
	return createQcow2(path, co)
}

// openTarget opens the output for writing in a cache mode, with its
// backing file so that partial cluster writes can copy from it.
func (e *Env) openTarget(path, format string, existing bool, cache block.CacheMode) (block.Device, error) {
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
	// format is "" only under --target-image-opts without a driver.
	dev, err := image.Open(path, format, e.trust(path, qcow2.Options{OpenFile: open}))
	if err != nil {
		return nil, err
	}
	if cache.IgnoreFlush() {
		return dev, nil // syncs are dropped already; keep the engine's type
	}
	return export.WithCacheMode(dev, cache), nil
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
