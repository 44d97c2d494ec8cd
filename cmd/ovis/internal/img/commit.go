package img

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"os"

	"github.com/ovis-storage/ovis/block"
	"github.com/ovis-storage/ovis/convert"
	"github.com/ovis-storage/ovis/image"
	"github.com/ovis-storage/ovis/qcow2"
)

// CommitConfig is what `ovis img commit` was given, as qemu-img commit's
// arguments: commit [-f FMT] [-b BASE] [-d] [-p] [-q] FILENAME.
type CommitConfig struct {
	// Filename is the image whose changes are committed.
	Filename string
	// Format is "qcow2", "raw" or "" to probe.
	Format string
	// Base (-b) names the image of the backing chain that receives the
	// changes (as a backing file name is resolved); "" is the image's own
	// backing file. A base implies Drop.
	Base string
	// Drop (-d) leaves the image as it is; otherwise it is emptied once
	// its data is in the base.
	Drop bool
	// Progress (-p) prints QEMU's progress figure on stdout; Quiet (-q)
	// prints nothing on stdout.
	Progress, Quiet bool
	// RateLimit (-r) caps the bytes committed per second ("" or "0": no
	// cap), as the speed of QEMU's commit job.
	RateLimit string
}

// Commit writes what an image holds above its base into the base, as
// qemu-img commit does: every range that the image (or, with a base
// further down, any image above the base) allocates is copied, zeros as
// zero writes, and a base smaller than the image grows to its size. Then
// the image is emptied, unless Drop or Base is given, and "Image
// committed." is printed.
func (e *Env) Commit(ctx context.Context, cfg CommitConfig) error {
	stdout, stderr := e.stdout(), e.stderr()
	if cfg.Quiet {
		cfg.Progress = false
	}
	if cfg.Base != "" {
		cfg.Drop = true
	}
	var rate int64
	if cfg.RateLimit != "" {
		var err error
		if rate, err = cvtnum("rate limit", cfg.RateLimit, math.MaxInt64); err != nil {
			return err
		}
	}
	// Read-write, as QEMU opens it: no other process may use the image
	// while its data moves down the chain and it is emptied.
	dev, err := e.openWritable(ctx, cfg.Filename, cfg.Format, qcow2.Options{}, stderr)
	if err != nil {
		return err
	}
	prog := newQemuProgress(cfg.Progress, stdout, 1)
	prog.print(0, 100)
	err = e.commit(ctx, dev, cfg, prog, convert.NewRateLimiter(rate))
	if cerr := dev.Close(); err == nil && cerr != nil {
		err = cerr
	}
	prog.end()
	if err != nil {
		return err
	}
	if !cfg.Quiet {
		io.WriteString(stdout, "Image committed.\n")
	}
	return nil
}

// commit commits dev into its base and, unless cfg.Drop, empties dev.
func (e *Env) commit(ctx context.Context, dev block.Device, cfg CommitConfig, prog *qemuProgress, rate *convert.RateLimiter) error {
	chain := chainOf(cfg.Filename, cfg.Format, dev)
	base := 1
	if cfg.Base != "" {
		if base = findBacking(chain, cfg.Base); base < 0 {
			return fmt.Errorf("Did not find '%s' in the backing chain of '%s'", cfg.Base, cfg.Filename)
		}
	} else if len(chain) < 2 {
		return errors.New("Image does not have a backing file")
	}
	img, _ := block.As[*qcow2.Image](dev) // only qcow2 images have backing files
	_, raw := block.As[*block.Raw](chain[base].dev)
	growRaw := raw && chain[base].dev.Size() < img.Size()
	target, err := e.reopenBase(chain[base], growRaw)
	if err != nil {
		return err
	}
	if growRaw {
		// A raw base grows as QEMU's file driver grows it: by truncation,
		// under the write and resize locks just taken.
		if err := os.Truncate(chain[base].path, img.Size()); err != nil {
			target.Close()
			return fmt.Errorf("Could not resize the base image: %s", strerror(err))
		}
		// Open it again for its new size; the first holder keeps the
		// locks meanwhile.
		grown, err := e.reopenBase(chain[base], true)
		target.Close()
		if err != nil {
			return err
		}
		target = grown
	}
	err = commitInto(ctx, img, target, base, prog, rate)
	if err == nil {
		// The data must be durable below before the image lets go of it.
		err = target.Flush(ctx)
	}
	if cerr := target.Close(); err == nil && cerr != nil {
		err = cerr
	}
	if err != nil || cfg.Drop {
		return err
	}
	// The engine rebuilds the file afresh or, with snapshots, bitmaps, a
	// data file or v2, drops every cluster in place, as QEMU does.
	if err := img.MakeEmpty(ctx); err != nil {
		return fmt.Errorf("%s: emptying the image: %w", cfg.Filename, err)
	}
	return nil
}

