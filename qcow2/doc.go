// Package qcow2 reads and writes QEMU's qcow2 image format and serves an
// image as a block.Device.
//
// The specification is docs/interop/qcow2.rst in QEMU's tree; QEMU's own
// tools (qemu-img, qemu-io) are the oracle for every format question.
//
// Files, by concern:
//
//   - image.go: the Image, Open and Close, entry masks
//   - options.go: Open's options
//   - errors.go: corrupt, format and unsupported errors
//   - header.go: header and extensions
//   - l2.go: L2 entry decoding
//   - cache.go: metadata table cache
//   - refcount.go: refcounts and allocation
//   - refcountentry.go: refcount block entries for tools
//   - read.go, write.go, zero.go, compressed.go: the I/O paths
//   - hostholes.go: mapped clusters that are holes in the host file
//   - map.go: MapAt, where guest runs live
//   - flush.go: crash-ordered writeback
//   - create.go: image creation
//   - backing.go: backing files (through Options.OpenBacking, which package
//     image sets, or a qcow2-or-raw fallback), OpenRaw, file: and json: names
//   - compress.go: deflate and zstd
//   - bitmap.go: persistent dirty bitmaps
//   - metrics.go: Prometheus cache counters
//   - gate.go: the exclusive gate, drain of users for wholesale metadata changes
//   - refcounthelpers.go: refcount and allocation helpers of exclusive operations
//   - tableio.go: whole-table reads and writes of exclusive operations
//   - copied.go: COPIED-flag upkeep after refcount changes
//   - snapshot.go: the snapshot table format
//   - snapshotops.go: snapshot create, delete, apply and load
//   - resize.go: resize
//   - amend.go: amend
//   - check.go: Check, the qemu-img check entry point
//   - checkresult.go: check results, repairs, qemu-img's message formatting
//   - treewalk.go: the one walk of the metadata tree, every reference to a
//     host cluster, which check, the refcount rebuild and the snapshot
//     operations visit with their own callbacks
//   - checkwalk.go: check's callbacks on the walk, its reference count
//   - checkcompare.go: check's refcount comparison and in-place repair
//   - checkcopied.go: check's COPIED pass and metadata overlap check
//   - checksnap.go: check of the snapshot table
//   - rebuild.go: the one refcount structure rebuild, for check -r, the
//     lazy-refcounts recovery and amend's refcount width
//   - overlap.go: the allocation overlap check
//
// Invariants:
//
//  1. On disk, a cluster's refcount is never lower than the number of
//     references to it: refcount increments reach disk before the L2/L1
//     entries that reference the cluster, and refcount drops only after
//     the entries that referenced it are gone on disk (see Flush). A
//     crash can leak clusters, never corrupt the image.
//  2. A table's content is durable before the entry pointing to it
//     (refcount block before refcount table entry, L2 table before L1).
//  3. Only the writer that claimed a guest cluster (Image.inflight)
//     changes its L2 entry; other writers to that cluster wait.
//  4. A cluster whose refcount is not exactly 1 is never written in
//     place: it is copied first (snapshots, compressed clusters).
//  5. Clusters freed since the last flush are not reused before it.
//  6. No metadata lock (mu) is held across data I/O, and table loads
//     happen with it released. mu is held for I/O only in the rare steps
//     docs/architecture.md lists: refcount table growth, the first write
//     (refcount rebuild after an unclean shutdown, lazy-refcounts dirty
//     bit, flagging enabled bitmaps in-use), the dirty bit's clearing at
//     Close, the corrupt bit of an overlap event, and operations under
//     the exclusive gate.
//  7. The allocator never hands out a cluster holding metadata: on a
//     damaged image whose refcounts call metadata free, the allocation is
//     refused as QEMU's overlap check refuses the write (the image is
//     marked corrupt, the request fails with EIO, later writes fail).
//  8. With pass-discard-request, a cluster freed by a guest discard is
//     punched only after the L2 change is durable and the I/O that mapped
//     it has drained, and before its refcount drops (so before it can be
//     reused); a cluster still referenced elsewhere is not punched.
//
// Locking (docs/architecture.md, "Locks", is the full table): gate, then
// flushMu, then mu, then the leaves bm.mu and hostRunsMu. gate is held
// shared by every I/O method and exclusively by operations that rewrite
// metadata wholesale (snapshots, amend, resize, bitmap changes, check),
// which so run with no I/O in flight. flushMu makes one flusher at a
// time; Flush holds it, with mu released, across its writeback and the
// punching of freed clusters. The corrupt bit of an overlap event is
// written with mu held, from the allocator.
//
// FUA: a WriteAt or WriteZeroes with fua runs a full Flush once its data
// is written, so every write completed before it becomes durable too.
//
// Not done here: encryption (refused with UnsupportedError).
package qcow2
