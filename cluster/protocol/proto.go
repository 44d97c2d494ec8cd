package protocol

import (
	"fmt"
	"hash/crc32"

	"github.com/ovis-storage/ovis/cluster/object"
)

// Magic opens every request and response header: "ovis" in ASCII.
const Magic uint32 = 0x6f766973

// Version is the protocol version a request header carries. A receiver
// closes a connection whose requests carry another version.
const Version uint8 = 1

// Header sizes on the wire.
const (
	RequestHeaderLen  = 64
	ResponseHeaderLen = 40
)

// Limits.
const (
	// MaxPayload bounds the payload of one request or response: one whole
	// object of the largest size (64 MiB, object.MaxSizeShift) plus 4 KiB
	// of room for the structured replies that describe one. A header
	// announcing more ends the connection.
	MaxPayload = 1<<object.MaxSizeShift + 4096

	// MaxErrorMsg bounds the UTF-8 message an error response carries.
	MaxErrorMsg = 1024

	// MaxHelloPayload bounds the payload of OpHello (the sender's name).
	MaxHelloPayload = 4096

	// MaxSettleIDs bounds the gate ids of one OpSettle: 8192 ids, 64 KiB
	// of payload.
	MaxSettleIDs = 8192
	// MaxSettlePayload is MaxSettleIDs ids of 8 bytes.
	MaxSettlePayload = 8 * MaxSettleIDs

	// MaxObjectSpan bounds offset+length of the ops that address bytes
	// of an object: no object is larger.
	MaxObjectSpan = 1 << object.MaxSizeShift
)

// castagnoli is the CRC32C table every payload checksum uses.
var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// Checksum returns the CRC32C (Castagnoli) of p, the checksum a header
// carries for its payload. The checksum of no bytes is 0.
func Checksum(p []byte) uint32 { return crc32.Checksum(p, castagnoli) }

// Op is a request's opcode, one byte on the wire.
type Op uint8

// Opcodes. The numbers are the wire values and never change; 0 is never
// valid.
const (
	OpHello       Op = 1  // name the sender, check the epoch; no effect
	OpRead        Op = 2  // read Length bytes at Offset of Object
	OpWrite       Op = 3  // write Payload at Offset of Object
	OpWriteZeroes Op = 4  // zero Length bytes at Offset
	OpDiscard     Op = 5  // deallocate Length bytes at Offset (reads as zeroes)
	OpRemove      Op = 6  // remove Object
	OpFlush       Op = 7  // make the VDI's acknowledged writes durable
	OpFence       Op = 8  // refuse the VDI's writes with a token below Token
	OpStat        Op = 9  // describe Object: one ObjectInfo
	OpList        Op = 10 // list the objects this node holds of a VDI (0: all), from ID Offset, at most Length
	OpChecksum    Op = 11 // CRC32C of Length bytes at Offset, and the version
	OpExtents     Op = 12 // allocated and hole ranges of Length bytes at Offset
	OpAdmin       Op = 13 // an admin command: a framed JSON request in Payload (cluster/node)
	// OpListFor lists, from ID Offset, the objects this node holds of
	// which the node named in Payload is a replica in the request's
	// epoch: recovery's question "what should I hold, and where is it".
	OpListFor Op = 14
	// OpSettle releases gated writes (FlagGated) of the VDI that Object
	// names: its payload lists gate ids (SettleIDs), which every replica
	// of their writes has acknowledged, or which the writer gave up on.
	OpSettle Op = 15
)

// maxOp is the highest opcode this version knows.
const maxOp = OpSettle

// bounds says how an op's Offset and Length are checked before a
// handler runs.
type bounds uint8

const (
	boundsNone   bounds = iota // Offset and Length carry nothing and must be 0
	boundsObject               // Offset+Length ≤ MaxObjectSpan
	boundsList                 // Offset is a cursor (first ID); Length ≤ MaxListEntries
	boundsCursor               // Offset is a cursor (first ID); Length is the payload's
	boundsSettle               // Offset 0; a payload of 1 to MaxSettleIDs gate ids
)