// reopenBase opens the base of a commit for writing: a reopen of the
// layer the chain has open read-only, so it is not checked against the
// chain's own locks, only against other processes. A lock conflict is
// reported in QEMU's words alone; resize is for a raw base to grow, which
// takes the resize permission as QEMU's commit job does.
func (e *Env) reopenBase(l layer, resize bool) (block.Device, error) {
	dev, err := image.Open(l.path, l.format, e.trust(l.path, qcow2.Options{Reopen: true, Resize: resize}))
	if err != nil {
		if le := (*block.LockError)(nil); errors.As(err, &le) {
			return nil, le
		}
		return nil, fmt.Errorf("Could not reopen '%s' for writing: %s", l.path, openReason(err))
	}
	return dev, nil
}

// copyChunk is the largest read or write commit makes, as convert's.
const copyChunk = 2 << 20

// commitInto copies the ranges of top decided above chain layer base into
// target, the writable base. It stops once ctx is done, returning ctx's
// error. rate paces the copy, by the bytes of the ranges copied.
func commitInto(ctx context.Context, top *qcow2.Image, target block.Device, base int, prog *qemuProgress, rate *convert.RateLimiter) error {
	size := top.Size()
	if old := target.Size(); old < size {
		// Growing a base over a longer backing file of its own zeroes
		// the new range (the engine's ResizeContext does, as QEMU's
		// truncate), which needs zero flags past the cluster holding
		// the old end; version 2 has none, and QEMU's commit job fails.
		if t, ok := block.As[*qcow2.Image](target); ok && t.Backing() != nil && t.Backing().Size() > old {
			if h := t.Header(); h.Version < 3 && (old+h.ClusterSize()-1)/h.ClusterSize()*h.ClusterSize() < size {
				return errors.New("Block job failed: Operation not supported")
			}
		}
		if err := growDevice(ctx, target, size); err != nil {
			return err
		}
	}
	buf := make([]byte, copyChunk)
	for off := int64(0); off < size; {
		if err := ctx.Err(); err != nil {
			return err // the caller's Close flushes what was copied
		}
		m, err := top.MapAt(ctx, off, size-off)
		if err != nil {
			return fmt.Errorf("error while reading block status at offset %d: %s", off, strerror(err))
		}
		n := m.Length
		// A range no layer allocates is decided (as zeros) at the layer
		// whose backing file ends before it: QEMU's block status counts
		// it as allocated in that shorter backing file, so it is
		// committed when that file is above the base.
		if m.Depth < base && (m.Present || m.Depth+1 < base) {
			if err := copyRange(ctx, top, target, off, n, m.Zero, buf, rate); err != nil {
				return err
			}
		}
		off += n
		prog.print(float32(n)/float32(size)*100, 100)
	}
	return target.Flush(ctx)
}

// jobError is how qemu-img commit reports an I/O error of its block job:
// "Block job failed: " and the errno's text. It keeps the cause for
// errors.As (a qcow2 corruption event is reported before it).
type jobError struct{ err error }

func (e jobError) Error() string { return "Block job failed: " + strerror(e.err) }
func (e jobError) Unwrap() error { return e.err }

// copyRange copies [off, off+n) of src to dst, or zeroes it there. It
// stops between chunks once ctx is done.
func copyRange(ctx context.Context, src, dst block.Device, off, n int64, zero bool, buf []byte, rate *convert.RateLimiter) error {
	if zero {
		if err := rate.Wait(ctx, n); err != nil {
			return err
		}
		if err := dst.WriteZeroes(ctx, off, n, 0); err != nil {
			return jobError{err}
		}
		return nil
	}
	for end := off + n; off < end; {
		if err := ctx.Err(); err != nil {
			return err
		}
		k := min(int64(len(buf)), end-off)
		if err := rate.Wait(ctx, k); err != nil {
			return err
		}
		if _, err := src.ReadAt(ctx, buf[:k], off); err != nil {
			return jobError{err}
		}
		if _, err := dst.WriteAt(ctx, buf[:k], off, 0); err != nil {
			return jobError{err}
		}
		off += k
	}
	return nil
}

// growDevice grows an open image to size bytes.
func growDevice(ctx context.Context, d block.Device, size int64) error {
	switch d := d.(type) {
	case *qcow2.Image:
		if err := d.Resize(ctx, (size+511)&^511, false, qcow2.PreallocOff); err != nil {
			return fmt.Errorf("Could not resize the base image: %s", strerror(err))
		}
		return nil
	}
	return fmt.Errorf("Could not resize the base image: %w", errors.ErrUnsupported)
}
