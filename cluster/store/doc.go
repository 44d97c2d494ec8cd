// Package store keeps one storage node's objects on its local disk: their
// bytes, their versions, and each VDI's highest fencing token.
//
// It imports only the standard library, golang.org/x/sys/unix and
// cluster/object: no network, no etcd. The node server calls it; the
// layout, the protocol and measurements are in docs/store.md.
//
// Files, by concern:
//
//   - store.go: Store, Open, Close, Options, VDI state, tokens and Fence
//   - obj.go: per-object state, the header's load and update, journaling
//     and creation before a first write
//   - io.go: ReadAt, WriteAt, WriteZeroes, Discard, Extents
//   - flush.go: Flush
//   - admin.go: Remove, RemoveVDI, Put, ClearSuspect, Checksum, Stat, List,
//     Usage
//   - header.go: the object file header
//   - journal.go: the dirty journal, with group commit and compaction
//   - fdcache.go: the LRU of open object files
//
// Layout: dir/objects/<vdi, 8 hex digits>/<index, 8 hex digits> is one
// sparse file per object, a 4 KiB header (magic, id, version, CRC32C)
// then the object's bytes; dir/journal is the dirty journal; dir/CLEAN
// exists only between a Close and the next Open; dir/tmp holds Put's
// files until they are renamed in place.
//
// Invariants:
//
//  1. Before the first write to an object that is not journaled, a dirty
//     record for it is durable in the journal. Its record is cleared only
//     after an fdatasync that covers every acknowledged write to it (and
//     an fsync of its directory when it was created), and only while no
//     call is writing it. Hence after a crash every object whose copy may
//     differ from what its writes would have left is in the journal.
//  2. Open without the CLEAN marker turns every dirty record into a
//     suspect record. A suspect copy is neither read nor written (it
//     returns ErrSuspect) until Put replaces it, ClearSuspect declares it
//     good or Remove deletes it; suspicion survives further crashes.
//  3. A sync write returns after fdatasync of its file (its data and the
//     header holding its version) and, for a new file, an fsync of its
//     directory. Flush returns after the same for every object of the VDI
//     written without sync. Neither ever syncs the whole file system.
//  4. Every mutating call gives the object a new version, one higher
//     than the last. The header gets it before the fdatasync that makes
//     the write durable (the sync write's own, or the Flush's). After a
//     crash, an object that is not suspect has the version of its last
//     write.
//  5. A VDI's token only rises, and it is durable in the journal before
//     a call that raised it changes anything. A call with a lower token
//     changes nothing (ErrStaleToken); Fence returns only after every call
//     admitted with a lower token has finished.
//  6. Put writes a complete file aside, syncs it, renames it over the old
//     one and syncs the directory: a crash leaves the old copy or the new
//     one, and at most leaked space in dir/tmp, which Open removes.
//
// Token rule: every mutating call carries the writer's token. Token 0 is
// accepted only while the VDI never saw another; a higher token is
// recorded (as by Fence) before the call proceeds. Put carries no token:
// it is recovery's, and the node fences it by other means.
//
// Locking: Store.mu, then vdiState.mu, then obj.mu, then journal.mu or
// fdcache.mu, which are leaves. No mutex is held across I/O. Where one
// caller must do I/O for shared state (reading an object's header, its
// dirty record and creation, its header update, a journal batch), it sets
// a flag under the mutex, drops the mutex, and the others wait on a
// condition variable: writes to one object run in parallel apart from
// those steps. An fd in use is referenced and never closed by the LRU.
//
// Not done here: placement, replication, repair decisions (the node's
// recovery compares versions and checksums and calls Put), and any
// network or etcd access.
package store
