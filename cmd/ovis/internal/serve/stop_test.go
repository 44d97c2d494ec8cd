package serve

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/ovis-storage/ovis/block"
)

// flushHangDevice is a device whose Flush waits until its context ends,
// as one waiting on a lost replica would; it records whether Close ran.
type flushHangDevice struct {
	block.Device
	closed bool
}

func (d *flushHangDevice) Flush(ctx context.Context) error {
	<-ctx.Done()
	return ctx.Err()
}

func (d *flushHangDevice) Close() error {
	d.closed = true
	return d.Device.Close()
}

// TestCloseDeviceBoundsFlush: the final flush of a stop gives up after
// the grace, fails the stop with its context's error, and the device is
// closed all the same; a flush that answers is not cut.
func TestCloseDeviceBoundsFlush(t *testing.T) {
	const grace = 200 * time.Millisecond
	open := func(t *testing.T) *block.Raw {
		p := filepath.Join(t.TempDir(), "disk.raw")
		if err := os.WriteFile(p, make([]byte, 4096), 0o644); err != nil {
			t.Fatal(err)
		}
		r, err := block.OpenRaw(p, false)
		if err != nil {
			t.Fatal(err)
		}
		return r
	}

	t.Run("hung flush", func(t *testing.T) {
		dev := &flushHangDevice{Device: open(t)}
		start := time.Now()
		err := closeDevice(dev, grace)
		took := time.Since(start)
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("closeDevice = %v, want context.DeadlineExceeded", err)
		}
		if took < grace || took > grace+time.Second {
			t.Errorf("closeDevice took %v, want the grace %v", took, grace)
		}
		if !dev.closed {
			t.Error("device not closed after its flush was cut")
		}
	})

	t.Run("flush answers", func(t *testing.T) {
		dev := open(t)
		if err := closeDevice(dev, grace); err != nil {
			t.Errorf("closeDevice = %v", err)
		}
		if err := dev.Flush(context.Background()); !errors.Is(err, block.ErrClosed) {
			t.Errorf("Flush after closeDevice = %v, want block.ErrClosed", err)
		}
	})
}
