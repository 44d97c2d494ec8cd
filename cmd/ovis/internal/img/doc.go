// Package img implements the `ovis img` verbs (create, info, convert) with
// qemu-img 7.2 as the specification: the same option syntax (-o lists with
// ",," escaping, sizes with k/M/G/T/P/E suffixes), the same "Formatting ..."
// line, the same info output in human and JSON form (keys in QEMU's QDict
// order) and the same error messages where ovis can produce them.
//
// The package turns command-line values into calls on the qcow2 engine and
// on block.Raw; it owns no on-disk format itself. It does not print the
// "qemu-img: " or "ovis: " prefix: errors are returned to cmd/ovis, which
// prints them.
//
// Not supported: formats other than qcow2 and raw, encryption, bitmaps,
// image options (--image-opts, --object), and QEMU's protocol options
// (nocow, extent_size_hint).
package img
