package img

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"

	"golang.org/x/sys/unix"

	"github.com/ovis-storage/ovis/block"
	"github.com/ovis-storage/ovis/qcow2"
)

// ResizeConfig is what `ovis img resize` was given, as qemu-img resize's
// arguments: resize [-f FMT] [--preallocation=PREALLOC] [--shrink] [-q]
// FILENAME [+ | -]SIZE.
type ResizeConfig struct {
	// Filename is the image to resize.
	Filename string
	// Format is "qcow2", "raw" or "" to probe.
	Format string
	// Size is the SIZE argument as typed: a size, or a change of size
	// with a leading + or -.
	Size string
	// Preallocation applies to the added range: off (the default, ""),
	// metadata (qcow2), falloc or full.
	Preallocation string
	// Shrink allows a smaller size; the data past the new end is lost.
	Shrink bool
	// Quiet (-q) leaves out "Image resized.".
	Quiet bool
}

// Resize changes an image's virtual size as qemu-img resize does: qcow2
// images through the engine, raw files by truncation, with qemu-img's
// checks and messages, and prints "Image resized.".
func (e *Env) Resize(ctx context.Context, cfg ResizeConfig) error {
	stdout, stderr := e.stdout(), e.stderr()
	prealloc := cfg.Preallocation
	switch prealloc {
	case "":
		prealloc = qcow2.PreallocOff
	case qcow2.PreallocOff, qcow2.PreallocMetadata, qcow2.PreallocFalloc, qcow2.PreallocFull:
	default:
		return fmt.Errorf("Invalid preallocation mode '%s'", prealloc)
	}
	size, relative := cfg.Size, 0
	if size != "" && (size[0] == '+' || size[0] == '-') {
		relative = map[byte]int{'+': 1, '-': -1}[size[0]]
		size = size[1:]
	}
	n, err := ParseSize(size)
	switch {
	case errors.Is(err, errSizeRange):
		return fmt.Errorf("Value '%s' is out of range for parameter 'size'", size)
	case err != nil:
		return errors.New("Parameter 'size' expects a non-negative number below 2^64\n" +
			"Optional suffix k, M, G, T, P or E means kilo-, mega-, giga-, tera-, peta-\n" +
			"and exabytes, respectively.")
	}
	dev, err := e.openWritable(ctx, cfg.Filename, cfg.Format, qcow2.Options{Resize: true}, stderr)
	if err != nil {
		return err
	}
	current := (dev.Size() + 511) &^ 511
	total := int64(n) // QEMU's int64 arithmetic, wrapping as it does
	if relative != 0 {
		total = current + int64(n)*int64(relative)
	}
	err = resizeDevice(ctx, dev, cfg, current, total, prealloc)
	if _, raw := block.As[*block.Raw](dev); raw && err == nil {
		// Through a descriptor of its own, while dev holds the image's
		// locks.
		err = truncateRaw(ctx, cfg.Filename, total, prealloc)
	}
	if cerr := dev.Close(); err == nil && cerr != nil {
		err = cerr
	}
	if err != nil {
		return err
	}
	if !cfg.Quiet {
		io.WriteString(stdout, "Image resized.\n")
	}
	return nil
}

func resizeDevice(ctx context.Context, dev block.Device, cfg ResizeConfig, current, total int64, prealloc string) error {
	switch {
	case total <= 0:
		return errors.New("New image size must be positive")
	case total <= current && prealloc != qcow2.PreallocOff:
		return errors.New("Preallocation can only be used for growing images")
	case total < current && !cfg.Shrink:
		return errors.Join(errors.New("Use the --shrink option to perform a shrink operation."),
			errors.New("warning: Shrinking an image will delete all data beyond the shrunken image's end. "+
				"Before performing such an operation, make sure there is no important data there."))
	}
	switch d := dev.(type) {
	case *qcow2.Image:
		if total%512 != 0 {
			return errors.New("The new size must be a multiple of 512")
		}
		if err := d.Resize(ctx, total, cfg.Shrink, prealloc); err != nil {
			if ctx.Err() != nil {
				return err
			}
			return errors.New(resizeReason(err))
		}
		return nil
	case *block.Raw:
		return nil // truncated by truncateRaw
	}
	return fmt.Errorf("Image format does not support resizing")
}

// resizeReason is the engine's refusal in QEMU's words where QEMU has
// them.
func resizeReason(err error) string {
	return strerror(err)
}

// truncateRaw resizes a raw file to size bytes, as QEMU's file driver
// does: the new range is a hole, reserved (falloc) or written with zeros
// (full). Zero-filling stops once ctx is done; the file is still
// truncated to size, the rest reading as zeros anyway.
func truncateRaw(ctx context.Context, path string, size int64, prealloc string) error {
	if prealloc == qcow2.PreallocMetadata {
		return fmt.Errorf("Unsupported preallocation mode: %s", prealloc)
	}
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		return fmt.Errorf("Could not open '%s': %s", path, strerror(err))
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return err
	}
	from := st.Size()
	switch prealloc {
	case qcow2.PreallocFalloc:
		if err := unix.Fallocate(int(f.Fd()), 0, from, size-from); err != nil {
			return fmt.Errorf("Could not preallocate new data: %s", strerror(err))
		}
	case qcow2.PreallocFull:
		if err := f.Truncate(size); err != nil {
			return fmt.Errorf("Failed to resize file: %s", strerror(err))
		}
		buf := make([]byte, 1<<20)
		for off := from; off < size && ctx.Err() == nil; off += int64(len(buf)) {
			if _, err := f.WriteAt(buf[:min(int64(len(buf)), size-off)], off); err != nil {
				return fmt.Errorf("Could not write zeros for preallocation: %s", strerror(err))
			}
		}
	}
	if err := f.Truncate(size); err != nil {
		return fmt.Errorf("Failed to resize file: %s", strerror(err))
	}
	if err := f.Sync(); err != nil {
		return err
	}
	return ctx.Err()
}
