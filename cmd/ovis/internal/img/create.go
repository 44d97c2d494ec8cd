package img

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"math"
	"strings"
	"syscall"

	"github.com/ovis-storage/ovis/image"
	"github.com/ovis-storage/ovis/qcow2"
)

// CreateConfig is what `ovis img create` was given, as qemu-img create's
// arguments: create [-q] [-f FMT] [-b BACKING] [-F BACKING_FMT] [-u]
// [-o OPTIONS] FILENAME [SIZE].
type CreateConfig struct {
	// Format is "qcow2" or "raw". The default ("") is raw, as in qemu-img.
	Format string
	// Options are the -o arguments in order; they are joined with commas.
	Options []string
	// BackingFile (-b) and BackingFormat (-F) override the backing_file
	// and backing_fmt options.
	BackingFile   string
	BackingFormat string
	// BackingFileSet and BackingFormatSet say that -b and -F were given,
	// even as empty strings, which qemu-img refuses.
	BackingFileSet, BackingFormatSet bool
	// Unsafe (-u) does not open the backing file, so SIZE is required.
	Unsafe bool
	// Quiet (-q) leaves out the "Formatting" line.
	Quiet bool
	// Filename is the image to create. It may be empty only when the
	// options ask for help.
	Filename string
	// Size is the SIZE argument as typed; "" when absent.
	Size string
}

// Create creates an image as qemu-img create does, printing the
// "Formatting '...', fmt=..." line to stdout first (the exact line
// qemu-img 7.2 prints for the same arguments), or the option help for
// -o help. Errors carry qemu-img's messages; those about the new image are
// prefixed with its name.
func (e *Env) Create(cfg CreateConfig) error {
	stdout := e.stdout()
	options, err := accumulateOptions(cfg.Options)
	if err != nil {
		return err
	}
	format := cfg.Format
	if format == "" {
		format = "raw"
	}
	if hasHelpOption(options) {
		return printOptionHelp(stdout, format, cfg.Filename)
	}
	if cfg.Filename == "" {
		return UsageError("Expecting image file name")
	}
	imgSize := int64(-1)
	if cfg.Size != "" {
		if imgSize, err = cvtnum("image size", cfg.Size, math.MaxInt64); err != nil {
			return err
		}
	}
	if err := create(cfg, format, options, imgSize, stdout); err != nil {
		return fmt.Errorf("%s: %w", cfg.Filename, err)
	}
	return nil
}

// create follows QEMU's bdrv_img_create.
func create(cfg CreateConfig, format, options string, imgSize int64, stdout io.Writer) error {
	desc, ok := formatOpts(format)
	if !ok {
		return fmt.Errorf("Unknown file format '%s'", format)
	}
	path, err := newImagePath(cfg.Filename)
	if err != nil {
		return err
	}
	o, err := parseOptions(desc, options)
	if err != nil {
		return err
	}
	if o.has(optKeySize) && imgSize != -1 {
		return errors.New("The image size must be specified only once")
	}
	if cfg.BackingFile != "" || cfg.BackingFileSet {
		if _, ok := o.find(optKeyBackingFile); !ok {
			return fmt.Errorf("Backing file not supported for file format '%s'", format)
		}
		o.vals[optKeyBackingFile] = optValue{str: cfg.BackingFile}
	}
	if cfg.BackingFormat != "" || cfg.BackingFormatSet {
		if _, ok := o.find(optKeyBackingFmt); !ok {
			return fmt.Errorf("Backing file format not supported for file format '%s'", format)
		}
		o.vals[optKeyBackingFmt] = optValue{str: cfg.BackingFormat}
	}
	backing, backingFmt := o.str(optKeyBackingFile), o.str(optKeyBackingFmt)
	if o.has(optKeyBackingFile) {
		if backing == cfg.Filename {
			return errors.New("Error: Trying to create an image with the same filename as the backing file")
		}
		if backing == "" {
			return errors.New("Expected backing file name, got empty string")
		}
	}

	size := imgSize
	if o.has(optKeySize) {
		size = int64(o.num(optKeySize))
	}
	switch {
	case backing != "" && !cfg.Unsafe:
		full := combinePath(path, backing)
		if _, ok := formatOpts(backingFmt); o.has(optKeyBackingFmt) && !ok {
			return fmt.Errorf("Unknown driver '%s'\nCould not open backing image.", backingFmt)
		}
		// Only its size is read: QEMU opens it even while in use.
		dev, err := image.Open(full, backingFmt, qcow2.Options{ReadOnly: true, NoBacking: true, ForceShare: true})
		if err != nil {
			return fmt.Errorf("%s\nCould not open backing image.", openReason(err))
		}
		probed := backingFmt
		if probed == "" {
			probed, _ = image.Probe(full)
		}
		bsize := dev.Size()
		dev.Close()
		if backingFmt == "" {
			return fmt.Errorf("Backing file specified without backing format\nDetected format of %s.", probed)
		}
		if size == -1 {
			size = bsize
		}
	case backing != "" && !o.has(optKeyBackingFmt):
		return errors.New("Backing file specified without backing format")
	}
	if size == -1 {
		return errors.New("Image creation needs a size parameter")
	}
	o.setNumber(optKeySize, uint64(size))

	if !cfg.Quiet {
		fmt.Fprintf(stdout, "Formatting '%s', fmt=%s %s\n", cfg.Filename, format, o.print())
	}
	// Both formats round the size up to whole sectors.
	size = (size + 511) &^ 511
	if format == "raw" {
		return createRaw(path, size, o.str(optKeyPrealloc))
	}
	co, err := qcow2CreateOptions(o, size)
	if err != nil {
		return err
	}
	return createQcow2(path, co)
}