// opSpec is what the common checks know about one op. The table is the
// single place that says which ops carry a payload and take which flags.
type opSpec struct {
	name string
	// payload: the request carries a payload (OpWrite; OpHello
	// optionally). Any other op sent with one is refused with
	// StatusEINVAL.
	payload bool
	// maxPayload bounds the request payload when below MaxPayload.
	maxPayload int
	// readLen: Length is the size of the data the reply carries and is
	// bounded by MaxPayload (StatusTooBig).
	readLen bool
	bounds  bounds
	// flags are the flags valid on this op.
	flags Flags
	// write: the op changes data and is fenced by Token.
	write bool
	// object: the op is on one object's copy (Object names it).
	object bool
	// vdi: Object names a VDI or one of its objects (NamesVDI).
	vdi bool
	// noEpoch: the op's Epoch is not checked against the receiver's
	// (HELLO, admin, and settle, which only lets readers see what every
	// replica acknowledged, in any epoch).
	noEpoch bool
}

var ops = [...]opSpec{
	OpHello:       {name: "hello", payload: true, maxPayload: MaxHelloPayload, noEpoch: true},
	OpRead:        {name: "read", readLen: true, bounds: boundsObject, flags: FlagRecovery | FlagCurrent, object: true, vdi: true},
	OpWrite:       {name: "write", payload: true, bounds: boundsObject, flags: FlagSync | FlagGated, write: true, object: true, vdi: true},
	OpWriteZeroes: {name: "write-zeroes", bounds: boundsObject, flags: FlagSync | FlagNoUnmap | FlagGated, write: true, object: true, vdi: true},
	OpDiscard:     {name: "discard", bounds: boundsObject, flags: FlagSync | FlagGated, write: true, object: true, vdi: true},
	OpRemove:      {name: "remove", flags: FlagSync | FlagGated, write: true, object: true, vdi: true},
	OpFlush:       {name: "flush", vdi: true},
	OpFence:       {name: "fence", vdi: true},
	OpStat:        {name: "stat", flags: FlagRecovery, object: true, vdi: true},
	OpList:        {name: "list", bounds: boundsList},
	OpChecksum:    {name: "checksum", bounds: boundsObject, flags: FlagRecovery, object: true, vdi: true},
	OpExtents:     {name: "extents", bounds: boundsObject, flags: FlagRecovery | FlagCurrent, object: true, vdi: true},
	OpAdmin:       {name: "admin", payload: true, noEpoch: true},
	OpListFor:     {name: "list-for", payload: true, maxPayload: MaxHelloPayload, bounds: boundsCursor},
	OpSettle:      {name: "settle", payload: true, maxPayload: MaxSettlePayload, bounds: boundsSettle, vdi: true, noEpoch: true},
}

// Known reports whether this version of the protocol defines op.
func (op Op) Known() bool { return op >= 1 && op <= maxOp }

// Writes reports whether op changes an object's data, so that a
// receiver checks its fencing token.
func (op Op) Writes() bool { return op.Known() && ops[op].write }

// OnObject reports whether op is on one object's copy (Object names it):
// a receiver may have to recover the copy before serving it.
func (op Op) OnObject() bool { return op.Known() && ops[op].object }

// NamesVDI reports whether op's Object names a VDI or one of its
// objects; a storage node refuses VDI 0 for such an op (the protocol
// itself gives Object no meaning).
func (op Op) NamesVDI() bool { return op.Known() && ops[op].vdi }

// EpochChecked reports whether a receiver refuses op when its Epoch is
// not the receiver's own: every op but HELLO, admin and settle.
func (op Op) EpochChecked() bool { return op.Known() && !ops[op].noEpoch }

// Recovers reports whether req is recovery looking at the receiver's
// copies for its epoch: a listing for a node, or an op on an object
// with FlagRecovery.
func (req *Request) Recovers() bool {
	return req.Op == OpListFor || req.Op.OnObject() && req.Flags&FlagRecovery != 0
}

// String gives the op's lowercase name, or "op(N)" for an unknown op.
func (op Op) String() string {
	if op.Known() {
		return ops[op].name
	}
	return fmt.Sprintf("op(%d)", uint8(op))
}

// Flags is a request's flag word, two bytes on the wire.
type Flags uint16

