package img

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"

	"github.com/ovis-storage/ovis/block"
	"github.com/ovis-storage/ovis/image"
	"github.com/ovis-storage/ovis/qcow2"
)

// openImage opens filename as format ("" probes) with its backing chain,
// as qemu-img's img_open does, and returns qemu-img's message when it
// cannot: "Could not open 'top': Could not open backing file: Could not
// open 'base': No such file or directory" names the layer that failed.
func (e *Env) openImage(filename, format string, o qcow2.Options) (block.Device, error) {
	if err := e.requireFormat(filename, format); err != nil {
		return nil, err
	}
	if format != "" {
		if _, ok := formatOpts(format); !ok {
			return nil, fmt.Errorf("Could not open '%s': Unknown driver '%s'", filename, format)
		}
	}
	return e.openTrusted(filename, format, o, e.trust(filename, o))
}

// openTrusted is openImage with the options trust made of o.
func (e *Env) openTrusted(filename, format string, o, t qcow2.Options) (block.Device, error) {
	if t.ForceShare && !t.ReadOnly {
		return nil, fmt.Errorf("Could not open '%s': force-share=on can only be used with read-only images", e.displayName(filename))
	}
	dev, err := image.Open(filename, format, t)
	if err == nil {
		return dev, nil
	}
	if o.NoBacking {
		return nil, e.openError(filename, err)
	}
	var writer os.FileInfo
	if !t.ReadOnly {
		writer, _ = os.Stat(filename)
	}
	return nil, wrapMsg(err, "Could not open '%s': %s", e.displayName(filename), e.chainReasonAbove(filename, format, err, 0, writer))
}

// chainReason says why the chain at filename failed to open with err:
// the reason of the first layer that does not open on its own, behind one
// "Could not open backing file: " per layer above it.
func (e *Env) chainReason(filename, format string, err error, depth int) string {
	return e.chainReasonAbove(filename, format, err, depth, nil)
}

// chainReasonAbove is chainReason for a chain whose top, the file writer
// (nil: none), is open read-write: a chain that comes back to it fails
// there as in QEMU, where the backing node's read-only open refuses to
// share the writes the top holds.
func (e *Env) chainReasonAbove(filename, format string, err error, depth int, writer os.FileInfo) string {
	// This layer opens read-only on its own, but another process holds
	// it against the open that failed.
	if le := (*block.LockError)(nil); depth > 16 || errors.As(err, &le) && le.Path == filename {
		return openReason(err)
	}
	dev, err1 := image.Open(filename, format, e.trust(filename, qcow2.Options{ReadOnly: true, NoBacking: true}))
	if err1 != nil {
		return openReason(err1)
	}
	img, ok := block.As[*qcow2.Image](dev)
	if !ok {
		dev.Close()
		return openReason(err)
	}
	h := img.Header()
	next := img.BackingPath()
	dev.Close()
	// An untrusted backing file without a recorded format is not probed,
	// not even to find the layer that failed.
	if next == "" || e.Untrusted && h.BackingFormat == "" {
		return openReason(err)
	}
	if fi, err := os.Stat(next); err == nil && writer != nil && os.SameFile(fi, writer) {
		return "Could not open backing file: " + (&block.LockError{Path: next, Perm: block.PermWrite, Shared: true}).Error()
	}
	return "Could not open backing file: " + e.chainReasonAbove(next, h.BackingFormat, err, depth+1, writer)
}

// writerOpenError is openError for an image opened read-write whose
// backing chain comes back to it: QEMU fails on the lock the image holds,
// naming the layers on the way, where ovis finds the loop.
func (e *Env) writerOpenError(filename, format string, err error) error {
	writer, serr := os.Stat(filename)
	if serr != nil || errors.As(err, new(*block.LockError)) {
		return e.openError(filename, err)
	}
	if r := e.chainReasonAbove(filename, format, err, 0, writer); strings.HasSuffix(r, "?") {
		return wrapMsg(err, "Could not open '%s': %s", e.displayName(filename), r)
	}
	return e.openError(filename, err)
}

// sourceCache parses a -T argument ("" is writeback) into how to open
// the image's files, with qemu-img's message.
func sourceCache(mode string) (func(string, bool) (block.File, error), error) {
	if mode == "" {
		return nil, nil
	}
	m, err := block.ParseCacheMode(mode)
	if err != nil {
		return nil, fmt.Errorf("Invalid source cache option: %s", mode)
	}
	return block.OpenFileFor(m), nil
}

// openWritable is openImage for an image to write, with QEMU's warning on
// warn when a probed format turns out raw. A dirty qcow2 image (lazy
// refcounts) is repaired, its messages on warn, as qcow2_open does on every
// read-write open but one for check.
func (e *Env) openWritable(ctx context.Context, filename, format string, o qcow2.Options, warn io.Writer) (block.Device, error) {
	dev, err := e.openImage(filename, format, o)
	if err != nil || o.ReadOnly {
		return dev, err
	}
	if format == "" {
		if _, raw := block.As[*block.Raw](dev); raw {
			rawProbeWarning(warn, filename)
		}
	}
	if !o.ForCheck {
		if err := repairDirty(ctx, dev, filename, warn); err != nil {
			dev.Close()
			return nil, err
		}
	}
	return dev, nil
}

// rawProbeWarning is QEMU's warning for a raw image opened for writing
// without -f.
func rawProbeWarning(warn io.Writer, filename string) {
	fmt.Fprintf(warn, "WARNING: Image format was not specified for '%s' and probing guessed raw.\n"+
		"         Automatically detecting the format is dangerous for raw images, write operations on block 0 will be restricted.\n"+
		"         Specify the 'raw' format explicitly to remove the restrictions.\n", filename)
}

// outputFormat checks --output as qemu-img does.
func outputFormat(s string) (json bool, err error) {
	switch s {
	case "", "human":
		return false, nil
	case "json":
		return true, nil
	}
	return false, fmt.Errorf("--output must be used with human or json as argument.")
}

// lines splits messages into lines ending in "\n".
func lines(msgs []string) string {
	var b strings.Builder
	for _, m := range msgs {
		b.WriteString(m)
		b.WriteByte('\n')
	}
	return b.String()
}
