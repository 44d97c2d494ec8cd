package img

import (
	"context"
	"errors"
	"fmt"
	"io"

	"github.com/ovis-storage/ovis/block"
	"github.com/ovis-storage/ovis/qcow2"
)

// RebaseConfig is what `ovis img rebase` was given, as qemu-img rebase's
// arguments: rebase [-f FMT] [-F BACKING_FMT] [-u] [-p] [-q] -b
// BACKING_FILE FILENAME.
type RebaseConfig struct {
	// Filename is the image whose backing file changes.
	Filename string
	// Format is "qcow2", "raw" or "" to probe.
	Format string
	// Backing (-b) is the new backing file name as stored in the header,
	// relative to the image's folder; "" removes the backing file.
	// HasBacking tells -b "" from no -b.
	Backing    string
	HasBacking bool
	// BackingFormat (-F) is the new backing file's format.
	BackingFormat string
	// Unsafe (-u) only rewrites the header: the new backing file must
	// hold what the old one did.
	Unsafe bool
	// Progress (-p) prints QEMU's progress figure on stdout; Quiet (-q)
	// turns it off.
	Progress, Quiet bool
	// ForceShare (-U) opens the new backing file even while another
	// process writes it. The image's own chain is opened as always.
	ForceShare bool
}

// Rebase changes an image's backing file as qemu-img rebase does. In safe
// mode, every range the image does not allocate itself and that reads
// differently through the old and the new backing chain is first copied
// into the image from the old chain (zeros as zero writes), so that the
// image reads the same afterwards; when the new backing file is in the
// old chain, only the ranges allocated above it are compared. Then the
// header names the new backing file.
func (e *Env) Rebase(ctx context.Context, cfg RebaseConfig) error {
	stdout, stderr := e.stdout(), e.stderr()
	if cfg.Quiet {
		cfg.Progress = false
	}
	if !cfg.Unsafe && !cfg.HasBacking {
		return UsageError("Must specify backing file (-b) or use unsafe mode (-u)")
	}
	prog := newQemuProgress(cfg.Progress, stdout, 2)
	defer prog.end()
	prog.print(0, 100)
	dev, err := e.openWritable(ctx, cfg.Filename, cfg.Format, qcow2.Options{NoBacking: cfg.Unsafe}, stderr)
	if err != nil {
		return err
	}
	if cfg.BackingFormat != "" {
		if _, ok := formatOpts(cfg.BackingFormat); !ok {
			dev.Close()
			return fmt.Errorf("Invalid format name: '%s'", cfg.BackingFormat)
		}
	}
	if !cfg.Unsafe {
		err = e.rebaseCopy(ctx, dev, cfg, prog)
	}
	if err == nil {
		// While the image is still open, and so locked: no other
		// process can open it between the copy and the header change.
		err = changeBacking(ctx, dev, cfg)
	}
	if cerr := dev.Close(); err == nil && cerr != nil {
		err = cerr
	}
	if err != nil {
		return err
	}
	prog.print(100, 0)
	return nil
}

// changeBacking names the new backing file in the header of the open
// image, once what rebaseCopy wrote is durable.
func changeBacking(ctx context.Context, dev block.Device, cfg RebaseConfig) error {
	name := cfg.Backing
	img, ok := block.As[*qcow2.Image](dev)
	if !ok {
		return fmt.Errorf("Could not change the backing file to '%s': Operation not supported", name)
	}
	if name != "" && cfg.BackingFormat == "" {
		return fmt.Errorf("Could not change the backing file to '%s': backing format must be specified", name)
	}
	format := cfg.BackingFormat
	if name == "" {
		format = ""
	}
	if err := img.Flush(ctx); err != nil {
		return err
	}
	if err := setBackingOpen(ctx, img, name, format); err != nil {
		if errors.Is(err, errNoHeaderRoom) {
			return fmt.Errorf("Could not change the backing file to '%s': No space left in the file header", name)
		}
		return fmt.Errorf("Could not change the backing file to '%s': %s", name, strerror(err))
	}
	return nil
}

// errNoHeaderRoom is QEMU's ENOSPC: the backing file name and the header
// extensions do not fit in the first cluster.
var errNoHeaderRoom = errors.New("No space left in the file header")

