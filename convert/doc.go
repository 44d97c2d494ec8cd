// Package convert copies one block.Device onto another, as qemu-img
// convert copies an image: the source's extents decide what is read,
// what is zeroed and what is left alone, several workers read (and find
// zeros, and compress) in parallel, and the writes land in ascending
// order unless the caller lets them overlap.
//
// Order for callers: open the source (image.Open, qcow2.Open,
// block.OpenRaw; several sources joined with Concat) and an output at
// least as large, call Copy, then close both. Copy flushes the output
// and closes neither device.
//
//	err := convert.Copy(ctx, dst, src, convert.Options{TargetIsZero: true})
//
// What Copy does with each range of the source:
//
//  1. A range the source reports as zero is zeroed with the unmap hint,
//     or not written at all when the output reads as zeros already
//     (Options.TargetIsZero), or past the end of the output's backing
//     file (Options.BackingEnd).
//  2. A data range is read in buffers of 2 MiB; all-zero runs of at
//     least Options.MinSparse bytes inside it are zeroed instead of
//     written, cut where qemu-img cuts them (is_allocated_sectors_min),
//     so that a copy allocates the clusters qemu-img's would.
//  3. With Options.TopOnly, ranges below the source's own layer are left
//     to the output's backing file.
//  4. With Options.Compress every cluster of a qcow2 output is written
//     compressed; the workers compress, the writes only store.
//
// Invariants:
//
//  1. Without Options.OutOfOrder the writes are made one at a time in
//     offset order, so an interrupted copy leaves a prefix of the source
//     and a qcow2 output's layout does not depend on timing.
//  2. Memory is bounded: one buffer per worker, twice as many when the
//     writes are ordered.
//  3. Copy returns only after every goroutine it started has returned.
//
// Progress comes through callbacks (Options.Progress, and
// Options.DataProgress for qemu-img's own figure) and failures as *Error
// with the step (Op) and offset, so that a command line can print them
// in its own words: cmd/ovis/internal/img prints qemu-img's.
//
// Files, by concern:
//
//   - options.go: Options, defaults and Validate
//   - copy.go: Copy and the worker loop, ordered writes
//   - walk.go: the walk over the source's extents, classification, jobs
//   - data.go: reading, zeroing and writing one job, copy offloading
//   - sparse.go: finding the zero runs inside data
//   - compress.go: compressed output
//   - salvage.go: reading around errors
//   - concat.go: several sources as one device
//   - ratelimit.go: the write rate limit
//   - errors.go: Error, Op and the errors Copy returns
//
// Not done here: opening or creating images (package image, qcow2),
// copying bitmaps, progress drawing, qemu-img's messages and exit codes.
package convert
