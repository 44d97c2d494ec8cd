// Package image opens disk images by name: it finds an image's format
// (Probe), opens it as a block.Device (Open), and keeps the registry of
// formats both consult (Register). It also reads the other ways QEMU's
// tools name an image and what to open it with: option lists
// (--image-opts, ParseOpts, applied to Options by Opts.Apply), the
// objects of json: names (FlattenJSON, into an option list), sizes as
// those lists write them (ParseSize), and internal snapshots (-l,
// ParseSnapshot; LoadSnapshot, OpenSnapshot). qcow2 and raw are registered by this
// package; another format (a cluster VDI, say) registers itself and can
// then be opened by name, be a qcow2 image's backing file, or be a
// convert source or output.
//
//	dev, err := image.Open("disk.qcow2", "", image.Options{ReadOnly: true})
//	if err != nil { ... }
//	defer dev.Close()
//
//	l, err := image.ParseOpts("driver=qcow2,file.filename=disk.qcow2,l2-cache-size=4M")
//	if err != nil { ... } // an *image.OptError
//	dev, err = image.Open(l.Filename, l.Driver, l.Apply(image.Options{}))
//
// Order for callers: name the format when the image comes from someone
// else (probing trusts the file's first bytes; see Probe), Open, use the
// device, Close it.
//
// Invariants:
//
//  1. Every backing file of a qcow2 image that Open opens goes through
//     Open again (qcow2.Options.OpenBacking), so it may be of any
//     registered format; the options qcow2 hands the hook carry the
//     chain opened so far, so a backing loop is refused, not followed.
//  2. A file no registered format claims is raw.
//  3. The package holds no state but the registry; Open and Probe are
//     safe for concurrent use, and the parsers are pure functions.
//  4. The parsers say what is wrong with typed errors (*OptError,
//     *JSONError, *SnapshotError, ErrSizeSyntax, ErrSizeRange) whose
//     causes are this package's sentinel errors, so that a caller can
//     word them its own way (cmd/ovis/internal/img words them as
//     qemu-img does); their own texts are not QEMU's.
//  5. What ParseOpts returns names a file (Filename is not empty), and
//     its driver, when given, is a registered format.
//
// The dependency runs one way: image imports qcow2 (to open qcow2 images
// and parse file: and json: names) and qcow2 does not import image; it
// opens backing files through the hook image sets, and has a qcow2-or-raw
// fallback of its own for callers of qcow2.Open that set none.
//
// Files, by concern:
//
//   - registry.go: Format, Register, Lookup, Formats, Options
//   - probe.go: Probe and the file: and json: names
//   - open.go: Open
//   - formats.go: the qcow2 and raw formats
//   - opts.go: option lists: Opts, ParseOpts, Apply, SplitOpts, OptError
//   - jsonname.go: FlattenJSON, the objects of json: names
//   - size.go: ParseSize, QEMU's byte counts
//   - snapshot.go: Snapshot, ParseSnapshot, LoadSnapshot, OpenSnapshot
//
// Not done here: creating images (qcow2.Create, block.CreateFile),
// copying them (package convert), creation option lists (-o) and every
// message in qemu-img's words (cmd/ovis/internal/img). Open and Probe
// read json: names with qcow2.SplitFilename, which takes the file and
// driver alone; a caller that wants a json: name's other options
// flattens it with FlattenJSON and parses it with ParseOpts.
package image
