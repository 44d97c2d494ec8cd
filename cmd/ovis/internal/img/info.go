package img

import (
	"errors"
	"fmt"
	"io"
	"os"
	"syscall"

	"github.com/ovis-storage/ovis/block"
	"github.com/ovis-storage/ovis/image"
	"github.com/ovis-storage/ovis/qcow2"
)

// InfoConfig is what `ovis img info` was given, as qemu-img info's
// arguments: info [-f FMT] [--output=human|json] [--backing-chain] [-U]
// FILENAME.
type InfoConfig struct {
	// Filename is the image to describe.
	Filename string
	// Format is "qcow2", "raw", or "" to probe.
	Format string
	// Output is "human" (the default, "") or "json".
	Output string
	// BackingChain describes every image of the backing chain, top first.
	BackingChain bool
}

// Info writes qemu-img info's output for the image: the same lines in
// human form, the same keys in the same order with the same values in
// JSON. Images are opened read-only without their backing files.
func (e *Env) Info(cfg InfoConfig) error {
	w := e.stdout()
	switch cfg.Output {
	case "", "human", "json":
	default:
		return errors.New("--output must be used with human or json as argument.")
	}
	list, err := e.collectInfo(cfg.Filename, cfg.Format, cfg.BackingChain)
	if err != nil {
		return err
	}
	var out string
	switch {
	case cfg.Output == "json" && cfg.BackingChain:
		l := make([]any, len(list))
		for i, info := range list {
			l[i] = info.qdict()
		}
		out = qemuJSON(l) + "\n"
	case cfg.Output == "json":
		out = qemuJSON(list[0].qdict()) + "\n"
	default:
		for i, info := range list {
			if i > 0 {
				out += "\n"
			}
			out += info.human()
		}
	}
	_, err = io.WriteString(w, out)
	return err
}

// collectInfo describes the image and, with chain, its backing files.
func (e *Env) collectInfo(filename, format string, chain bool) ([]*imageInfo, error) {
	var list []*imageInfo
	seen := map[string]bool{}
	for {
		if seen[filename] {
			return nil, fmt.Errorf("Backing file '%s' creates an infinite loop.", filename)
		}
		seen[filename] = true
		info, err := e.queryImage(filename, format)
		if err != nil {
			return nil, err
		}
		list = append(list, info)
		if !chain || info.backingFilename == "" {
			return list, nil
		}
		next := info.fullBackingFilename
		if e.Untrusted {
			if info.backingFormat == "" {
				return nil, noBackingFormat(filename, info.backingFilename)
			}
			real, err := qcow2.Confine(filename, next)
			if err != nil {
				return nil, fmt.Errorf("Could not open backing file '%s': %v", next, err)
			}
			next = real
		}
		filename, format = next, info.backingFormat
	}
}

// imageInfo is QEMU's ImageInfo for the fields qcow2 and raw images have.
type imageInfo struct {
	filename    string
	format      string
	dirtyFlag   bool
	actualSize  int64 // -1: unavailable
	virtualSize int64
	clusterSize int64 // 0: absent

	backingFilename     string
	fullBackingFilename string
	backingFormat       string

	snapshots []snapshotInfo
	// specific is the "data" of "format-specific"; nil when absent.
	specific *qdict
}

// snapshotInfo is QEMU's SnapshotInfo.
type snapshotInfo struct {
	id, name    string
	vmStateSize uint64
	dateSec     int64
	dateNsec    int64
	vmClockNsec uint64
	// icount is -1 when the snapshot does not record it.
	icount int64
}

// queryImage describes one image, opened read-only without its backing
// file.
func (e *Env) queryImage(filename, format string) (*imageInfo, error) {
	// A backing file may be named file: or json:, as the image itself.
	filename, err := e.ResolveFilename(filename, &format)
	if err != nil {
		return nil, err
	}
	st, err := os.Stat(filename)
	if err != nil {
		return nil, e.openError(filename, err)
	}
	if err := e.requireFormat(filename, format); err != nil {
		return nil, err
	}
	if format == "" {
		if format, err = image.Probe(filename); err != nil {
			return nil, e.openError(filename, err)
		}
	}
	info := &imageInfo{filename: filename, format: format, actualSize: allocatedBytes(st)}
	switch format {
	case "raw":
		r, err := block.OpenRaw(filename, true)
		if err != nil {
			return nil, e.openError(filename, err)
		}
		// QEMU counts whole sectors: a partial last sector reads as zeros.
		info.virtualSize = (r.Size() + 511) &^ 511
		r.Close()
	case "qcow2":
		// qemu-img info opens what qcow2_open opens, which does not look
		// into the L1 or refcount table entries nor the snapshots' L1
		// tables: ForCheck, read-only, leaves them unchecked.
		img, err := qcow2.Open(filename, e.trust(filename, qcow2.Options{ReadOnly: true, NoBacking: true, ForCheck: true}))
		if err != nil {
			return nil, e.openError(filename, err)
		}
		defer img.Close()
		snaps, err := img.QemuSnapshots()
		if err != nil {
			return nil, wrapMsg(err, "Could not open '%s': %v", e.displayName(filename), err)
		}
		h := img.Header()
		info.virtualSize = int64(h.Size)
		info.clusterSize = h.ClusterSize()
		info.dirtyFlag = h.IncompatibleFeatures&qcow2.IncompatDirty != 0
		if h.BackingFile != "" {
			info.backingFilename = h.BackingFile
			info.fullBackingFilename = combinePath(filename, h.BackingFile)
			info.backingFormat = h.BackingFormat
		}
		// QEMU cannot list the snapshots of an image with a data file
		// (qcow2_snapshot_list: ENOTSUP), and info leaves them out.
		if !h.HasDataFile() {
			for _, s := range snaps {
				info.snapshots = append(info.snapshots, snapshotInfoOf(s))
			}
		}
		bitmaps, err := qcow2Bitmaps(filename, &h)
		if err != nil {
			return nil, e.openError(filename, err)
		}
		info.specific = qcow2Specific(&h, bitmaps)
	default:
		return nil, fmt.Errorf("Could not open '%s': Unknown driver '%s'", filename, format)
	}
	if io := e.imageOptsFor(filename); io != nil && io.FileProtocol && format == "raw" {
		info.format = "file" // json:{"driver":"file",...}, read as raw
	}
	return info, nil
}

