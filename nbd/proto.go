package nbd

import "fmt"

// Wire constants of the NBD protocol (NetworkBlockDevice/nbd doc/proto.md).
// Every name is the spec's name in Go spelling, typed to its wire width;
// the spec's own name is in the comment. Integers are big-endian on the
// wire.

// Magic numbers.
const (
	nbdMagic             uint64 = 0x4e42444d41474943 // NBDMAGIC (INIT_PASSWD)
	optsMagic            uint64 = 0x49484156454F5054 // IHAVEOPT
	repMagic             uint64 = 0x3e889045565a9    // option reply magic
	requestMagic         uint32 = 0x25609513         // NBD_REQUEST_MAGIC
	simpleReplyMagic     uint32 = 0x67446698         // NBD_SIMPLE_REPLY_MAGIC
	structuredReplyMagic uint32 = 0x668e33ef         // NBD_STRUCTURED_REPLY_MAGIC
)

// handshakeFlags is the 16-bit field the server sends after IHAVEOPT.
type handshakeFlags uint16

const (
	flagFixedNewstyle handshakeFlags = 1 << 0 // NBD_FLAG_FIXED_NEWSTYLE
	flagNoZeroes      handshakeFlags = 1 << 1 // NBD_FLAG_NO_ZEROES
)

// clientFlags is the 32-bit field the client answers with.
type clientFlags uint32

const (
	flagCFixedNewstyle clientFlags = 1 << 0 // NBD_FLAG_C_FIXED_NEWSTYLE
	flagCNoZeroes      clientFlags = 1 << 1 // NBD_FLAG_C_NO_ZEROES

	knownClientFlags = flagCFixedNewstyle | flagCNoZeroes
)

// transmissionFlags is the 16-bit field sent with the export size.
type transmissionFlags uint16

const (
	flagHasFlags        transmissionFlags = 1 << 0  // NBD_FLAG_HAS_FLAGS
	flagReadOnly        transmissionFlags = 1 << 1  // NBD_FLAG_READ_ONLY
	flagSendFlush       transmissionFlags = 1 << 2  // NBD_FLAG_SEND_FLUSH
	flagSendFUA         transmissionFlags = 1 << 3  // NBD_FLAG_SEND_FUA
	flagRotational      transmissionFlags = 1 << 4  // NBD_FLAG_ROTATIONAL
	flagSendTrim        transmissionFlags = 1 << 5  // NBD_FLAG_SEND_TRIM
	flagSendWriteZeroes transmissionFlags = 1 << 6  // NBD_FLAG_SEND_WRITE_ZEROES
	flagSendDF          transmissionFlags = 1 << 7  // NBD_FLAG_SEND_DF
	flagCanMultiConn    transmissionFlags = 1 << 8  // NBD_FLAG_CAN_MULTI_CONN
	flagSendResize      transmissionFlags = 1 << 9  // NBD_FLAG_SEND_RESIZE
	flagSendCache       transmissionFlags = 1 << 10 // NBD_FLAG_SEND_CACHE
	flagSendFastZero    transmissionFlags = 1 << 11 // NBD_FLAG_SEND_FAST_ZERO
)

// optType is an option of the handshake phase.
type optType uint32

const (
	optExportName      optType = 1  // NBD_OPT_EXPORT_NAME
	optAbort           optType = 2  // NBD_OPT_ABORT
	optList            optType = 3  // NBD_OPT_LIST
	optPeekExport      optType = 4  // NBD_OPT_PEEK_EXPORT (withdrawn)
	optStartTLS        optType = 5  // NBD_OPT_STARTTLS
	optInfo            optType = 6  // NBD_OPT_INFO
	optGo              optType = 7  // NBD_OPT_GO
	optStructuredReply optType = 8  // NBD_OPT_STRUCTURED_REPLY
	optListMetaContext optType = 9  // NBD_OPT_LIST_META_CONTEXT
	optSetMetaContext  optType = 10 // NBD_OPT_SET_META_CONTEXT
	optExtendedHeaders optType = 11 // NBD_OPT_EXTENDED_HEADERS (not supported)
)