// createQcow2 creates a qcow2 image at path, refusing (before the file is
// touched) one another process holds.
func createQcow2(path string, co qcow2.CreateOptions) error {
	create := func() error {
		if err := qcow2.Create(path, co); err != nil {
			return createError("qcow2", err)
		}
		return nil
	}
	return withCreateLock(path, "qcow2", func() error {
		if co.DataFile == "" {
			return create()
		}
		// The external data file is truncated too: it must not be the
		// data file of an image in use (QEMU creates it as a raw file).
		return withCreateLock(combinePath(path, co.DataFile), "raw", create)
	})
}

// createError maps a failed creation to qemu-img's message.
func createError(format string, err error) error {
	var pe *fs.PathError
	switch {
	case errors.Is(err, syscall.EFBIG):
		return wrapMsg(err, "The image size is too large for file format '%s'", format)
	case errors.As(err, &pe):
		return wrapMsg(err, "Could not create '%s': %s", pe.Path, strerror(pe.Err))
	}
	return err
}

// qcow2CreateOptions turns parsed options into the engine's create options,
// checking them first in the order and with the messages of QEMU 7.2's
// qcow2_co_create_opts and qcow2_co_create.
func qcow2CreateOptions(o *opts, size int64) (qcow2.CreateOptions, error) {
	co := qcow2.CreateOptions{
		Size:            size,
		ClusterSize:     65536,
		Compat:          "1.1",
		Preallocation:   qcow2.PreallocOff,
		LazyRefcounts:   o.boolean(optKeyLazyRefcounts),
		RefcountBits:    16,
		ExtendedL2:      o.boolean(optKeyExtendedL2),
		CompressionType: "zlib",
		BackingFile:     o.str(optKeyBackingFile),
		BackingFormat:   o.str(optKeyBackingFmt),
		DataFile:        o.str(optKeyDataFile),
		DataFileRaw:     o.boolean(optKeyDataFileRaw),
	}
	// QAPI parsing of the enums, in BlockdevCreateOptionsQcow2's order.
	if o.has(optKeyCompat) {
		switch v := o.str(optKeyCompat); v {
		case "0.10", "v2":
			co.Compat = "0.10"
		case "1.1", "v3":
		default:
			return co, fmt.Errorf("Parameter 'version' does not accept value '%s'", v)
		}
	}
	// Any block driver's name is a backing format to QAPI, but not "".
	if o.has(optKeyBackingFmt) && o.str(optKeyBackingFmt) == "" {
		return co, errors.New("Parameter 'backing-fmt' does not accept value ''")
	}
	if o.has(optKeyPrealloc) {
		switch v := o.str(optKeyPrealloc); v {
		case qcow2.PreallocOff, qcow2.PreallocMetadata, qcow2.PreallocFalloc, qcow2.PreallocFull:
			co.Preallocation = v
		default:
			return co, fmt.Errorf("Parameter 'preallocation' does not accept value '%s'", v)
		}
	}
	if o.has(optKeyCompression) {
		switch v := o.str(optKeyCompression); v {
		case "zlib", "zstd":
			co.CompressionType = v
		default:
			return co, fmt.Errorf("Parameter 'compression-type' does not accept value '%s'", v)
		}
	}
	if o.has(optKeyClusterSize) {
		co.ClusterSize = int64(o.num(optKeyClusterSize))
	}
	if o.has(optKeyRefcountBits) {
		co.RefcountBits = int(min(o.num(optKeyRefcountBits), 1<<16))
	}
	v2 := co.Compat == "0.10"
	const useV3 = " (use version=v3 or greater)"

	if co.ExtendedL2 && v2 {
		return co, errors.New("Extended L2 entries are only supported with compatibility level 1.1 and above" + useV3)
	}
	cs := o.num(optKeyClusterSize)
	if !o.has(optKeyClusterSize) {
		cs = 65536
	}
	if cs < 1<<qcow2.MinClusterBits || cs > 1<<qcow2.MaxClusterBits || cs&(cs-1) != 0 {
		return co, fmt.Errorf("Cluster size must be a power of two between %d and %dk",
			1<<qcow2.MinClusterBits, 1<<(qcow2.MaxClusterBits-10))
	}
	if co.ExtendedL2 && cs < 16384 {
		return co, fmt.Errorf("Extended L2 entries are only supported with cluster sizes of at least %d bytes", 16384)
	}
	if co.BackingFile != "" && co.Preallocation != qcow2.PreallocOff && !co.ExtendedL2 {
		return co, errors.New("Backing file and preallocation can only be used at the same time if extended_l2 is on")
	}
	if co.BackingFormat != "" && co.BackingFile == "" {
		return co, errors.New("Backing format cannot be used without backing file")
	}
	if co.LazyRefcounts && v2 {
		return co, errors.New("Lazy refcounts only supported with compatibility level 1.1 and above" + useV3)
	}
	if rb := co.RefcountBits; rb > 64 || rb <= 0 || rb&(rb-1) != 0 {
		return co, errors.New("Refcount width must be a power of two and may not exceed 64 bits")
	}
	if v2 && co.RefcountBits != 16 {
		return co, errors.New("Different refcount widths than 16 bits require compatibility level 1.1 or above" + useV3)
	}
	if co.DataFileRaw && co.DataFile == "" {
		return co, errors.New("data-file-raw requires data-file")
	}
	if co.DataFileRaw && co.BackingFile != "" {
		return co, errors.New("Backing file and data-file-raw cannot be used at the same time")
	}
	if co.DataFileRaw && co.Preallocation == qcow2.PreallocOff {
		// The L1/L2 tables must map the data file 1:1 (QEMU's comment:
		// the file stays readable with or without the metadata).
		co.Preallocation = qcow2.PreallocMetadata
	}
	if co.DataFile != "" && v2 {
		return co, errors.New("External data files are only supported with compatibility level 1.1 and above" + useV3)
	}
	if co.CompressionType != "zlib" && v2 {
		return co, errors.New("Non-zlib compression type is only supported with compatibility level 1.1 and above" + useV3)
	}
	// QEMU's L1 table is at most 32 MiB (QCOW_MAX_L1_SIZE); a larger one
	// fails with EFBIG, which qemu-img reports as this.
	entry := uint64(8)
	if co.ExtendedL2 {
		entry = 16
	}
	perL1 := cs * (cs / entry)
	if l1 := (uint64(size) + perL1 - 1) / perL1; l1 > 32<<20/8 {
		return co, errors.New("The image size is too large for file format 'qcow2' (try using a larger cluster size)")
	}
	co.ClusterSize = int64(cs)
	return co, nil
}

// combinePath resolves a backing file name against the image that names
// it, textually, as QEMU's path_combine does: an absolute name stays, a
// relative one is appended to everything up to the image name's last '/'.
// "sub/top.qcow2" and "../base" give "sub/../base".
func combinePath(image, name string) string {
	if strings.HasPrefix(name, "/") {
		return name
	}
	if i := strings.LastIndexByte(image, '/'); i >= 0 {
		return image[:i+1] + name
	}
	return name
}
