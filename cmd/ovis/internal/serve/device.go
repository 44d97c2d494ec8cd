package serve

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"syscall"

	"github.com/ovis-storage/ovis/block"
	"github.com/ovis-storage/ovis/cmd/ovis/internal/img"
	"github.com/ovis-storage/ovis/export"
	"github.com/ovis-storage/ovis/image"
	"github.com/ovis-storage/ovis/qcow2"
)

// openDevice opens the image the Config names as the device to export:
// the image (or, with Snapshot, a temporary overlay over it) under the
// cache mode's file opener, wrapped with the cache mode's write semantics
// and then the discard and detect-zeroes policy. It returns the format it
// served and, for qcow2, the image itself (for its cache metrics). Errors
// read as qemu-nbd's "Failed to blk_new_open" messages.
func openDevice(ctx context.Context, c *Config) (block.Device, string, *qcow2.Image, error) {
	format := c.Format
	if format == "qcow2" {
		// QEMU's qcow2 driver refuses a file without the magic before
		// reading further; say so rather than report a short header.
		if f, err := image.Probe(c.File); err == nil && f != "qcow2" {
			return nil, "", nil, &msgError{msg: fmt.Sprintf("Failed to blk_new_open '%s': Image is not in qcow2 format", c.File)}
		}
	}
	if format == "" {
		f, err := image.Probe(c.File)
		if err != nil {
			return nil, "", nil, openError(c.File, err)
		}
		format = f
		if format == "raw" && c.Warnings != nil && !c.ReadOnly && !c.Snapshot && c.LoadSnapshot == "" {
			// QEMU warns when it opens a probed raw image for writing.
			fmt.Fprintf(c.Warnings, "WARNING: Image format was not specified for '%s' and probing guessed raw.\n"+
				"         Automatically detecting the format is dangerous for raw images, write operations on block 0 will be restricted.\n"+
				"         Specify the 'raw' format explicitly to remove the restrictions.\n", c.File)
		}
	}
	o := qcow2.Options{
		ReadOnly:           c.ReadOnly || c.Snapshot || c.LoadSnapshot != "",
		Untrusted:          c.Untrusted,
		L2CacheSize:        c.L2CacheSize,
		L2CacheEntrySize:   c.L2CacheEntrySize,
		RefcountCacheSize:  c.RefcountCacheSize,
		CacheSize:          c.CacheSize,
		L2CachePolicy:      c.L2CachePolicy,
		CacheCleanInterval: c.CacheCleanInterval,
		OpenFile:           block.OpenFileFor(c.Cache),
	}
	display := c.File
	if io := c.ImageOpts; io != nil {
		display = io.Spec
		o = io.Apply(o)
	}
	var (
		dev block.Device
		err error
	)
	if c.Snapshot {
		dev, err = openOverlay(c.File, format, o, c.ReadOnly)
	} else {
		// Clients are told the size: others may not resize the image.
		o.FixedSize = true
		dev, err = image.Open(c.File, format, o)
	}
	if err != nil {
		return nil, "", nil, openErrorAs(display, c.File, err)
	}
	if r, ok := block.As[*block.Raw](dev); ok {
		if c.Cache.Direct() && !o.ReadOnly && !c.Snapshot && r.Size()%block.DirectAlign != 0 {
			// QEMU cannot write an O_DIRECT file's partial last
			// block without growing it, so it refuses the open.
			dev.Close()
			return nil, "", nil, &msgError{msg: fmt.Sprintf("Failed to blk_new_open '%s': Cannot get 'write' permission without 'resize': Image size is not a multiple of request alignment", display)}
		}
		// qemu-nbd exports a raw file in whole sectors; clients
		// would otherwise map the partial last one themselves.
		r.RoundUpToSector()
	}
	if c.LoadSnapshot != "" {
		if err := loadSnapshot(dev, c); err != nil {
			dev.Close()
			return nil, "", nil, err
		}
	}
	qimg, _ := block.As[*qcow2.Image](dev)
	if qimg != nil && !o.ReadOnly && c.Warnings != nil {
		// qemu-nbd repairs a dirty lazy-refcounts image when it opens it
		// for writing, and prints the repair.
		if err := img.RepairDirty(ctx, dev, display, c.Warnings); err != nil {
			dev.Close()
			return nil, "", nil, &msgError{msg: "Failed to blk_new_open " + strings.TrimPrefix(err.Error(), "Could not open ")}
		}
	}
	if qimg != nil && c.Discard == DiscardUnmap {
		// discard=unmap sets BDRV_O_UNMAP, which turns on qcow2's
		// pass-discard-request: the clusters a TRIM (or a zero write
		// allowed to unmap) frees are punched in the host file too.
		qimg.SetPassDiscardRequest(true)
	}
	dev = export.WithCacheMode(dev, c.Cache)
	return export.WithPolicy(dev, c.Discard, c.DetectZeroes), format, qimg, nil
}

