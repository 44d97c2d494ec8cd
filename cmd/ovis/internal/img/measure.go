package img

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"math/bits"

	"github.com/ovis-storage/ovis/qcow2"
)

// MeasureConfig is what `ovis img measure` was given, as qemu-img
// measure's arguments: measure [--output=human|json] [-O FMT] [-o
// OPTIONS] (--size SIZE | [-f FMT] FILENAME).
type MeasureConfig struct {
	// Filename is the image whose content a new image must hold; "" with
	// Size.
	Filename string
	// Format (-f) is the source's format, "" to probe.
	Format string
	// Snapshot (-l) measures an internal snapshot of Filename:
	// "snapshot.id=ID,snapshot.name=NAME" or one ID or name.
	Snapshot string
	// Size (--size) is the virtual size of an empty new image, as typed;
	// "" with Filename.
	Size string
	// OutFormat (-O) is the new image's format; "" means raw.
	OutFormat string
	// Options are the -o arguments in order.
	Options []string
	// Output is "human" (the default, "") or "json".
	Output string
}

// measureInfo is QEMU's BlockMeasureInfo.
type measureInfo struct {
	required, fullyAllocated uint64
	hasBitmaps               bool
	bitmaps                  uint64
}

// Measure prints how large an image of OutFormat must be to hold Size
// bytes or the content of Filename, as qemu-img measure does: the size
// the new file needs ("required size"), the size with every cluster
// allocated ("fully allocated size"), and for a qcow2 source and version
// 3 output the room its persistent bitmaps take.
func (e *Env) Measure(ctx context.Context, cfg MeasureConfig) error {
	stdout := e.stdout()
	json, err := outputFormat(cfg.Output)
	if err != nil {
		return err
	}
	imgSize := int64(-1)
	if cfg.Size != "" {
		if imgSize, err = cvtnum("image size", cfg.Size, math.MaxInt64); err != nil {
			return err
		}
	}
	var snap SnapshotParam
	if cfg.Snapshot != "" {
		if snap, err = parseSnapshotParam(cfg.Snapshot, "'"); err != nil {
			return err
		}
	}
	options, err := accumulateOptions(cfg.Options)
	if err != nil {
		return err
	}
	switch {
	case cfg.Filename == "" && (cfg.Format != "" || cfg.Snapshot != ""):
		return errors.New("--image-opts, -f, and -l require a filename argument.")
	case cfg.Filename != "" && imgSize != -1:
		return errors.New("--size N cannot be used together with a filename.")
	case cfg.Filename == "" && imgSize == -1:
		return errors.New("Either --size N or one filename must be specified.")
	}
	var src *measureSource
	if cfg.Filename != "" {
		dev, err := e.openImage(cfg.Filename, cfg.Format, qcow2.Options{ReadOnly: true})
		if err != nil {
			return err
		}
		defer dev.Close()
		if cfg.Snapshot != "" {
			if err := LoadSnapshot(dev, snap); err != nil {
				return err
			}
		}
		if src, err = newMeasureSource(cfg.Filename, dev); err != nil {
			return err
		}
	}
	outFmt := cfg.OutFormat
	if outFmt == "" {
		outFmt = "raw"
	}
	desc, ok := formatOpts(outFmt)
	if !ok {
		return fmt.Errorf("Unknown file format '%s'", outFmt)
	}
	o, err := parseOptions(desc, options)
	if err != nil {
		return errors.Join(err, fmt.Errorf("Invalid options for file format '%s'", outFmt))
	}
	if imgSize != -1 {
		o.setNumber(optKeySize, uint64(imgSize))
	}
	var info *measureInfo
	if outFmt == "qcow2" {
		info, err = measureQcow2(ctx, o, src)
	} else {
		info = measureRaw(o, src)
	}
	if err != nil {
		return err
	}
	var out string
	if json {
		d := newQDict()
		d.put("required", int64(info.required))
		d.put("fully-allocated", int64(info.fullyAllocated))
		if info.hasBitmaps {
			d.put("bitmaps", int64(info.bitmaps))
		}
		out = qemuJSON(d) + "\n"
	} else {
		out = fmt.Sprintf("required size: %d\nfully allocated size: %d\n", info.required, info.fullyAllocated)
		if info.hasBitmaps {
			out += fmt.Sprintf("bitmaps size: %d\n", info.bitmaps)
		}
	}
	_, err = io.WriteString(stdout, out)
	return err
}

// measureRaw is QEMU's raw_measure: a raw file is as large as its
// virtual size, allocated or not.
func measureRaw(o *opts, src *measureSource) *measureInfo {
	var required uint64
	if src != nil {
		required = uint64(src.size)
	} else {
		required = roundUp(o.num(optKeySize), 512)
	}
	return &measureInfo{required: required, fullyAllocated: required}
}

