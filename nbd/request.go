package nbd

import "encoding/binary"

// request is one decoded transmission request header.
type request struct {
	flags  cmdFlags
	typ    cmdType
	handle uint64
	offset uint64
	length uint32
}

// parseRequest decodes a 28-byte request header. It reports false when
// the magic is wrong: the stream is then out of sync and the connection
// must end.
func parseRequest(b *[requestHeaderLen]byte) (request, bool) {
	if binary.BigEndian.Uint32(b[0:4]) != requestMagic {
		return request{}, false
	}
	return request{
		flags:  cmdFlags(binary.BigEndian.Uint16(b[4:6])),
		typ:    cmdType(binary.BigEndian.Uint16(b[6:8])),
		handle: binary.BigEndian.Uint64(b[8:16]),
		offset: binary.BigEndian.Uint64(b[16:24]),
		length: binary.BigEndian.Uint32(b[24:28]),
	}, true
}

// boundsCheck is how a command's offset and length are checked.
type boundsCheck uint8

const (
	// boundsNone: offset and length carry no range (DISC).
	boundsNone boundsCheck = iota
	// boundsRead: the range must lie inside the export, else EINVAL
	// (READ, TRIM, CACHE, BLOCK_STATUS).
	boundsRead
	// boundsWrite: the range must lie inside the export, else ENOSPC
	// (WRITE, WRITE_ZEROES).
	boundsWrite
	// boundsZero: offset and length are reserved and must be zero
	// (FLUSH), else EINVAL.
	boundsZero
)

// cmdSpec is what the common checks need to know about one command. The
// table is the single place that says which commands carry a payload,
// which need write access and which flags they take.
type cmdSpec struct {
	name string
	// payload: length bytes of data follow the header (WRITE only). A
	// command without it never has bytes read after its header.
	payload bool
	// write: the command changes the export; EPERM on a read-only one.
	write bool
	// bounds says how offset and length are checked.
	bounds boundsCheck
	// maxLen: length is bounded by the maximum payload (READ, WRITE).
	maxLen bool
	// flags are the command flags valid on this command besides FUA,
	// which the spec allows on every command once SEND_FUA is
	// advertised.
	flags cmdFlags
	// needs is the transmission flag that must have been advertised for
	// the command to be valid; 0 when none is needed.
	needs transmissionFlags
	// needsContext: at least one metadata context must have been
	// negotiated (BLOCK_STATUS).
	needsContext bool
}

// commands is the per-command table; a zero entry (no name) is an
// unknown command.
var commands = [...]cmdSpec{
	cmdRead:        {name: "READ", bounds: boundsRead, maxLen: true, flags: cmdFlagDF},
	cmdWrite:       {name: "WRITE", payload: true, write: true, bounds: boundsWrite, maxLen: true},
	cmdDisc:        {name: "DISC"},
	cmdFlush:       {name: "FLUSH", bounds: boundsZero, needs: flagSendFlush},
	cmdTrim:        {name: "TRIM", write: true, bounds: boundsRead, needs: flagSendTrim},
	cmdCache:       {name: "CACHE", bounds: boundsRead, needs: flagSendCache},
	cmdWriteZeroes: {name: "WRITE_ZEROES", write: true, bounds: boundsWrite, flags: cmdFlagNoHole | cmdFlagFastZero, needs: flagSendWriteZeroes},
	cmdBlockStatus: {name: "BLOCK_STATUS", bounds: boundsRead, flags: cmdFlagReqOne, needsContext: true},
}

// lookupCmd returns the table entry of t and whether t is known.
func lookupCmd(t cmdType) (cmdSpec, bool) {
	if int(t) >= len(commands) || commands[t].name == "" {
		return cmdSpec{}, false
	}
	return commands[t], true
}

// flagNeeds maps each command flag to the transmission flag that must
// have been advertised before a client may set it.
var flagNeeds = [...]struct {
	flag  cmdFlags
	needs transmissionFlags
}{
	{cmdFlagFUA, flagSendFUA},
	{cmdFlagNoHole, flagSendWriteZeroes},
	{cmdFlagDF, flagSendDF},
	{cmdFlagReqOne, 0},
	{cmdFlagFastZero, flagSendFastZero},
}

// session is what validation knows about a connection in transmission:
// the export's size, the flags advertised for it, the largest payload and
// how many metadata contexts were negotiated.
type session struct {
	size       uint64
	flags      transmissionFlags
	maxPayload uint32
	contexts   int
}

// validate runs the common checks on a request header before any handler
// runs and returns the error to reply with, or 0. It is a pure function
// of the request and the session. The checks, in order: unknown command
// (EINVAL); a write command on a read-only export (EPERM); a command
// whose transmission flag was not advertised (EINVAL); a flag unknown, not
// valid on the command or not advertised (EINVAL); BLOCK_STATUS without a
// metadata context (EINVAL); a READ or WRITE longer than the maximum
// payload (EINVAL; the spec reserves EOVERFLOW for DF reads); then the
// range: past the end is ENOSPC for WRITE and WRITE_ZEROES and EINVAL
// otherwise, and FLUSH must carry zero offset and length (EINVAL).
//
// validate does not decide whether a WRITE's payload can be skipped: the
// caller reads (or discards) every WRITE payload whatever validate says,
// because the stream must stay in sync.
func validate(r request, s session) Errno {
	spec, ok := lookupCmd(r.typ)
	if !ok {
		return EINVAL
	}
	if spec.write && s.flags&flagReadOnly != 0 {
		return EPERM
	}
	if spec.needs != 0 && s.flags&spec.needs == 0 {
		return EINVAL
	}
	allowed := spec.flags | cmdFlagFUA
	if r.flags&^allowed != 0 {
		return EINVAL
	}
	for _, f := range flagNeeds {
		if r.flags&f.flag != 0 && f.needs != 0 && s.flags&f.needs == 0 {
			return EINVAL
		}
	}
	if spec.needsContext && s.contexts == 0 {
		return EINVAL
	}
	if spec.maxLen && r.length > s.maxPayload {
		return EINVAL
	}
	switch spec.bounds {
	case boundsRead, boundsWrite:
		if r.offset > s.size || uint64(r.length) > s.size-r.offset {
			if spec.bounds == boundsWrite {
				return ENOSPC
			}
			return EINVAL
		}
	case boundsZero:
		if r.offset != 0 || r.length != 0 {
			return EINVAL
		}
	}
	if r.typ == cmdBlockStatus && r.length == 0 {
		// A zero-length query has no extent to describe, and a reply
		// must carry at least one extent of nonzero length.
		return EINVAL
	}
	return 0
}

// payloadLen returns how many bytes follow the header of r on the wire.
// Unknown commands carry none: a client sending one with a payload is out
// of sync, which the next header's magic will show.
func payloadLen(r request) uint32 {
	if spec, ok := lookupCmd(r.typ); ok && spec.payload {
		return r.length
	}
	return 0
}
