// Package admin is the cluster's admin plane: every verb an operator
// (ovis node list, ovis cluster …, ovis vdi …) or another node can ask of
// a node, each declared once as a Call with one request and one reply
// type, a Client that sends them and Serve, which decodes a request and
// hands it to the node's Handler by verb.
//
// The wire is the node protocol's OpAdmin, so that `ovis … -a HOST:PORT`
// needs nothing but a node's address, as Sheepdog's dog does. A request's
// payload is a 4-byte big-endian length, a JSON object of that length and
// raw bytes (the data of vdi.write); the JSON object is the request's
// fields plus "cmd", the verb. A reply's payload is framed the same way,
// with the reply's JSON and raw bytes (the data of vdi.read). A refused
// request is a non-OK status whose payload is the error's text. The field
// names are those of the union the plane had before it was typed, so
// nodes and command lines of either side of that change understand each
// other.
//
// Files, by concern:
//
//   - verbs.go: Verb, Call, every declared call, Handler, the routes
//   - types.go: the request and reply types that are not membership's
//   - codec.go: the payload's framing
//   - client.go: Client (Dial for the command line, Via for a node)
//   - server.go: Serve, UnknownVerbError, the status of a refusal
//
// Invariants:
//
//  1. A verb's name, its request type and its reply type are written
//     once, in a Call of verbs.go; the client and the server both use
//     that Call, so they cannot disagree on a type.
//  2. Every Call has exactly one route to one Handler method; a verb with
//     no route is refused with an UnknownVerbError that names it, never
//     served by a default.
//  3. Domain rules (names, sizes, copies against zones, format defaults)
//     are membership's: the Handler calls membership, and this package
//     checks only the framing and the limits of the plane itself
//     (MaxData).
//  4. The JSON field names of requests and replies are part of the
//     command line's --output=json and of the wire; they do not change.
//
// Node-to-node calls. Some verbs are asked by nodes of each other (a
// node's status for node list, recovery's unfound objects and kick for
// mark-lost) or by `ovis cluster check --repair` of single nodes
// (object.recover, object.replace, object.drop, vdi.purge). They stay on
// the admin plane, as typed calls of their own (the Peer block of
// verbs.go), rather than becoming node-protocol ops: each is rare, small
// and answered with a sentence or a JSON value, which is what this plane
// carries, while the node protocol's op table is for object I/O with
// fixed binary headers, epochs and fencing tokens that none of these
// need. Repair is run from the command line against any node, which
// already speaks this plane; and adding ops would widen the per-op table
// that the data path checks on every request.
//
// Not done here: the rules themselves (membership), the check and
// repair drivers (cluster/node), printing (cmd/ovis).
package admin