// measureQcow2 is QEMU's qcow2_measure: the metadata of a fully
// allocated image of the (cluster-rounded) virtual size, plus the data
// clusters the source has (all of them with a backing file or
// preallocation), plus the source's bitmaps.
func measureQcow2(ctx context.Context, o *opts, src *measureSource) (*measureInfo, error) {
	extL2 := o.boolean(optKeyExtendedL2)
	cs := uint64(65536)
	if o.has(optKeyClusterSize) {
		cs = o.num(optKeyClusterSize)
	}
	if cs < 1<<qcow2.MinClusterBits || cs > 1<<qcow2.MaxClusterBits || cs&(cs-1) != 0 {
		return nil, fmt.Errorf("Cluster size must be a power of two between %d and %dk",
			1<<qcow2.MinClusterBits, 1<<(qcow2.MaxClusterBits-10))
	}
	if extL2 && cs < 16384 {
		return nil, fmt.Errorf("Extended L2 entries are only supported with cluster sizes of at least %d bytes", 16384)
	}
	version := 3
	if o.has(optKeyCompat) {
		switch v := o.str(optKeyCompat); v {
		case "0.10":
			version = 2
		case "1.1":
		default:
			return nil, fmt.Errorf("Invalid compatibility level: '%s'", v)
		}
	}
	rcBits := uint64(16)
	if o.has(optKeyRefcountBits) {
		rcBits = o.num(optKeyRefcountBits)
	}
	if rcBits > 64 || rcBits == 0 || rcBits&(rcBits-1) != 0 {
		return nil, errors.New("Refcount width must be a power of two and may not exceed 64 bits")
	}
	if version < 3 && rcBits != 16 {
		return nil, errors.New("Different refcount widths than 16 bits require compatibility level 1.1 or above (use compat=1.1 or greater)")
	}
	prealloc := qcow2.PreallocOff
	if o.has(optKeyPrealloc) {
		switch v := o.str(optKeyPrealloc); v {
		case qcow2.PreallocOff, qcow2.PreallocMetadata, qcow2.PreallocFalloc, qcow2.PreallocFull:
			prealloc = v
		default:
			return nil, fmt.Errorf("invalid parameter value: %s", v)
		}
	}
	hasBacking := o.has(optKeyBackingFile)

	virtual := roundUp(o.num(optKeySize), cs)
	l2e := uint64(8)
	if extL2 {
		l2e = 16
	}
	if l2Tables := divRoundUp(virtual/cs, cs/l2e); l2Tables*8 > 32<<20 {
		return nil, errors.New("The image size is too large (try using a larger cluster size)")
	}
	var required uint64
	if src != nil {
		virtual = roundUp(uint64(src.size), cs)
		if hasBacking {
			required = virtual
		} else {
			var err error
			if required, err = src.dataBytes(ctx, cs); err != nil {
				return nil, err
			}
		}
	}
	if prealloc == qcow2.PreallocFull || prealloc == qcow2.PreallocFalloc {
		required = virtual
	}
	info := &measureInfo{fullyAllocated: preallocSize(virtual, cs, uint(bits.TrailingZeros64(rcBits)), extL2)}
	info.required = info.fullyAllocated - virtual + required
	info.hasBitmaps = version >= 3 && src != nil && src.bitmapsSupported
	if info.hasBitmaps {
		info.bitmaps = src.bitmapBytes(cs)
	}
	return info, nil
}

func roundUp(n, m uint64) uint64    { return divRoundUp(n, m) * m }
func divRoundUp(n, m uint64) uint64 { return (n + m - 1) / m }

// preallocSize is QEMU's qcow2_calc_prealloc_size: the bytes of a fully
// allocated image of size bytes, metadata included.
func preallocSize(size, cs uint64, rcOrder uint, extL2 bool) uint64 {
	l2e := uint64(8)
	if extL2 {
		l2e = 16
	}
	aligned := roundUp(size, cs)
	meta := cs // header
	nl2e := roundUp(aligned/cs, cs/l2e)
	meta += nl2e * l2e
	nl1e := roundUp(nl2e*l2e/cs, cs/8)
	meta += nl1e * 8
	meta += refcountMetadataSize((meta+aligned)/cs, cs, rcOrder)
	return meta + aligned
}

// refcountMetadataSize is QEMU's qcow2_refcount_metadata_size without the
// generous increase: the bytes of refcount blocks and table that count
// clusters clusters and themselves, found as a fixed point.
func refcountMetadataSize(clusters, cs uint64, rcOrder uint) uint64 {
	perTable := cs / 8
	perBlock := cs * 8 >> rcOrder
	var table, blocks, n, last uint64
	for {
		last = n
		blocks = divRoundUp(clusters+table+blocks, perBlock)
		table = divRoundUp(blocks, perTable)
		n = clusters + blocks + table
		if n == last {
			return (blocks + table) * cs
		}
	}
}
