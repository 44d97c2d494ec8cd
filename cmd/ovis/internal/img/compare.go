package img

import (
	"bytes"
	"context"
	"fmt"
	"io"

	"github.com/ovis-storage/ovis/block"
	"github.com/ovis-storage/ovis/qcow2"
)

// CompareConfig is what `ovis img compare` was given, as qemu-img
// compare's arguments: compare [-f FMT] [-F FMT] [-p] [-q] [-s] [-U]
// FILENAME1 FILENAME2.
type CompareConfig struct {
	// Filename1 and Filename2 are the images to compare.
	Filename1, Filename2 string
	// Format1 (-f) and Format2 (-F) are "qcow2", "raw" or "" to probe.
	Format1, Format2 string
	// Strict (-s) fails on different sizes and on any difference in
	// allocation, not only in content.
	Strict bool
	// Progress (-p) prints QEMU's progress figure on stdout; Quiet (-q)
	// prints nothing on stdout.
	Progress, Quiet bool
	// Cache (-T) is both images' cache mode; "" is writeback.
	Cache string
}

// Exit codes of qemu-img compare.
const (
	compareDifferent  = 1
	compareOpenFailed = 2
	compareStatFailed = 3
	compareReadFailed = 4
)

// compareBuf is qemu-img's IO_BUF_SIZE, the most it reads at once.
const compareBuf = 2 << 20

// Status bits of bdrv_block_status_above that strict mode compares.
const (
	statusData        = 0x01
	statusZero        = 0x02
	statusOffsetValid = 0x04
	statusAllocated   = 0x10
	statusEOF         = 0x20
)

// compareSide is one of the two images.
type compareSide struct {
	name string
	dev  block.Device
	m    block.Mapper
	size int64
}

// status returns the run at off as bdrv_block_status_above reports it:
// its flags and its length.
func (s *compareSide) status(ctx context.Context, off, n int64) (int, int64, error) {
	e, err := s.m.MapAt(ctx, off, n)
	if err != nil {
		return 0, 0, err
	}
	st := 0
	if e.Data {
		st |= statusData
	}
	if e.Zero {
		st |= statusZero
	}
	if e.Offset >= 0 {
		st |= statusOffsetValid
	}
	if e.Present {
		st |= statusAllocated
	}
	if off+e.Length == s.size {
		st |= statusEOF
	}
	return st, e.Length, nil
}

// read reads [off, off+len(p)) with the partial last sector of a raw file
// reading as zeros.
func (s *compareSide) read(ctx context.Context, p []byte, off int64) error {
	have := max(0, min(int64(len(p)), s.dev.Size()-off))
	if have > 0 {
		if _, err := s.dev.ReadAt(ctx, p[:have], off); err != nil && err != io.EOF {
			return exitWith(compareReadFailed, fmt.Errorf("Error while reading offset %d of %s: %s", off, s.name, strerror(err)))
		}
	}
	clear(p[have:])
	return nil
}

