package img

import (
	"fmt"
	"io"
	"sync"

	"github.com/ovis-storage/ovis/qcow2"
)

// Env is what one `ovis img` command line gives every image its verb
// opens, qemu-img's options above the verb's own: --untrusted, the verb's
// -U, the option lists that named images (--image-opts, file: and json:
// names), and the writers the verb prints to. cmd/ovis makes one for
// each invocation and calls the verb on it; nothing is kept in package
// variables, so verbs with different settings may run side by side in
// one process.
//
// Set the exported fields before the first verb runs, and do not change
// them while one runs. The option lists are recorded as the verb's image
// arguments are resolved (UseImageOpts, ResolveFilename) and looked up
// by every open. Safe for concurrent use by the goroutines of the verbs
// that share it; do not copy an Env once used.
type Env struct {
	// Stdout receives a verb's output and Stderr its warnings, QEMU's
	// repair messages and the progress bar; nil discards.
	Stdout, Stderr io.Writer
	// Untrusted is --untrusted: backing and external data files must be
	// regular files in the image's own folder (qcow2.Options.Untrusted),
	// and formats are not probed. The default trusts images, as QEMU.
	Untrusted bool
	// ForceShare is the verb's -U: read-only opens ignore, and do not
	// hold, the image locks that keep writers out. The default locks as
	// qemu-img does.
	ForceShare bool

	mu struct {
		sync.Mutex
		// opts holds the option lists given for images, by the file
		// name they resolve to; nil until the first is recorded.
		opts map[string]*ImageOpts
	}
}

// stdout is e.Stdout, io.Discard when nil.
func (e *Env) stdout() io.Writer {
	if e.Stdout == nil {
		return io.Discard
	}
	return e.Stdout
}

// stderr is e.Stderr, io.Discard when nil.
func (e *Env) stderr() io.Writer {
	if e.Stderr == nil {
		return io.Discard
	}
	return e.Stderr
}

// setImageOpts records the option list o names its file by.
func (e *Env) setImageOpts(o *ImageOpts) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.mu.opts == nil {
		e.mu.opts = map[string]*ImageOpts{}
	}
	e.mu.opts[o.Filename] = o
}

// imageOptsFor returns the option list given for filename, or nil.
func (e *Env) imageOptsFor(filename string) *ImageOpts {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.mu.opts[filename]
}

// displayName is how QEMU names an image in errors: by its option list
// when it was given as one.
func (e *Env) displayName(filename string) string {
	if o := e.imageOptsFor(filename); o != nil {
		return o.Spec
	}
	return filename
}

// trust applies --untrusted, -U and the option list given for path to
// o, for opening path.
func (e *Env) trust(path string, o qcow2.Options) qcow2.Options {
	o.Untrusted = o.Untrusted || e.Untrusted
	o.ForceShare = o.ForceShare || e.ForceShare
	if io := e.imageOptsFor(path); io != nil {
		o = io.Apply(o)
	}
	if o.Warn == nil {
		w := e.stderr()
		o.Warn = func(warning, hint string) { fmt.Fprintf(w, "ovis: warning: %s\n%s", warning, hint) }
	}
	return o
}

// requireFormat refuses to probe the format of an untrusted image
// (qcow2.ErrProbeUntrusted).
func (e *Env) requireFormat(filename, format string) error {
	if format != "" || !e.Untrusted {
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
