// Package image opens disk images by name: it finds an image's format
// (Probe), opens it as a block.Device (Open), and keeps the registry of
// formats both consult (Register). qcow2 and raw are registered by this
// package; another format (a cluster VDI, say) registers itself and can
// then be opened by name, be a qcow2 image's backing file, or be a
// convert source or output.
//
//	dev, err := image.Open("disk.qcow2", "", image.Options{ReadOnly: true})
//	if err != nil { ... }
//	defer dev.Close()
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
//     safe for concurrent use.
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
//
// Not done here: creating images (qcow2.Create, block.CreateFile),
// copying them (package convert), command-line option lists and
// qemu-img's messages (cmd/ovis/internal/img).
package image
