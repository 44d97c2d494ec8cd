// Package img implements the `ovis img` verbs with qemu-img 7.2 as the
// specification: create, info and convert; check, map, compare, commit,
// rebase, resize, snapshot, measure and bench. It keeps qemu-img's option
// syntax (-o lists with ",," escaping, sizes with k/M/G/T/P/E suffixes),
// its output (the "Formatting ..." line, info and check in human and JSON
// form with keys in QEMU's QDict order, map's JSON lines and table,
// QEMU's progress figures), its error messages where ovis can produce
// them, and its exit codes (check: 0 clean, 2 corrupt, 3 leaks, 63 no
// checks; compare: 0 same, 1 different, 2 open failure, 3 and 4 I/O
// failures), which verbs return as an *ExitError. Images are locked as
// qemu-img locks them (block.Perm), and -U (Env.ForceShare) opens readers
// beside a writer.
//
// Each verb is a method of an Env, the value one command line makes: the
// options that hold for every image the verb opens (--untrusted, -U, the
// option lists of --image-opts and file: and json: names) and the writers
// it prints to. The package keeps no settings in variables, and no verb
// writes to os.Stdout or os.Stderr, so verbs with different settings can
// run side by side in one process.
//
// The package turns command-line values into calls on the qcow2 engine and
// on block.Raw; it owns no on-disk format itself, with two stopgaps
// documented in header.go (changing an image's backing file, emptying an
// image after commit), which rewrite the header of a closed image through
// qcow2.ParseHeader and Header.Encode. It does not print the "qemu-img: "
// or "ovis: " prefix: errors are returned to cmd/ovis, which prints them.
//
// Not supported: formats other than qcow2 and raw, encryption, bitmaps
// (they are counted by measure and listed by info, not written), --object,
// the --image-opts options that image.ParseOpts does not take, and QEMU's
// protocol options (nocow, extent_size_hint).
package img