// Compare compares two images' content as qemu-img compare does and
// returns nil when they are identical, or an *ExitError with qemu-img's
// code: 1 when they differ (after printing "Content mismatch at offset
// N!" with N the first differing sector), 2 when one cannot be opened, 3
// when its allocation cannot be read, 4 when its data cannot be read.
// Without Strict, areas past the end of the smaller image must read as
// zeros in the larger one.
func (e *Env) Compare(ctx context.Context, cfg CompareConfig) error {
	stdout := e.stdout()
	if cfg.Quiet {
		cfg.Progress = false
	}
	prog := newQemuProgress(cfg.Progress, stdout, 2)
	defer prog.end()
	say := func(format string, args ...any) {
		if !cfg.Quiet {
			fmt.Fprintf(stdout, format, args...)
		}
	}
	openFile, err := sourceCache(cfg.Cache)
	if err != nil {
		return exitWith(compareOpenFailed, err)
	}
	var sides [2]*compareSide
	for i, nf := range [2][2]string{{cfg.Filename1, cfg.Format1}, {cfg.Filename2, cfg.Format2}} {
		dev, err := e.openImage(nf[0], nf[1], qcow2.Options{ReadOnly: true, OpenFile: openFile})
		if err != nil {
			return exitWith(compareOpenFailed, err)
		}
		defer dev.Close()
		m, size, err := sectorMapper(dev)
		if err != nil {
			return exitWith(compareOpenFailed, err)
		}
		sides[i] = &compareSide{name: nf[0], dev: dev, m: m, size: size}
	}
	a, b := sides[0], sides[1]
	total := min(a.size, b.size)
	progressBase := max(a.size, b.size)
	prog.print(0, 100)
	if cfg.Strict && a.size != b.size {
		say("Strict mode: Image size mismatch!\n")
		return exitWith(compareDifferent, nil)
	}
	buf1, buf2 := make([]byte, compareBuf), make([]byte, compareBuf)
	for off := int64(0); off < total; {
		if err := ctx.Err(); err != nil {
			return err
		}
		st1, n1, err := a.status(ctx, off, a.size-off)
		if err != nil {
			return exitWith(compareStatFailed, fmt.Errorf("Sector allocation test failed for %s", a.name))
		}
		st2, n2, err := b.status(ctx, off, b.size-off)
		if err != nil {
			return exitWith(compareStatFailed, fmt.Errorf("Sector allocation test failed for %s", b.name))
		}
		chunk := min(n1, n2)
		if cfg.Strict && st1 != st2 {
			say("Strict mode: Offset %d block status mismatch!\n", off)
			return exitWith(compareDifferent, nil)
		}
		alloc1, alloc2 := st1&statusAllocated != 0, st2&statusAllocated != 0
		switch {
		case st1&statusZero != 0 && st2&statusZero != 0:
		case alloc1 == alloc2:
			if alloc1 {
				chunk = min(chunk, compareBuf)
				p1, p2 := buf1[:chunk], buf2[:chunk]
				if err := a.read(ctx, p1, off); err != nil {
					return err
				}
				if err := b.read(ctx, p2, off); err != nil {
					return err
				}
				if at := firstDifference(p1, p2); at >= 0 {
					say("Content mismatch at offset %d!\n", off+at)
					return exitWith(compareDifferent, nil)
				}
			}
		default:
			chunk = min(chunk, compareBuf)
			s := a
			if alloc2 {
				s = b
			}
			if err := checkEmpty(ctx, s, buf1[:chunk], off, say); err != nil {
				return err
			}
		}
		off += chunk
		prog.print(float32(chunk)/float32(progressBase)*100, 100)
	}
	if a.size != b.size {
		say("Warning: Image size mismatch!\n")
		over := a
		if b.size > a.size {
			over = b
		}
		for off := total; off < progressBase; {
			if err := ctx.Err(); err != nil {
				return err
			}
			st, chunk, err := over.status(ctx, off, progressBase-off)
			if err != nil {
				return exitWith(compareStatFailed, fmt.Errorf("Sector allocation test failed for %s", over.name))
			}
			if st&statusAllocated != 0 && st&statusZero == 0 {
				chunk = min(chunk, compareBuf)
				if err := checkEmpty(ctx, over, buf1[:chunk], off, say); err != nil {
					return err
				}
			}
			off += chunk
			prog.print(float32(chunk)/float32(progressBase)*100, 100)
		}
	}
	say("Images are identical.\n")
	return nil
}

// checkEmpty is qemu-img's check_empty_sectors: [off, off+len(buf)) of s
// must read as zeros.
func checkEmpty(ctx context.Context, s *compareSide, buf []byte, off int64, say func(string, ...any)) error {
	if err := s.read(ctx, buf, off); err != nil {
		return err
	}
	for i := 0; i < len(buf); i += 512 {
		if !block.IsZero(buf[i:min(i+512, len(buf))]) {
			say("Content mismatch at offset %d!\n", off+int64(i))
			return exitWith(compareDifferent, nil)
		}
	}
	return nil
}

// firstDifference returns the offset of the first 512-byte sector in
// which p1 and p2 differ, or -1 when they are equal (compare_buffers).
func firstDifference(p1, p2 []byte) int64 {
	if bytes.Equal(p1, p2) {
		return -1
	}
	for i := 0; i < len(p1); i += 512 {
		j := min(i+512, len(p1))
		if !bytes.Equal(p1[i:j], p2[i:j]) {
			return int64(i)
		}
	}
	return -1
}
