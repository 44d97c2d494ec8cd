package img

import (
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

// trust applies --untrusted to o.
func trust(o qcow2.Options) qcow2.Options {
	o.Untrusted = o.Untrusted || untrusted.Load()
	return o
}
