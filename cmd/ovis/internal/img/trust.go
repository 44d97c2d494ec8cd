package img

import (
	"fmt"
	"os"
	"sync/atomic"

	"github.com/ovis-storage/ovis/qcow2"
)

// untrusted is ovis img --untrusted. It is process-wide because the flag
// belongs to the img command, above every verb, and a verb opens images
// in many places (the chain, the source of a convert, a commit target).
var untrusted atomic.Bool

// SetUntrusted makes every image opened from now on untrusted: backing
// and external data files must be regular files in the image's own folder
// (qcow2.Options.Untrusted).
func SetUntrusted(v bool) { untrusted.Store(v) }

// forceShare is the verb's -U, process-wide for the same reason.
var forceShare atomic.Bool

// SetForceShare makes every read-only open from now on ignore, and not
// hold, the image locks that keep writers out (qemu-img's -U).
func SetForceShare(v bool) { forceShare.Store(v) }

// trust applies --untrusted, -U and the --image-opts given for path to
// o, for opening path.
func trust(path string, o qcow2.Options) qcow2.Options {
	o.Untrusted = o.Untrusted || untrusted.Load()
	o.ForceShare = o.ForceShare || forceShare.Load()
	if io := imageOptsFor(path); io != nil {
		o = io.Apply(o)
	}
	if o.Warn == nil {
		o.Warn = func(warning, hint string) { fmt.Fprintf(os.Stderr, "ovis: warning: %s\n%s", warning, hint) }
	}
	return o
}

// requireFormat refuses to probe the format of an untrusted image
// (qcow2.ErrProbeUntrusted).
func requireFormat(filename, format string) error {
	if format != "" || !untrusted.Load() {
		return nil
	}
	return fmt.Errorf("Could not open '%s': %w", filename, qcow2.ErrProbeUntrusted)
}

// noBackingFormat refuses the backing file of an untrusted image whose
// header does not record the backing file's format, which would have to
// be probed.
func noBackingFormat(filename, backing string) error {
	return fmt.Errorf("Could not open backing file '%s' of '%s': the image records no backing format, and probing the format is %w", backing, filename, qcow2.ErrUntrusted)
}