// setBackingOpen is the engine's SetBacking, with qemu-img rebase's
// refusals.
func setBackingOpen(ctx context.Context, img *qcow2.Image, name, format string) error {
	if name != "" && len(name) > 1023 {
		return fmt.Errorf("backing file name of %d bytes: %w", len(name), errors.ErrUnsupported)
	}
	h := img.Header()
	if name != "" && h.DataFileRaw() {
		return errors.New("Invalid argument")
	}
	h.BackingFile, h.BackingFormat = name, format
	if _, err := h.Encode(); err != nil {
		return errNoHeaderRoom
	}
	return img.SetBacking(ctx, name, format)
}

// rebaseCopy is the safe part of rebase: it copies into dev what would
// change with the new backing file. It stops once ctx is done, before the
// backing file is changed (Close flushes what was copied).
func (e *Env) rebaseCopy(ctx context.Context, dev block.Device, cfg RebaseConfig, prog *qemuProgress) error {
	img, _ := block.As[*qcow2.Image](dev)
	chain := chainOf(cfg.Filename, cfg.Format, dev)
	var oldBacking, newBacking block.Device
	if len(chain) > 1 {
		oldBacking = chain[1].dev
	}
	prefix := -1 // index in chain of the new backing file, if it is there
	if cfg.Backing != "" {
		real := combinePath(cfg.Filename, cfg.Backing)
		if prefix = findBacking(chain, real); prefix >= 0 {
			newBacking = chain[prefix].dev
		} else {
			nb, err := e.openImage(real, cfg.BackingFormat, qcow2.Options{ReadOnly: true, ForceShare: cfg.ForceShare})
			if err != nil {
				return fmt.Errorf("Could not open new backing file '%s': %s", cfg.Backing, unwrapOpen(err, real))
			}
			defer nb.Close()
			newBacking = nb
		}
	}
	if img == nil {
		return nil // raw: nothing is unallocated; the header change fails
	}
	size := dev.Size()
	oldSize, newSize := sectorSize(oldBacking), sectorSize(newBacking)
	bufOld, bufNew := make([]byte, compareBuf), make([]byte, compareBuf)
	var step float32
	if size != 0 {
		step = 100 / float32(size/min(size, compareBuf))
	}
	for off := int64(0); off < size; {
		if err := ctx.Err(); err != nil {
			return err
		}
		n := min(compareBuf, size-off)
		e, err := block.FirstExtent(ctx, img, off, n)
		if err != nil {
			return fmt.Errorf("error while reading image metadata: %s", strerror(err))
		}
		n = e.Length
		if e.Depth == 1 {
			off += n
			continue
		}
		if prefix >= 0 {
			m, err := img.MapAt(ctx, off, n)
			if err != nil {
				return fmt.Errorf("error while reading image metadata: %s", strerror(err))
			}
			n = m.Length
			// Decided at the new backing file or below, the range reads
			// the same through both chains. Decided above it, it may be
			// past the end of a shorter layer, which reads zeros that the
			// new backing file need not (QEMU's fix for rebasing past the
			// old backing file's end).
			if m.Depth >= prefix {
				off += n
				continue
			}
		}
		oldZero := off >= oldSize
		if !oldZero {
			n = min(n, oldSize-off)
			if err := readPadded(ctx, oldBacking, bufOld[:n], off); err != nil {
				return errors.New("error while reading from old backing file")
			}
		} else {
			clear(bufOld[:n])
		}
		if newBacking == nil || off >= newSize {
			clear(bufNew[:n])
		} else {
			n = min(n, newSize-off)
			if err := readPadded(ctx, newBacking, bufNew[:n], off); err != nil {
				return errors.New("error while reading from new backing file")
			}
		}
		for done := int64(0); done < n; {
			differ, run := sameRun(bufOld[done:n], bufNew[done:n])
			if differ {
				var err error
				if oldZero {
					err = zeroLikeQemu(ctx, img, off+done, run)
				} else {
					_, err = img.WriteAt(ctx, bufOld[done:done+run], off+done, 0)
				}
				if err != nil {
					return fmt.Errorf("Error while writing to COW image: %s", strerror(err))
				}
			}
			done += run
		}
		prog.print(step, 100)
		off += n
	}
	return nil
}