func (o optType) String() string {
	switch o {
	case optExportName:
		return "EXPORT_NAME"
	case optAbort:
		return "ABORT"
	case optList:
		return "LIST"
	case optPeekExport:
		return "PEEK_EXPORT"
	case optStartTLS:
		return "STARTTLS"
	case optInfo:
		return "INFO"
	case optGo:
		return "GO"
	case optStructuredReply:
		return "STRUCTURED_REPLY"
	case optListMetaContext:
		return "LIST_META_CONTEXT"
	case optSetMetaContext:
		return "SET_META_CONTEXT"
	case optExtendedHeaders:
		return "EXTENDED_HEADERS"
	}
	return fmt.Sprintf("OPT_%d", uint32(o))
}

// repType is the type of an option reply. Errors have bit 31 set.
type repType uint32

const (
	repAck         repType = 1 // NBD_REP_ACK
	repServer      repType = 2 // NBD_REP_SERVER
	repInfo        repType = 3 // NBD_REP_INFO
	repMetaContext repType = 4 // NBD_REP_META_CONTEXT

	repFlagError        repType = 1 << 31
	repErrUnsup         repType = repFlagError | 1 // NBD_REP_ERR_UNSUP
	repErrPolicy        repType = repFlagError | 2 // NBD_REP_ERR_POLICY
	repErrInvalid       repType = repFlagError | 3 // NBD_REP_ERR_INVALID
	repErrPlatform      repType = repFlagError | 4 // NBD_REP_ERR_PLATFORM
	repErrTLSReqd       repType = repFlagError | 5 // NBD_REP_ERR_TLS_REQD
	repErrUnknown       repType = repFlagError | 6 // NBD_REP_ERR_UNKNOWN
	repErrShutdown      repType = repFlagError | 7 // NBD_REP_ERR_SHUTDOWN
	repErrBlockSizeReqd repType = repFlagError | 8 // NBD_REP_ERR_BLOCK_SIZE_REQD
	repErrTooBig        repType = repFlagError | 9 // NBD_REP_ERR_TOO_BIG
)

// infoType is an information item of NBD_REP_INFO.
type infoType uint16

const (
	infoExport      infoType = 0 // NBD_INFO_EXPORT
	infoName        infoType = 1 // NBD_INFO_NAME
	infoDescription infoType = 2 // NBD_INFO_DESCRIPTION
	infoBlockSize   infoType = 3 // NBD_INFO_BLOCK_SIZE
)

// cmdType is the type of a transmission request.
type cmdType uint16

const (
	cmdRead        cmdType = 0 // NBD_CMD_READ
	cmdWrite       cmdType = 1 // NBD_CMD_WRITE
	cmdDisc        cmdType = 2 // NBD_CMD_DISC
	cmdFlush       cmdType = 3 // NBD_CMD_FLUSH
	cmdTrim        cmdType = 4 // NBD_CMD_TRIM
	cmdCache       cmdType = 5 // NBD_CMD_CACHE
	cmdWriteZeroes cmdType = 6 // NBD_CMD_WRITE_ZEROES
	cmdBlockStatus cmdType = 7 // NBD_CMD_BLOCK_STATUS
	cmdResize      cmdType = 8 // NBD_CMD_RESIZE (not supported)
)

func (c cmdType) String() string {
	if int(c) < len(commands) && commands[c].name != "" {
		return commands[c].name
	}
	return fmt.Sprintf("CMD_%d", uint16(c))
}

// cmdFlags is the 16-bit flags field of a request.
type cmdFlags uint16

const (
	cmdFlagFUA      cmdFlags = 1 << 0 // NBD_CMD_FLAG_FUA
	cmdFlagNoHole   cmdFlags = 1 << 1 // NBD_CMD_FLAG_NO_HOLE
	cmdFlagDF       cmdFlags = 1 << 2 // NBD_CMD_FLAG_DF
	cmdFlagReqOne   cmdFlags = 1 << 3 // NBD_CMD_FLAG_REQ_ONE
	cmdFlagFastZero cmdFlags = 1 << 4 // NBD_CMD_FLAG_FAST_ZERO
)

