// Package nbd serves any block.Device over the Network Block Device
// protocol, as specified in NetworkBlockDevice/nbd doc/proto.md.
//
// Files, by concern:
//
//   - proto.go: wire constants, Errno
//   - handshake.go: fixed newstyle option haggling, STARTTLS, metadata contexts
//   - list.go: the client side of listing exports (qemu-nbd --list)
//   - request.go: the per-command validation table
//   - transmission.go: the request loop, idle timeouts, dispatch to handlers
//   - cork.go: reply writing, corked inline replies, shared flushes
//   - workers.go: the per-connection worker pool
//   - read.go: NBD_CMD_READ, inline and structured (holes)
//   - blockstatus.go: NBD_CMD_BLOCK_STATUS, device and dirty-bitmap runs
//   - errno.go: device errors to NBD errors
//   - budget.go: bounds on requests and buffer bytes in service
//   - watch.go: watching the client while the reader waits for room
//   - reply.go: reply encoding, buffer pools
//   - server.go: Export, Config, Server lifecycle
//   - exports.go: Exports, the exports looked up at run time, and
//     FixedExports
//
// What a client gets:
//
//   - the fixed newstyle handshake with NBD_FLAG_NO_ZEROES; options
//     EXPORT_NAME, ABORT, LIST, STARTTLS, INFO and GO (INFO_EXPORT,
//     INFO_NAME, INFO_DESCRIPTION, INFO_BLOCK_SIZE: minimum 1, preferred
//     4096, maximum Config.MaxPayload), STRUCTURED_REPLY,
//     LIST_META_CONTEXT and SET_META_CONTEXT; any other option gets
//     NBD_REP_ERR_UNSUP and the handshake goes on;
//   - metadata contexts base:allocation (NBD_STATE_HOLE and
//     NBD_STATE_ZERO from block.Extent's Status) and
//     qemu:allocation-depth (block.Extent's Depth: 0 unallocated, 1
//     this layer, 2 and up the backing chain), as QEMU documents it in
//     docs/interop/nbd.txt, and qemu:dirty-bitmap:NAME for each of
//     Export.Bitmaps (1 for a dirty range);
//   - commands READ, WRITE, DISC, FLUSH, TRIM, CACHE (a successful
//     no-op), WRITE_ZEROES (NO_HOLE, FAST_ZERO) and BLOCK_STATUS
//     (REQ_ONE); FUA on any command, DF on READ. READ and WRITE longer
//     than the advertised maximum fail with EINVAL; the commands without
//     a payload are served at any length inside the export, as the spec
//     allows (QEMU sends discards longer than the maximum).
//
// Query syntax for the metadata contexts: each context's name selects it;
// in LIST_META_CONTEXT, a bare "base:" or "qemu:" lists the namespace,
// "qemu:dirty-bitmap:" every bitmap, and no query lists them all;
// anything else is ignored.
//
// Invariants:
//
//  1. Every request is checked by validate (request.go) before a handler
//     runs; a handler never sees a range outside the export, a flag the
//     command does not take, or a write on a read-only export.
//  2. Bytes after a request header are read only for WRITE, and always
//     for WRITE (into a buffer, or discarded in pieces when the request
//     is refused) so the stream stays in sync; a refused payload longer
//     than 64 MiB ends the connection after the error reply.
//  3. A READ reply is written only after all of its data was read, so an
//     error is never reported after a success header. With structured
//     replies, every READ reply is structured (errors too), its chunks
//     cover the request exactly once and the last carries
//     NBD_REPLY_FLAG_DONE.
//  4. Replies are written whole under one mutex; chunks of one reply are
//     never interleaved with another reply.
//  5. Memory is bounded before it is spent. No connection holds more
//     than MaxInFlight requests or 2 × MaxPayload bytes of buffers in
//     service: the reader stops reading until a handler finishes. A
//     WRITE's buffer grows only as its payload arrives (at most twice
//     what was received), so a header is never an allocation. READ
//     buffers, which cost a client only a header, are also bounded for
//     the whole server (MaxReadBufferBytes), except one READ of at most
//     1 MiB per connection, so that clients that hold READ buffers by
//     not reading their replies cannot starve the others. The handshake
//     allocates at most 64 KiB per option and is bounded in time. A
//     connection over MaxConnections is closed before anything is
//     allocated for it.
//  6. Every wait on a client is bounded when IdleTimeout is set: a
//     connection with no request in service that sends none, a request
//     or payload that stops arriving, and a reply the client does not
//     read all end the connection after IdleTimeout.
//  7. A connection ends only after its requests in service have finished
//     and replied; the device is flushed if it was written since the
//     last successful flush on that connection.
//  8. No device call can keep a connection or the server from ending,
//     provided the device returns once its context ends: every call gets
//     the connection's context, which a client's disconnect (seen even
//     while the reader waits for room in service) and Close cancel, and
//     Shutdown calls Close when its grace period ends. The flush on the
//     way out runs under the server's context, so that a disconnect
//     still flushes; Close ends it. A cancelled connection starts no
//     further device calls.
//  9. Config.ConnState sees every accepted connection go New, then
//     Negotiating (unless refused), Transmission (if the handshake
//     succeeds), and Closed exactly once, last, before Shutdown or Close
//     returns.
//
// Locking (docs/architecture.md, "Locks"): Server.mu, then a
// connection's serverConn.mu; a connection's reply mutex and the buffer
// budgets are leaves. No nbd lock is held while calling the device or
// Config.ConnState. Replies are written to the socket under the reply
// mutex, bounded by IdleTimeout when it is set.
//
// Order for callers: open the devices, New(Config) with
// FixedExports(list...) or an Exports of one's own, Serve on each
// listener (it blocks), then Shutdown (graceful) or Close; close the
// devices last. The Server never closes a device. An Exports may offer
// exports that appear and go while the server runs: each handshake asks
// it, and a connection keeps the Export it got until it ends.
//
// Not done here: oldstyle and non-fixed newstyle-only negotiation (a
// client without NBD_FLAG_C_FIXED_NEWSTYLE is still served, but not with
// TLS), extended headers (NBD_OPT_EXTENDED_HEADERS is refused with
// NBD_REP_ERR_UNSUP, so QEMU 8.2+ falls back to structured replies),
// SELECTIVETLS, NBD_CMD_RESIZE, and a minimum block size above 1.
package nbd
