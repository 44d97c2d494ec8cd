package block

// WithCacheMode applies a cache mode's write-cache and flush semantics to
// a device (the host page cache is chosen when the device's file is
// opened: see OpenFileFor).
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
func WithCacheMode(d Device, m CacheMode) Device {
	switch {
	case m.IgnoreFlush():
		return unsafeDevice{d}
	case !m.WriteCache():
		return writethroughDevice{d}
	}
	return d
}

type writethroughDevice struct{ Device }

func (w writethroughDevice) WriteAt(p []byte, off int64, _ bool) (int, error) {
	return w.Device.WriteAt(p, off, true)
}

func (w writethroughDevice) WriteZeroes(off, n int64, mayUnmap, _ bool) error {
	return w.Device.WriteZeroes(off, n, mayUnmap, true)
}

type unsafeDevice struct{ Device }

func (u unsafeDevice) WriteAt(p []byte, off int64, _ bool) (int, error) {
	return u.Device.WriteAt(p, off, false)
}

func (u unsafeDevice) WriteZeroes(off, n int64, mayUnmap, _ bool) error {
	return u.Device.WriteZeroes(off, n, mayUnmap, false)
}

func (u unsafeDevice) Flush() error { return nil }

// Close still flushes: unsafe only promises nothing on a host crash, and
// a clean shutdown keeps the data.
func (u unsafeDevice) Close() error { return u.Device.Close() }

// OpenFileFor returns a file opener for a cache mode: O_DIRECT files for
// none and directsync, buffered ones otherwise.
func OpenFileFor(m CacheMode) func(name string, readOnly bool) (File, error) {
	if m.Direct() {
		return func(name string, readOnly bool) (File, error) {
			f, err := OpenFileDirect(name, readOnly)
			if err != nil {
				return nil, err
			}
			return f, nil
		}
	}
	return func(name string, readOnly bool) (File, error) {
		f, err := OpenFile(name, readOnly)
		if err != nil {
			return nil, err
		}
		return f, nil
	}
}

func (w writethroughDevice) Unwrap() Device { return w.Device }
func (u unsafeDevice) Unwrap() Device       { return u.Device }

// Unwrap returns the device under cache-mode wrappers (WithCacheMode), so
// that callers can reach an engine's own operations.
func Unwrap(d Device) Device {
	for {
		u, ok := d.(interface{ Unwrap() Device })
		if !ok {
			return d
		}
		d = u.Unwrap()
	}
}
