package img

import (
	"context"
	"errors"
	"fmt"
	"math"

	"github.com/ovis-storage/ovis/block"
	"github.com/ovis-storage/ovis/qcow2"
)

// BitmapAction is one action of qemu-img bitmap, in command-line order:
// Op is "add", "remove", "clear", "enable", "disable" or "merge"; Source
// is merge's source bitmap.
type BitmapAction struct {
	Op, Source string
}

// BitmapConfig is what `ovis img bitmap` was given, as qemu-img bitmap's
// arguments: bitmap (--add [-g G] | --remove | --clear | --enable |
// --disable | --merge SRC [-b FILE [-F FMT]])... [-f FMT] FILE BITMAP.
type BitmapConfig struct {
	Actions []BitmapAction
	// Filename and Name are FILE and BITMAP; Args holds them as given.
	Args   []string
	Format string
	// Granularity (-g) of an added bitmap; "" is the default.
	Granularity string
	// SourceFile (-b) and SourceFormat (-F) hold merge's source bitmaps.
	SourceFile, SourceFormat string
}

// Bitmap changes an image's persistent dirty bitmaps as qemu-img bitmap
// does: the actions run in order, each stored before the next, and the
// first that fails stops the command with "Operation OP on bitmap NAME
// failed: ...".
func (e *Env) Bitmap(ctx context.Context, cfg BitmapConfig) error {
	stderr := e.stderr()
	var gran int64
	if cfg.Granularity != "" {
		var err error
		if gran, err = cvtnum("granularity", cfg.Granularity, math.MaxInt64); err != nil {
			return err
		}
	}
	has := func(op string) bool {
		for _, a := range cfg.Actions {
			if a.Op == op {
				return true
			}
		}
		return false
	}
	switch {
	case len(cfg.Actions) == 0:
		return errors.New("Need at least one of --add, --remove, --clear, --enable, --disable, or --merge")
	case gran != 0 && !has("add"):
		return errors.New("granularity only supported with --add")
	case cfg.SourceFormat != "" && cfg.SourceFile == "":
		return errors.New("-F only supported with -b")
	case cfg.SourceFile != "" && !has("merge"):
		return errors.New("Merge bitmap source file only supported with --merge")
	case len(cfg.Args) != 2:
		return errors.New("Expecting filename and bitmap name")
	}
	filename, name := cfg.Args[0], cfg.Args[1]
	dev, err := e.openWritable(ctx, filename, cfg.Format, qcow2.Options{NoBacking: true}, stderr)
	if err != nil {
		return err
	}
	defer dev.Close()
	var src block.Device = dev
	if cfg.SourceFile != "" {
		if src, err = e.openImage(cfg.SourceFile, cfg.SourceFormat, qcow2.Options{ReadOnly: true, NoBacking: true}); err != nil {
			return err
		}
		defer src.Close()
	}
	qimg, _ := block.As[*qcow2.Image](dev)
	for _, a := range cfg.Actions {
		if err := ctx.Err(); err != nil {
			return err
		}
		if err := bitmapAction(ctx, qimg, src, filename, name, gran, a); err != nil {
			return fmt.Errorf("Operation %s on bitmap %s failed: %s", a.Op, name, bitmapReason(err))
		}
	}
	return dev.Close()
}

// bitmapAction runs one action on img (nil for a raw image).
func bitmapAction(ctx context.Context, img *qcow2.Image, src block.Device, filename, name string, gran int64, a BitmapAction) error {
	if img == nil {
		if a.Op == "add" {
			return fmt.Errorf("Can't store persistent bitmaps to %s: Operation not supported", filename)
		}
		return &qcow2.BitmapError{Err: qcow2.ErrBitmapNotFound, Name: name}
	}
	switch a.Op {
	case "add":
		err := img.AddBitmap(ctx, name, gran, false)
		if err != nil && img.Header().Version < 3 {
			err = fmt.Errorf("Can't make bitmap '%s' persistent in '%s': %w", name, filename, err)
		}
		return err
	case "remove":
		return img.RemoveBitmap(ctx, name)
	case "clear":
		return img.ClearBitmap(ctx, name)
	case "enable", "disable":
		return img.SetBitmapEnabled(ctx, name, a.Op == "enable")
	case "merge":
		if !slicesContainsBitmap(img.Bitmaps(), name) {
			return &qcow2.BitmapError{Err: qcow2.ErrBitmapNotFound, Name: name}
		}
		s, ok := block.As[*qcow2.Image](src)
		if !ok {
			return &qcow2.BitmapError{Err: qcow2.ErrBitmapNotFound, Name: a.Source}
		}
		bits, g, err := s.BitmapBits(a.Source)
		if err != nil {
			return err
		}
		return img.MergeBitmap(ctx, name, bits, g)
	}
	return fmt.Errorf("unknown bitmap action %q", a.Op)
}

func slicesContainsBitmap(list []qcow2.Bitmap, name string) bool {
	for _, b := range list {
		if b.Name == name {
			return true
		}
	}
	return false
}

// bitmapReason words an engine error as QEMU does.
func bitmapReason(err error) string {
	var be *qcow2.BitmapError
	if errors.As(err, &be) {
		switch be.Err {
		case qcow2.ErrBitmapNotFound:
			return fmt.Sprintf("Dirty bitmap '%s' not found", be.Name)
		case qcow2.ErrBitmapExists:
			return "Bitmap already exists: " + be.Name
		case qcow2.ErrBitmapInUse:
			return fmt.Sprintf("Bitmap '%s' is inconsistent and cannot be used\n"+
				"Try block-dirty-bitmap-remove to delete this bitmap from disk", be.Name)
		}
	}
	return err.Error()
}
