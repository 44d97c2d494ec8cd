// Package store keeps one storage node's objects on its local disk: their
// bytes, their versions, the tombstones of removed ones, and each VDI's
// highest fencing token.
//
// It imports only the standard library, golang.org/x/sys/unix,
// cluster/object and its own file system seam, cluster/store/vfs: no
// network, no etcd. The node server calls it; the layout, the protocol,
// the fault tests and measurements are in docs/store.md.
//
// Files, by concern:
//
//   - store.go: Store, Open, Close, Options, VDI state, tokens and Fence
//   - version.go: Version, Stamp and the rule for a mutation's version
//   - obj.go: per-object state, the header's load and update, journaling
//     and creation (or a tombstone's recreation) before a first write
//   - io.go: ReadAt, ReadSuspect, WriteAt, WriteZeroes, Discard, Extents
//   - flush.go: Flush
//   - admin.go: Remove, RemoveVDI, Put, PutTombstone, Replace, Forget,
//     Drop, ClearSuspect, Checksum, Stat, List, Usage
//   - header.go: the object file header
//   - journal.go: the dirty journal, with group commit and compaction
//   - fdcache.go: the LRU of open object files
//   - sys.go: whole-file read, write-and-fsync and directory fsync over
//     the seam
//   - vfs/: the seam, vfs.FS (Options.FS; vfs.Default is the OS, one
//     direct call per method); vfs/errorfs fails the operations its
//     rules match, for the fault tests (fault_test.go, faultmodel_test.go)
//
// Layout: dir/objects/<vdi, 8 hex digits>/<index, 8 hex digits> is one
// sparse file per object, a 4 KiB header (magic, flags, id, version,
// CRC32C) then the object's bytes; a tombstone is the header alone, with
// the "removed" flag; dir/journal is the dirty journal; dir/CLEAN exists
// only between a Close and the next Open; dir/tmp holds the files of Put,
// Replace, PutTombstone and Remove until they are renamed in place.
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
//     returns ErrSuspect; ReadSuspect alone reads it) until Put, Replace
//     or PutTombstone replaces it, ClearSuspect declares it good or
//     Remove makes it a tombstone; suspicion survives further crashes.
//  3. A sync write returns after fdatasync of its file (its data and the
//     header holding its version) and, for a new file, an fsync of its
//     directory. Flush returns after the same for every object of the VDI
//     written without sync. Neither ever syncs the whole file system.
//  4. Every mutating call (WriteAt, WriteZeroes, Discard, Remove) gives
//     the object the version max(old+1, Version(epoch, 1)) for its
//     Stamp's epoch, the count saturating within an epoch (version.go
//     says why); a version never goes down, not across a Remove either:
//     the tombstone keeps it and a write recreating the object goes on
//     from it. Only Forget, Drop and RemoveVDI, after which the object
//     is gone, start it again from nothing. The header gets the
//     version before the fdatasync that makes the write durable (the
//     sync write's own, or the Flush's). After a crash, an object that
//     is not suspect has the version of its last write, or is the
//     tombstone of its last Remove.
//  5. A VDI's token only rises, and it is durable in the journal before
//     a call that raised it changes anything. A call with a lower token
//     changes nothing (ErrStaleToken); Fence returns only after every call
//     admitted with a lower token has finished.
//  6. Put, Replace, PutTombstone and Remove write a complete file aside
//     (a tombstone is a header-only file), sync it, rename it over the
//     old one and sync the directory: a crash leaves the old copy or the
//     new one, and at most leaked space in dir/tmp, which Open removes.
//     Put and PutTombstone replace only a copy that is missing, suspect
//     or of a lower version (else ErrNotNewer), decided while they hold
//     the object against every other call.
//  7. A tombstone reads, checksums and maps as a missing object does
//     (ErrNotFound), and shows in Stat and List with Tombstone set and its
//     version. It goes only by Forget (its version at most the one
//     given), Drop, RemoveVDI, or a write that recreates the object.
//  8. A read sees each mutation of the range it reads whole or not at
//     all: a mutation's I/O on the file and a read's pread exclude each
//     other (obj.data), so a 4 KiB-aligned write is atomic to readers.
//  9. A failed fdatasync is never outlived by a success: the kernel may
//     have dropped the pages and reports the error once. The copy is
//     suspect, and every later fdatasync of its file fails (so no Flush
//     of its VDI succeeds while it holds unsynced acknowledged writes)
//     until Put, Replace, PutTombstone, Remove, Drop or RemoveVDI
//     replaces the file, or ClearSuspect writes it anew; a sync succeeds
//     only once every sync of the file begun before it returned has
//     succeeded. After the journal's fdatasync fails, every mutating call,
//     Fence and Flush fail (Err), and Close leaves no clean marker.
//
// Token rule: every mutating call carries the writer's token in its
// Stamp. Token 0 is accepted only while the VDI never saw another; a
// higher token is recorded (as by Fence) before the call proceeds. Put,
// Replace, PutTombstone, Forget and Drop carry no token: they are recovery's,
// and the node fences them by other means.
//
// Versions and tombstones: a version is epoch<<32 | count, so that the
// versions of one object's copies on different nodes compare: recovery
// takes the highest, and a node that was away during epochs in which the
// object was written or removed holds a lower one, whatever its own count.
// A Remove keeps a tombstone at its version so that a stale live copy
// elsewhere cannot come back as the newest; recovery calls Forget once
// every node has seen the delete.
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
// recovery compares versions and checksums and calls Put, PutTombstone,
// Replace, Forget, Drop), and any network or etcd access.
package store
