package img

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strings"

	"github.com/ovis-storage/ovis/block"
	"github.com/ovis-storage/ovis/qcow2"
)

// DDConfig is what `ovis img dd` was given, as qemu-img dd's arguments:
// dd [-f FMT] [-O FMT] [-U] [bs=SIZE] [count=N] [skip=N] if=INPUT of=OUTPUT.
type DDConfig struct {
	// Format (-f) is the input's format, "" to probe.
	Format string
	// OutFormat (-O) is the output's format; "" means raw.
	OutFormat string
	// Operands are the dd-style NAME=VALUE arguments in order.
	Operands []string
}

// ddRequest is a parsed dd command line.
type ddRequest struct {
	bs, count, skip int64
	hasCount        bool
	hasSkip         bool
	in, out         string
	hasIn, hasOut   bool
}

// parseDD parses dd's operands with qemu-img's messages.
func parseDD(operands []string) (*ddRequest, error) {
	r := &ddRequest{bs: 512}
	for _, a := range operands {
		name, val, ok := strings.Cut(a, "=")
		if !ok {
			return nil, fmt.Errorf("unrecognized operand %s", a)
		}
		var err error
		switch name {
		case "bs":
			r.bs, err = cvtnum("bs", val, math.MaxInt64)
			if err == nil && (r.bs < 1 || r.bs > math.MaxInt32) {
				err = fmt.Errorf("Invalid bs specified. Must be between 1 and %d.", math.MaxInt32)
			}
		case "count":
			r.count, err = cvtnum("count", val, math.MaxInt64)
			r.hasCount = true
		case "skip":
			r.skip, err = cvtnum("skip", val, math.MaxInt64)
			r.hasSkip = true
		case "if":
			r.in, r.hasIn = val, true
		case "of":
			r.out, r.hasOut = val, true
		default:
			return nil, fmt.Errorf("unrecognized operand %s", name)
		}
		if err != nil {
			return nil, err
		}
	}
	if !r.hasIn || !r.hasOut {
		return nil, errors.New("Must specify both input and output files")
	}
	return r, nil
}

// DD copies count blocks of bs bytes of an image, after skipping skip
// blocks, into a new image, as qemu-img dd does: the output is created
// with the size of what is copied and every byte is written (it is not
// sparse). A skip past the input's end reports "cannot skip to specified
// offset" and leaves an empty output, as dd(1) and qemu-img do, and
// returns nil. It stops once ctx is done.
func (e *Env) DD(ctx context.Context, cfg DDConfig) (warn error, err error) {
	r, err := parseDD(cfg.Operands)
	if err != nil {
		return nil, err
	}
	src, err := e.openImage(r.in, cfg.Format, qcow2.Options{ReadOnly: true})
	if err != nil {
		return nil, err
	}
	defer src.Close()
	outFmt := cfg.OutFormat
	if outFmt == "" {
		outFmt = "raw"
	}
	desc, ok := formatOpts(outFmt)
	if !ok {
		return nil, errors.New("Unknown file format")
	}
	size := src.Size()
	if r.hasCount && r.count <= math.MaxInt64/r.bs && r.count*r.bs < size {
		size = r.count * r.bs
	}
	beyond := r.hasSkip && (r.skip > math.MaxInt64/r.bs || size < r.skip*r.bs)
	outSize, pos := int64(0), size
	if !beyond {
		pos = r.skip * r.bs
		outSize = size - pos
	}
	o, err := parseOptions(desc, "")
	if err != nil {
		return nil, err
	}
	// Images are created in whole sectors, as QEMU creates them.
	created := (outSize + 511) &^ 511
	o.setNumber(optKeySize, uint64(created))
	if r.out, err = newImagePath(r.out); err != nil {
		return nil, err
	}
	if err := createTarget(r.out, outFmt, o, created); err != nil {
		return nil, fmt.Errorf("%s: error while creating output image: %w", r.out, err)
	}
	// -U is for the input alone, as in qemu-img dd.
	t := e.trust(r.out, qcow2.Options{})
	t.ForceShare = false
	dst, err := e.openTrusted(r.out, outFmt, qcow2.Options{}, t)
	if err != nil {
		return nil, err
	}
	if beyond {
		warn = fmt.Errorf("%s: cannot skip to specified offset", r.in)
	}
	err = ddCopy(ctx, src, dst, pos, size)
	if cerr := dst.Close(); err == nil && cerr != nil {
		err = fmt.Errorf("%s: %w", r.out, cerr)
	}
	return warn, err
}

// ddCopy copies [pos, end) of src to the start of dst, in chunks of 1 MiB
// whatever the block size: the bytes are those of qemu-img's
// block-by-block loop, every one written.
func ddCopy(ctx context.Context, src, dst block.Device, pos, end int64) error {
	buf := make([]byte, min(1<<20, max(end-pos, 0)))
	for out := int64(0); pos < end; {
		if err := ctx.Err(); err != nil {
			return err
		}
		n := min(int64(len(buf)), end-pos)
		if _, err := src.ReadAt(ctx, buf[:n], pos); err != nil {
			return fmt.Errorf("error while reading from input image file: %s", strerror(err))
		}
		if _, err := dst.WriteAt(ctx, buf[:n], out, 0); err != nil {
			return fmt.Errorf("error while writing to output image file: %s", strerror(err))
		}
		pos += n
		out += n
	}
	return nil
}