const (
	// FlagSync asks that the op be durable before the reply, as NBD's
	// FUA. Valid on OpWrite, OpWriteZeroes, OpDiscard and OpRemove.
	FlagSync Flags = 1 << 0
	// FlagNoUnmap asks OpWriteZeroes to allocate the range rather than
	// deallocate it (NBD's NO_HOLE).
	FlagNoUnmap Flags = 1 << 1
	// FlagRecovery asks OpRead, OpExtents and OpChecksum for the copy
	// as the node holds it, suspect or not, without recovering it first
	// and past any gate: recovery reads the source it chose, as it is,
	// and a gate's release rule compares the copies as they are.
	FlagRecovery Flags = 1 << 2
	// FlagCurrent asks OpRead and OpExtents to be served only from a
	// copy already known current, and refused with StatusSuspect at once
	// otherwise, instead of recovering the copy first: the gateway then
	// reads another replica, and comes back without the flag only when
	// none is current.
	FlagCurrent Flags = 1 << 3
	// FlagGated marks a gateway's write (OpWrite, OpWriteZeroes,
	// OpDiscard, OpRemove) as gated: the replica keeps its range from
	// readers until an OpSettle names its gate id (Request.Gate, carried
	// in the header's version field).
	FlagGated Flags = 1 << 4

	// flagPayload is set by the encoder when Length bytes of payload
	// follow the header. It frames the stream: a receiver can skip the
	// payload of an op it does not know and keep the connection.
	flagPayload Flags = 1 << 15

	// knownFlags are the flags this version defines for callers.
	knownFlags = FlagSync | FlagNoUnmap | FlagRecovery | FlagCurrent | FlagGated
)

// String lists the flags by name, "sync|no-unmap", or "0".
func (f Flags) String() string {
	if f == 0 {
		return "0"
	}
	s := ""
	add := func(n string) {
		if s != "" {
			s += "|"
		}
		s += n
	}
	if f&FlagSync != 0 {
		add("sync")
	}
	if f&FlagNoUnmap != 0 {
		add("no-unmap")
	}
	if f&FlagRecovery != 0 {
		add("recovery")
	}
	if f&FlagCurrent != 0 {
		add("current")
	}
	if f&FlagGated != 0 {
		add("gated")
	}
	if rest := f &^ knownFlags; rest != 0 {
		add(fmt.Sprintf("%#x", uint16(rest)))
	}
	return s
}

// Status is a response's result, two bytes on the wire.
type Status uint16

// Statuses. The numbers are the wire values and never change.
const (
	StatusOK          Status = 0
	StatusEIO         Status = 1  // the receiver's disk failed
	StatusENOSPC      Status = 2  // the receiver has no room
	StatusEINVAL      Status = 3  // the request is malformed (bad flags, range, payload)
	StatusNoEnt       Status = 4  // no such object (or VDI)
	StatusOldEpoch    Status = 5  // the sender's epoch is older than the receiver's
	StatusNewEpoch    Status = 6  // the sender's epoch is newer: the receiver has not caught up
	StatusStaleToken  Status = 7  // the fencing token is below the VDI's fence
	StatusChecksum    Status = 8  // the request payload does not match its CRC32C
	StatusShutdown    Status = 9  // the receiver is shutting down
	StatusTooBig      Status = 10 // the reply would exceed MaxPayload
	StatusUnsupported Status = 11 // unknown op
	StatusSuspect     Status = 12 // the copy may be torn after a crash; not served
)

var statusNames = [...]string{
	StatusOK:          "ok",
	StatusEIO:         "I/O error",
	StatusENOSPC:      "no space",
	StatusEINVAL:      "invalid request",
	StatusNoEnt:       "no such object",
	StatusOldEpoch:    "old epoch",
	StatusNewEpoch:    "new epoch",
	StatusStaleToken:  "stale fencing token",
	StatusChecksum:    "checksum mismatch",
	StatusShutdown:    "shutting down",
	StatusTooBig:      "too big",
	StatusUnsupported: "unsupported",
	StatusSuspect:     "suspect copy",
}

// String gives the status's name, or "status(N)" for an unknown one.
func (s Status) String() string {
	if int(s) < len(statusNames) {
		return statusNames[s]
	}
	return fmt.Sprintf("status(%d)", uint16(s))
}