// replyFlags is the 16-bit flags field of a structured reply chunk.
type replyFlags uint16

const replyFlagDone replyFlags = 1 << 0 // NBD_REPLY_FLAG_DONE

// replyType is the type of a structured reply chunk. Error chunks have
// bit 15 set.
type replyType uint16

const (
	replyTypeNone        replyType = 0         // NBD_REPLY_TYPE_NONE
	replyTypeOffsetData  replyType = 1         // NBD_REPLY_TYPE_OFFSET_DATA
	replyTypeOffsetHole  replyType = 2         // NBD_REPLY_TYPE_OFFSET_HOLE
	replyTypeBlockStatus replyType = 5         // NBD_REPLY_TYPE_BLOCK_STATUS
	replyTypeError       replyType = 1<<15 | 1 // NBD_REPLY_TYPE_ERROR
	replyTypeErrorOffset replyType = 1<<15 | 2 // NBD_REPLY_TYPE_ERROR_OFFSET
)

// Block status flags of the base:allocation context.
const (
	stateHole uint32 = 1 << 0 // NBD_STATE_HOLE
	stateZero uint32 = 1 << 1 // NBD_STATE_ZERO
)

// Sizes on the wire.
const (
	optHeaderLen         = 16 // IHAVEOPT, option, length
	requestHeaderLen     = 28 // magic, flags, type, handle, offset, length
	simpleReplyLen       = 16 // magic, error, handle
	structuredHeaderLen  = 20 // magic, flags, type, handle, length
	exportNameZeroPadLen = 124
)

// Limits from the spec.
const (
	// maxStringLen is the longest string (export name, description,
	// error message, context name) the spec allows.
	maxStringLen = 4096
	// defaultMaxPayload is 2^25, the largest READ/WRITE any client may
	// expect a server to take without advertising block sizes, and the
	// size below which a payload is never a denial of service.
	defaultMaxPayload = 32 << 20
	// maxDFRead is the smallest unfragmented read a server must support.
	maxDFRead = 64 << 10
)

// Metadata context names this server supports.
const (
	contextBaseAllocation = "base:allocation"
	contextAllocDepth     = "qemu:allocation-depth"
	contextDirtyBitmap    = "qemu:dirty-bitmap:"
	// stateDirty is the qemu:dirty-bitmap flag of a dirty range.
	stateDirty = 1
)

// Errno is an NBD error value, as sent in the error field of a reply. The
// values are the spec's, not the host's errno. A Device may return an
// Errno (or wrap one) to choose the error a client sees.
type Errno uint32

// NBD error values.
const (
	EPERM     Errno = 1   // NBD_EPERM: operation not permitted
	EIO       Errno = 5   // NBD_EIO: input/output error
	ENOMEM    Errno = 12  // NBD_ENOMEM: cannot allocate memory
	EINVAL    Errno = 22  // NBD_EINVAL: invalid argument
	ENOSPC    Errno = 28  // NBD_ENOSPC: no space left on device
	EOVERFLOW Errno = 75  // NBD_EOVERFLOW: value too large
	ENOTSUP   Errno = 95  // NBD_ENOTSUP: operation not supported
	ESHUTDOWN Errno = 108 // NBD_ESHUTDOWN: server is shutting down
)

func (e Errno) Error() string {
	switch e {
	case 0:
		return "nbd: success"
	case EPERM:
		return "nbd: EPERM (operation not permitted)"
	case EIO:
		return "nbd: EIO (input/output error)"
	case ENOMEM:
		return "nbd: ENOMEM (cannot allocate memory)"
	case EINVAL:
		return "nbd: EINVAL (invalid argument)"
	case ENOSPC:
		return "nbd: ENOSPC (no space left on device)"
	case EOVERFLOW:
		return "nbd: EOVERFLOW (value too large)"
	case ENOTSUP:
		return "nbd: ENOTSUP (operation not supported)"
	case ESHUTDOWN:
		return "nbd: ESHUTDOWN (server is shutting down)"
	}
	return fmt.Sprintf("nbd: error %d", uint32(e))
}
