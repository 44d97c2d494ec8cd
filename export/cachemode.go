package export

import (
	"context"

	"github.com/ovis-storage/ovis/block"
)

// WithCacheMode applies a cache mode's write-cache and flush semantics to
// a device (the host page cache is chosen when the device's file is
// opened: see block.OpenFileFor).
//
//   - Without a guest write cache (writethrough, directsync) every write
//     and zero write is sent with FUA, so each is durable by itself in one
//     round trip; Flush still works.
//   - unsafe drops flushes and FUA.
//   - writeback and none pass everything through.
//
// A guest that toggles its write cache (virtio-blk WCE) is served by
// switching between these wrappers; over NBD the client decides per
// write by sending FUA or not.
func WithCacheMode(d block.Device, m block.CacheMode) block.Device {
	switch {
	case m.IgnoreFlush():
		return unsafeDevice{d}
	case !m.WriteCache():
		return writethroughDevice{d}
	}
	return d
}

type writethroughDevice struct{ block.Device }

func (w writethroughDevice) WriteAt(ctx context.Context, p []byte, off int64, f block.Flags) (int, error) {
	return w.Device.WriteAt(ctx, p, off, f|block.FUA)
}

func (w writethroughDevice) WriteZeroes(ctx context.Context, off, n int64, f block.Flags) error {
	return w.Device.WriteZeroes(ctx, off, n, f|block.FUA)
}

type unsafeDevice struct{ block.Device }

func (u unsafeDevice) WriteAt(ctx context.Context, p []byte, off int64, f block.Flags) (int, error) {
	return u.Device.WriteAt(ctx, p, off, f&^block.FUA)
}

func (u unsafeDevice) WriteZeroes(ctx context.Context, off, n int64, f block.Flags) error {
	return u.Device.WriteZeroes(ctx, off, n, f&^block.FUA)
}

func (u unsafeDevice) Discard(ctx context.Context, off, n int64, f block.Flags) error {
	return u.Device.Discard(ctx, off, n, f&^block.FUA)
}

func (u unsafeDevice) Flush(context.Context) error { return nil }

// Close still flushes: unsafe only promises nothing on a host crash, and
// a clean shutdown keeps the data.
func (u unsafeDevice) Close() error { return u.Device.Close() }

func (w writethroughDevice) Unwrap() block.Device { return w.Device }
func (u unsafeDevice) Unwrap() block.Device       { return u.Device }