// openOverlay makes a qcow2 overlay in os.TempDir whose backing file is
// the image (qemu-nbd -s), opens it, and unlinks it at once: the open
// file is all that is left of it, so it is gone when the device is
// closed, even if the process is killed. The image is opened read-only
// as the overlay's backing file.
func openOverlay(file, format string, o qcow2.Options, readOnly bool) (block.Device, error) {
	abs, err := filepath.Abs(file)
	if err != nil {
		return nil, err
	}
	if _, err := os.Stat(abs); err != nil {
		return nil, err
	}
	if o.Untrusted {
		// The overlay is ours and lives elsewhere; the image's own
		// references are what must stay in its folder.
		chk := o
		chk.ReadOnly = true
		d, err := image.Open(abs, format, chk)
		if err != nil {
			return nil, err
		}
		d.Close()
		o.Untrusted = false
	}
	tmp, err := os.CreateTemp("", "ovis-nbd-snapshot-*.qcow2")
	if err != nil {
		return nil, fmt.Errorf("Could not create temporary overlay: %w", err)
	}
	path := tmp.Name()
	tmp.Close()
	defer os.Remove(path)
	if err := qcow2.Create(path, qcow2.CreateOptions{BackingFile: abs, BackingFormat: format}); err != nil {
		return nil, fmt.Errorf("Could not create temporary overlay: %w", err)
	}
	o.ReadOnly = readOnly
	return image.Open(path, "qcow2", o)
}

// openError is qemu-nbd's message for an image it cannot open, keeping
// the cause for errors.Is.
func openError(path string, err error) error {
	return openErrorAs(path, path, err)
}

// openErrorAs is openError for an image named display (its option list,
// under --image-opts).
func openErrorAs(display, path string, err error) error {
	reason := openReason(err)
	if le := (*block.LockError)(nil); errors.As(err, &le) && le.Path != path {
		// A backing file another process holds (QEMU names each layer
		// above it; ovis one).
		reason = "Could not open backing file: " + reason
	}
	return &msgError{msg: fmt.Sprintf("Failed to blk_new_open '%s': %s", display, reason), err: err}
}

// openReason says why an image could not be opened in QEMU's words where
// the cause is one QEMU names.
func openReason(err error) string {
	var (
		pe *fs.PathError
		fe *qcow2.FormatError
		le *block.LockError
	)
	switch {
	case errors.As(err, &le):
		return le.Error()
	case errors.As(err, &fe):
		return "Image is not in qcow2 format"
	case errors.As(err, &pe):
		return fmt.Sprintf("Could not open '%s': %s", pe.Path, strerror(pe.Err))
	}
	return err.Error()
}

// strerror renders an errno as C's strerror does, capitalized ("No such
// file or directory"); other errors keep their text.
func strerror(err error) string {
	var errno syscall.Errno
	if errors.As(err, &errno) {
		if s := errno.Error(); s != "" {
			return strings.ToUpper(s[:1]) + s[1:]
		}
	}
	return err.Error()
}

// msgError carries QEMU's wording for a failure and unwraps to the cause.
type msgError struct {
	msg string
	err error
}

func (e *msgError) Error() string { return e.msg }
func (e *msgError) Unwrap() error { return e.err }

// loadSnapshot makes dev read as the internal snapshot c.LoadSnapshot
// names, with qemu-nbd's messages. Under -s, dev is the temporary
// overlay, which has no snapshots, as in qemu-nbd.
func loadSnapshot(dev block.Device, c *Config) error {
	p, err := img.ParseSnapshotParam(c.LoadSnapshot)
	if err != nil {
		return err
	}
	if _, ok := block.As[*qcow2.Image](dev); ok && c.Snapshot {
		// The overlay is a new image: no snapshot is in it.
		return errors.New("Failed to load snapshot: Can't find snapshot")
	}
	return img.LoadSnapshot(dev, p)
}