// zeroLikeQemu makes [off, off+n) of img read as zeros as QEMU's qcow2
// driver does: whole (sub)clusters get the zero flag; a (sub)cluster
// covered only in part gets it whole too when the rest of it reads zeros
// already and it holds no data of its own, and is otherwise written with
// zeros there.
func zeroLikeQemu(ctx context.Context, img *qcow2.Image, off, n int64) error {
	h := img.Header()
	sub := h.ClusterSize()
	if h.ExtendedL2() {
		sub /= 32
	}
	size, end := img.Size(), off+n
	if h.Version < 3 {
		// No zero flag: zeros are written out.
		return img.WriteZeroes(ctx, off, n, block.NoUnmap)
	}
	for pos := off; pos < end; {
		s0 := pos &^ (sub - 1)
		s1 := min(s0+sub, size) // the (sub)cluster's end; the image's end counts as aligned
		if pos == s0 && end >= s1 {
			// Aligned: every whole (sub)cluster up to the last one.
			last := end &^ (sub - 1)
			if end == size {
				last = end
			}
			if err := img.WriteZeroes(ctx, pos, last-pos, block.NoUnmap); err != nil {
				return err
			}
			pos = last
			continue
		}
		fe := min(end, s1)
		widen, err := zeroRest(ctx, img, s0, pos, fe, s1)
		if err != nil {
			return err
		}
		if widen {
			err = img.WriteZeroes(ctx, s0, s1-s0, block.NoUnmap)
		} else {
			err = img.WriteZeroes(ctx, pos, fe-pos, block.NoUnmap)
		}
		if err != nil {
			return err
		}
		pos = fe
	}
	return nil
}

// zeroRest reports whether the (sub)cluster [s0, s1) of img holds no data
// of its own and reads zeros outside [pos, fe): QEMU's condition for
// giving it the zero flag whole.
func zeroRest(ctx context.Context, img *qcow2.Image, s0, pos, fe, s1 int64) (bool, error) {
	m, err := img.MapAt(ctx, s0, s1-s0)
	if err != nil {
		return false, err
	}
	if m.Present && m.Depth == 0 && m.Data {
		return false, nil
	}
	for _, r := range [][2]int64{{s0, pos}, {fe, s1}} {
		for o := r[0]; o < r[1]; {
			m, err := img.MapAt(ctx, o, r[1]-o)
			if err != nil {
				return false, err
			}
			if !m.Zero {
				return false, nil
			}
			o += m.Length
		}
	}
	return true, nil
}

// sameRun is QEMU's compare_buffers: whether the first sector of p1 and
// p2 differ, and how many bytes from the start, in whole sectors, share
// that answer.
func sameRun(p1, p2 []byte) (differ bool, n int64) {
	i := min(len(p1), 512)
	differ = string(p1[:i]) != string(p2[:i])
	for i < len(p1) {
		j := min(len(p1), i+512)
		if (string(p1[i:j]) != string(p2[i:j])) != differ {
			break
		}
		i = j
	}
	return differ, int64(i)
}

// sectorSize is a device's size in whole sectors, as QEMU sees it; 0 for
// none.
func sectorSize(d block.Device) int64 {
	if d == nil {
		return 0
	}
	return (d.Size() + 511) &^ 511
}

// readPadded reads p at off, the part past the end of a raw file's partial
// last sector as zeros.
func readPadded(ctx context.Context, d block.Device, p []byte, off int64) error {
	have := max(0, min(int64(len(p)), d.Size()-off))
	if have > 0 {
		if _, err := d.ReadAt(ctx, p[:have], off); err != nil && err != io.EOF {
			return err
		}
	}
	clear(p[have:])
	return nil
}

// unwrapOpen strips openImage's "Could not open 'name': " from err, which
// callers that name the file themselves put their own words before.
func unwrapOpen(err error, name string) string {
	prefix := fmt.Sprintf("Could not open '%s': ", name)
	s := err.Error()
	if len(s) > len(prefix) && s[:len(prefix)] == prefix {
		return s[len(prefix):]
	}
	return s
}