// allocatedBytes is the space the file takes on disk (st_blocks * 512),
// QEMU's actual-size; -1 when the file system does not say.
func allocatedBytes(st os.FileInfo) int64 {
	if s, ok := st.Sys().(*syscall.Stat_t); ok {
		return s.Blocks * 512
	}
	return -1
}

// snapshotInfoOf converts an engine snapshot table entry to QEMU's
// SnapshotInfo.
func snapshotInfoOf(s qcow2.Snapshot) snapshotInfo {
	return snapshotInfo{
		id:          s.ID,
		name:        s.Name,
		vmStateSize: s.VMStateSize,
		dateSec:     int64(s.DateSec),
		dateNsec:    int64(s.DateNsec),
		vmClockNsec: s.VMClockNsec,
		icount:      s.ICount,
	}
}

// qcow2Specific builds ImageInfoSpecificQCow2 as QEMU's
// qcow2_get_specific_info does, inserting keys in the QAPI schema's order
// (which decides the order of keys that share a hash bucket).
func qcow2Specific(h *qcow2.Header, bitmaps []any) *qdict {
	d := newQDict()
	if h.Version < 3 {
		d.put("compat", "0.10")
		d.put("refcount-bits", int64(h.RefcountBits()))
		d.put("compression-type", "zlib")
		return d
	}
	d.put("compat", "1.1")
	if h.DataFile != "" {
		d.put("data-file", h.DataFile)
	}
	if h.HasDataFile() {
		d.put("data-file-raw", h.DataFileRaw())
	}
	d.put("extended-l2", h.ExtendedL2())
	d.put("lazy-refcounts", h.LazyRefcounts())
	d.put("corrupt", h.IncompatibleFeatures&qcow2.IncompatCorrupt != 0)
	d.put("refcount-bits", int64(h.RefcountBits()))
	if len(bitmaps) > 0 {
		d.put("bitmaps", bitmaps)
	}
	ct := "zlib"
	if h.CompressionType == qcow2.CompressionZstd {
		ct = "zstd"
	}
	d.put("compression-type", ct)
	return d
}

// qdict builds the ImageInfo QDict in the QAPI schema's member order.
func (i *imageInfo) qdict() *qdict {
	d := newQDict()
	d.put("filename", i.filename)
	d.put("format", i.format)
	d.put("dirty-flag", i.dirtyFlag)
	if i.actualSize >= 0 {
		d.put("actual-size", i.actualSize)
	}
	d.put("virtual-size", i.virtualSize)
	if i.clusterSize != 0 {
		d.put("cluster-size", i.clusterSize)
	}
	if i.backingFilename != "" {
		d.put("backing-filename", i.backingFilename)
		d.put("full-backing-filename", i.fullBackingFilename)
		if i.backingFormat != "" {
			d.put("backing-filename-format", i.backingFormat)
		}
	}
	if len(i.snapshots) > 0 {
		l := make([]any, len(i.snapshots))
		for n, s := range i.snapshots {
			sd := newQDict()
			sd.put("id", s.id)
			sd.put("name", s.name)
			sd.put("vm-state-size", int64(s.vmStateSize))
			sd.put("date-sec", s.dateSec)
			sd.put("date-nsec", s.dateNsec)
			sd.put("vm-clock-sec", int64(s.vmClockNsec/1e9))
			sd.put("vm-clock-nsec", int64(s.vmClockNsec%1e9))
			if s.icount != -1 {
				sd.put("icount", s.icount)
			}
			l[n] = sd
		}
		d.put("snapshots", l)
	}
	if i.specific != nil {
		fs := newQDict()
		fs.put("type", i.format)
		fs.put("data", i.specific)
		d.put("format-specific", fs)
	}
	return d
}
