// Package protocol is the node-to-node wire protocol of the ovis
// cluster: the binary framing of requests and responses, their
// checksums and limits, a multiplexed Client, a Pool of kept
// connections and a Server. docs/protocol.md gives the format byte by
// byte.
//
// A request is a 64-byte header (opcode, flags, handle, epoch, fencing
// token, object id, offset, version, length, payload CRC32C; a gated
// write carries its gate id in the version field) and, when the header
// says so, a payload; a response is a 40-byte header
// (status, handle, epoch, version, length, CRC32C) and its payload. All
// integers are big-endian. Requests are multiplexed on a connection and
// answered in any order; the handle matches them.
//
// Files, by concern:
//
//   - proto.go: wire constants, Op, Flags, Status, the per-op table
//   - message.go: Request, Response, their framing (Write/Read)
//   - errors.go: Error, StatusOf, the connection errors
//   - payload.go: the structured payloads (ObjectInfo, Extent, checksum,
//     settle ids)
//   - client.go: Client, one multiplexed connection
//   - pool.go: Pool, kept connections per address
//   - server.go: Server, Handler, ServerOptions, per-connection budgets
//   - tls.go: mutual-TLS configs and a TLS Dialer
//
// Invariants:
//
//  1. Every payload's CRC32C (Castagnoli) is in its header and is
//     verified by the receiver before the payload is used: a server
//     replies StatusChecksum without calling the Handler, a Client
//     fails the call with ErrChecksum. The stream stays in sync.
//  2. A header that breaks the framing (bad magic or version, a payload
//     length over MaxPayload, a nonzero reserved field) ends the
//     connection, logged by the server with the peer and the field.
//     Everything else wrong with a request gets an error reply and the
//     connection goes on: an unknown op (StatusUnsupported), flags,
//     payload or range the op does not take (StatusEINVAL), a read over
//     MaxPayload (StatusTooBig).
//  3. The Handler sees only requests that passed the op table
//     (proto.go, check in server.go).
//  4. Memory follows bytes received, not lengths claimed: a payload
//     buffer larger than 4 MiB grows as its bytes arrive (at most twice
//     what has come), and a server connection holds at most
//     MaxInFlight requests and MaxInFlightBytes of payloads and read
//     lengths in service, from the header read until the reply is in
//     the connection's 64 KiB write buffer; its reader waits for room
//     before reading more. MaxConns bounds the connections.
//  5. No wait on a peer is unbounded once a message has started: a
//     payload must arrive, and a write complete, within 30 s
//     (ServerOptions.IOTimeout on a server), else the connection ends. Idle connections are kept (ServerOptions.
//     IdleTimeout ends them if set).
//  6. A Client's failed connection fails every pending call with an
//     error wrapping ErrConnection that names the peer; ErrNotSent is
//     added when the request was never written. A call whose context
//     ends is abandoned: its reply is read and dropped.
//  7. Every goroutine is tracked: Client.Close and Server.Shutdown
//     return after all of theirs have ended.
//
// Locking: Pool.mu before peer.mu; Client.mu and Server.mu are leaves.
// No lock is held across I/O: each connection has one reader and one
// writer goroutine, and callers and handlers hand them work over
// channels.
//
// Order for callers: a Server is NewServer, then Serve on each listener
// (wrapped with tls.NewListener for mutual TLS), then Shutdown. A
// gateway makes one Pool (NewPool with nil, or TLSDialer), calls
// Pool.Call per request, Drops the address of a node that left, and
// Closes it.
//
// Not done here: what an op means to a store (the node's Handler
// decides), epochs and fencing (carried, not checked), retries of
// calls that may have been applied (the gateway decides), and the
// hello exchange (OpHello is an ordinary op).
package protocol
