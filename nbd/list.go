package nbd

import (
	"bufio"
	"crypto/tls"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math/bits"
	"net"
	"strings"
	"syscall"
)

// The client side of listing a server's exports, as `qemu-nbd --list`
// (QEMU 7.2's nbd_receive_export_list) does it: the fixed newstyle
// handshake, STRUCTURED_REPLY, NBD_OPT_LIST, then NBD_OPT_INFO and
// NBD_OPT_LIST_META_CONTEXT for each export, and NBD_OPT_ABORT. An
// oldstyle server's one export is read from its greeting. Errors are
// QEMU's messages, so that a command can print them as qemu-nbd does.

// ExportInfo is what a server tells about one of its exports without
// entering transmission.
type ExportInfo struct {
	Name string
	// Description is empty when the server sent none.
	Description string
	// Size and Flags come from NBD_INFO_EXPORT; Flags (the transmission
	// flags) is 0 when the server answered no NBD_OPT_INFO.
	Size  uint64
	Flags uint16
	// MinBlock, OptBlock and MaxBlock come from NBD_INFO_BLOCK_SIZE; 0
	// when the server sent none.
	MinBlock, OptBlock, MaxBlock uint32
	// Contexts are the metadata contexts NBD_OPT_LIST_META_CONTEXT
	// listed, in the server's order; none without structured replies.
	Contexts []string
}

// Constants of the listing client.
const (
	// clientMagic is the oldstyle greeting's second magic
	// (NBD_CLIENT_MAGIC).
	clientMagic uint64 = 0x0000420281861253
	// maxBufferSize is QEMU's NBD_MAX_BUFFER_SIZE, the longest option
	// reply it reads.
	maxBufferSize = 32 << 20
)

// ListExports lists the exports of the server at the other end of conn,
// as qemu-nbd --list does, and sends NBD_OPT_ABORT. It does not close
// conn. The errors read as QEMU's: "Failed to read initial magic:
// Unexpected end-of-file before all data were read", "Bad server magic
// received: 0x1", "Server does not support export lists", a refusal with
// the server's message on hint lines, and so on. TLS is not supported: a
// server that requires it refuses the listing.
//
// With tlsConfig set, the client starts TLS (NBD_OPT_STARTTLS) before
// anything else, as qemu-nbd --tls-creds does; the config's ServerName is
// the name the server's certificate must carry.
func ListExports(conn net.Conn, tlsConfig *tls.Config) ([]ExportInfo, error) {
	c := &listClient{conn: conn, r: bufio.NewReader(conn), w: conn, tls: tlsConfig}
	return c.list()
}

// listClient is one listing connection. Not safe for concurrent use.
type listClient struct {
	conn net.Conn
	r    *bufio.Reader
	w    io.Writer
	tls  *tls.Config
}

// startTLS is nbd_receive_starttls: STARTTLS, then the TLS handshake; the
// rest of the listing goes over TLS.
func (c *listClient) startTLS() error {
	ok, err := c.simpleOption(optStartTLS, true)
	if err != nil {
		return err
	}
	if !ok {
		c.abort()
		return errors.New("Server don't support STARTTLS option")
	}
	tc := tls.Client(c.conn, c.tls)
	if err := tc.Handshake(); err != nil {
		return fmt.Errorf("TLS handshake failed: %w", err)
	}
	c.r, c.w = bufio.NewReader(tc), tc
	return nil
}

// read fills p; what names the field in the error, as QEMU's nbd_read.
func (c *listClient) read(p []byte, what string) error {
	if _, err := io.ReadFull(c.r, p); err != nil {
		msg := "Unexpected end-of-file before all data were read"
		if !errors.Is(err, io.EOF) && !errors.Is(err, io.ErrUnexpectedEOF) {
			msg = "Unable to read from socket: " + sysMessage(err)
		}
		if what == "" {
			return errors.New(msg)
		}
		return fmt.Errorf("Failed to read %s: %s", what, msg)
	}
	return nil
}

func (c *listClient) read16(what string) (uint16, error) {
	var b [2]byte
	err := c.read(b[:], what)
	return binary.BigEndian.Uint16(b[:]), err
}

func (c *listClient) read32(what string) (uint32, error) {
	var b [4]byte
	err := c.read(b[:], what)
	return binary.BigEndian.Uint32(b[:]), err
}

func (c *listClient) read64(what string) (uint64, error) {
	var b [8]byte
	err := c.read(b[:], what)
	return binary.BigEndian.Uint64(b[:]), err
}

// drop reads and discards n bytes.
func (c *listClient) drop(n uint32) error {
	if _, err := io.CopyN(io.Discard, c.r, int64(n)); err != nil {
		return c.read(nil, "") // the EOF message
	}
	return nil
}

func (c *listClient) write(p []byte) error {
	if _, err := c.w.Write(p); err != nil {
		return errors.New("Unable to write to socket: " + sysMessage(err))
	}
	return nil
}

// sendOption sends option opt with its data.
func (c *listClient) sendOption(opt optType, data []byte) error {
	b := make([]byte, optHeaderLen, optHeaderLen+len(data))
	binary.BigEndian.PutUint64(b, optsMagic)
	binary.BigEndian.PutUint32(b[8:], uint32(opt))
	binary.BigEndian.PutUint32(b[12:], uint32(len(data)))
	if err := c.write(b); err != nil {
		return fmt.Errorf("Failed to send option request header: %w", err)
	}
	if len(data) > 0 {
		if err := c.write(data); err != nil {
			return fmt.Errorf("Failed to send option request data: %w", err)
		}
	}
	return nil
}

// abort sends NBD_OPT_ABORT as a courtesy, ignoring errors and the reply.
func (c *listClient) abort() { c.sendOption(optAbort, nil) }

// listReply is an option reply's header.
type listReply struct {
	opt    optType
	typ    repType
	length uint32
}

// receiveReply reads the header of a reply to opt.
func (c *listClient) receiveReply(opt optType) (listReply, error) {
	var b [20]byte
	if err := c.read(b[:], "option reply"); err != nil {
		c.abort()
		return listReply{}, err
	}
	r := listReply{
		opt:    optType(binary.BigEndian.Uint32(b[8:])),
		typ:    repType(binary.BigEndian.Uint32(b[12:])),
		length: binary.BigEndian.Uint32(b[16:]),
	}
	if binary.BigEndian.Uint64(b[:]) != repMagic {
		c.abort()
		return r, errors.New("Unexpected option reply magic")
	}
	if r.opt != opt {
		c.abort()
		return r, fmt.Errorf("Unexpected option type %d (%s), expected %d (%s)", uint32(r.opt), optName(r.opt), uint32(opt), optName(opt))
	}
	return r, nil
}

// handleReplyErr is QEMU's nbd_handle_reply_err: it returns true for a
// reply that is no error; for an error it reads the message and returns
// false with a nil error when the option is merely unsupported (any error
// when not strict), else false and the error, with the server's message
// as a hint line.
func (c *listClient) handleReplyErr(r listReply, strict bool) (bool, error) {
	if r.typ&repFlagError == 0 {
		return true, nil
	}
	var msg string
	if r.length > 0 {
		if r.length > maxBufferSize {
			c.abort()
			return false, fmt.Errorf("server error %d (%s) message is too long", uint32(r.typ), repName(r.typ))
		}
		b := make([]byte, r.length)
		if err := c.read(b, ""); err != nil {
			c.abort()
			return false, fmt.Errorf("Failed to read option error %d (%s) message: %w", uint32(r.typ), repName(r.typ), err)
		}
		msg = cString(b)
	}
	if r.typ == repErrUnsup || !strict {
		return false, nil
	}
	var text string
	name := fmt.Sprintf("%d (%s)", uint32(r.opt), optName(r.opt))
	switch r.typ {
	case repErrPolicy:
		text = "Denied by server for option " + name
	case repErrInvalid:
		text = "Invalid parameters for option " + name
	case repErrPlatform:
		text = "Server lacks support for option " + name
	case repErrTLSReqd:
		text = "TLS negotiation required before option " + name + "\nDid you forget a valid tls-creds?"
	case repErrUnknown:
		text = "Requested export not available"
	case repErrShutdown:
		text = "Server shutting down before option " + name
	case repErrBlockSizeReqd:
		text = "Server requires INFO_BLOCK_SIZE for option " + name
	default:
		text = "Unknown error code when asking for option " + name
	}
	if r.length > 0 {
		text += "\nserver reported: " + msg
	}
	c.abort()
	return false, errors.New(text)
}

// cString is b up to its first NUL, as C prints it.
func cString(b []byte) string {
	s, _, _ := strings.Cut(string(b), "\x00")
	return s
}

// list is nbd_receive_export_list.
func (c *listClient) list() ([]ExportInfo, error) {
	magic, err := c.read64("initial magic")
	if err != nil {
		return nil, err
	}
	if magic != nbdMagic {
		return nil, fmt.Errorf("Bad initial magic received: 0x%x", magic)
	}
	if magic, err = c.read64("server magic"); err != nil {
		return nil, err
	}
	switch magic {
	case clientMagic:
		if c.tls != nil {
			return nil, errors.New("Server does not support STARTTLS")
		}
		return c.oldstyle()
	case optsMagic:
	default:
		return nil, fmt.Errorf("Bad server magic received: 0x%x", magic)
	}
	gflags, err := c.read16("server flags")
	if err != nil {
		return nil, err
	}
	var cflags clientFlags
	if handshakeFlags(gflags)&flagFixedNewstyle != 0 {
		cflags |= flagCFixedNewstyle
	}
	if handshakeFlags(gflags)&flagNoZeroes != 0 {
		cflags |= flagCNoZeroes
	}
	var b [4]byte
	binary.BigEndian.PutUint32(b[:], uint32(cflags))
	if err := c.write(b[:]); err != nil {
		return nil, fmt.Errorf("Failed to send clientflags field: %w", err)
	}
	if c.tls != nil {
		if cflags&flagCFixedNewstyle == 0 {
			return nil, errors.New("Server does not support STARTTLS")
		}
		if err := c.startTLS(); err != nil {
			return nil, err
		}
	}
	if cflags&flagCFixedNewstyle == 0 {
		// Without fixed newstyle not even NBD_OPT_ABORT can be sent.
		return nil, errors.New("Server does not support export lists")
	}
	structured, err := c.simpleOption(optStructuredReply, false)
	if err != nil {
		return nil, err
	}

	if err := c.sendOption(optList, nil); err != nil {
		return nil, err
	}
	var out []ExportInfo
	for {
		e, more, err := c.receiveList()
		if err != nil {
			return nil, err
		}
		if !more {
			break
		}
		out = append(out, e)
	}
	for i := range out {
		ok, err := c.info(&out[i])
		if err != nil {
			return nil, err
		}
		if !ok {
			// A server without NBD_OPT_INFO is unlikely to list
			// contexts either.
			break
		}
		if structured {
			if out[i].Contexts, err = c.metaContexts(out[i].Name); err != nil {
				return nil, err
			}
		}
	}
	c.abort()
	return out, nil
}

// oldstyle reads an oldstyle server's one export and sends NBD_CMD_DISC.
func (c *listClient) oldstyle() ([]ExportInfo, error) {
	size, err := c.read64("export length")
	if err != nil {
		return nil, err
	}
	flags, err := c.read32("export flags")
	if err != nil {
		return nil, err
	}
	if flags&^0xffff != 0 {
		return nil, fmt.Errorf("Unexpected export flags %0x", flags)
	}
	if c.drop(exportNameZeroPadLen) == nil {
		var req [requestHeaderLen]byte
		binary.BigEndian.PutUint32(req[:], requestMagic)
		binary.BigEndian.PutUint16(req[6:], uint16(cmdDisc))
		c.write(req[:])
	}
	return []ExportInfo{{Size: size, Flags: uint16(flags)}}, nil
}

// simpleOption sends an option without data that the server should ACK,
// as QEMU's nbd_request_simple_option: an unsupported option (any error
// reply, unless strict) returns false and no error.
func (c *listClient) simpleOption(opt optType, strict bool) (bool, error) {
	if err := c.sendOption(opt, nil); err != nil {
		return false, err
	}
	r, err := c.receiveReply(opt)
	if err != nil {
		return false, err
	}
	if ok, err := c.handleReplyErr(r, strict); !ok {
		return false, err
	}
	if r.typ != repAck {
		c.abort()
		return false, fmt.Errorf("Server answered option %d (%s) with unexpected reply %d (%s)", uint32(opt), optName(opt), uint32(r.typ), repName(r.typ))
	}
	if r.length != 0 {
		c.abort()
		return false, fmt.Errorf("Option %d ('%s') response length is %d (it should be zero)", uint32(opt), optName(opt), r.length)
	}
	return true, nil
}

// receiveList reads one reply to NBD_OPT_LIST: an export, or the end
// (more false), which an unsupported NBD_OPT_LIST also is.
func (c *listClient) receiveList() (e ExportInfo, more bool, err error) {
	r, err := c.receiveReply(optList)
	if err != nil {
		return e, false, err
	}
	if ok, err := c.handleReplyErr(r, true); !ok {
		return e, false, err
	}
	switch r.typ {
	case repAck:
		if r.length != 0 {
			c.abort()
			return e, false, errors.New("length too long for option end")
		}
		return e, false, nil
	case repServer:
	default:
		c.abort()
		return e, false, fmt.Errorf("Unexpected reply type %d (%s), expected %d (%s)", uint32(r.typ), repName(r.typ), uint32(repServer), repName(repServer))
	}
	n := r.length
	if n < 4 || n > maxBufferSize {
		c.abort()
		return e, false, fmt.Errorf("incorrect option length %d", n)
	}
	nameLen, err := c.read32("option name length")
	if err != nil {
		c.abort()
		return e, false, err
	}
	n -= 4
	if n < nameLen || nameLen > maxStringLen {
		c.abort()
		return e, false, errors.New("incorrect name length in server's list response")
	}
	name := make([]byte, nameLen)
	if err := c.read(name, "export name"); err != nil {
		c.abort()
		return e, false, err
	}
	n -= nameLen
	e.Name = cString(name)
	if n > 0 {
		if n > maxStringLen {
			c.abort()
			return e, false, errors.New("incorrect description length in server's list response")
		}
		desc := make([]byte, n)
		if err := c.read(desc, "export description"); err != nil {
			c.abort()
			return e, false, err
		}
		e.Description = cString(desc)
	}
	return e, true, nil
}

// info sends NBD_OPT_INFO for e.Name, asking for the block sizes, and
// fills e from the replies. It returns false when the server does not
// support the option.
func (c *listClient) info(e *ExportInfo) (bool, error) {
	if len(e.Name) > maxStringLen {
		return false, errors.New("export name too long")
	}
	data := binary.BigEndian.AppendUint32(nil, uint32(len(e.Name)))
	data = append(data, e.Name...)
	data = binary.BigEndian.AppendUint16(data, 1)
	data = binary.BigEndian.AppendUint16(data, uint16(infoBlockSize))
	if err := c.sendOption(optInfo, data); err != nil {
		return false, err
	}
	e.Flags = 0
	for {
		r, err := c.receiveReply(optInfo)
		if err != nil {
			return false, err
		}
		if ok, err := c.handleReplyErr(r, true); !ok {
			return false, err
		}
		if r.typ == repAck {
			if r.length != 0 {
				return false, errors.New("server sent invalid NBD_REP_ACK")
			}
			if e.Flags == 0 {
				return false, errors.New("broken server omitted NBD_INFO_EXPORT")
			}
			return true, nil
		}
		if r.typ != repInfo {
			c.abort()
			return false, fmt.Errorf("unexpected reply type %d (%s), expected %d (%s)", uint32(r.typ), repName(r.typ), uint32(repInfo), repName(repInfo))
		}
		if r.length < 2 {
			c.abort()
			return false, fmt.Errorf("NBD_REP_INFO length %d is too short", r.length)
		}
		typ, err := c.read16("info type")
		if err != nil {
			c.abort()
			return false, err
		}
		n := r.length - 2
		if err := c.infoItem(e, infoType(typ), n); err != nil {
			c.abort()
			return false, err
		}
	}
}

// infoItem reads the n bytes of one NBD_REP_INFO item of type typ into e.
func (c *listClient) infoItem(e *ExportInfo, typ infoType, n uint32) error {
	switch typ {
	case infoExport:
		if n != 10 {
			return fmt.Errorf("remaining export info len %d is unexpected size", n)
		}
		var err error
		if e.Size, err = c.read64("info size"); err != nil {
			return err
		}
		if e.Flags, err = c.read16("info flags"); err != nil {
			return err
		}
		if e.MinBlock != 0 && e.Size%uint64(e.MinBlock) != 0 {
			return fmt.Errorf("export size %d is not multiple of minimum block size %d", e.Size, e.MinBlock)
		}
	case infoBlockSize:
		if n != 12 {
			return fmt.Errorf("remaining export info len %d is unexpected size", n)
		}
		var err error
		if e.MinBlock, err = c.read32("info minimum block size"); err != nil {
			return err
		}
		if bits.OnesCount32(e.MinBlock) != 1 {
			return fmt.Errorf("server minimum block size %d is not a power of two", e.MinBlock)
		}
		if e.OptBlock, err = c.read32("info preferred block size"); err != nil {
			return err
		}
		if bits.OnesCount32(e.OptBlock) != 1 || e.OptBlock < e.MinBlock {
			return fmt.Errorf("server preferred block size %d is not valid", e.OptBlock)
		}
		if e.MaxBlock, err = c.read32("info maximum block size"); err != nil {
			return err
		}
		if e.MaxBlock < e.MinBlock {
			return fmt.Errorf("server maximum block size %d is not valid", e.MaxBlock)
		}
	default:
		// The name and description items are not shown.
		if err := c.drop(n); err != nil {
			return fmt.Errorf("Failed to read info payload: %w", err)
		}
	}
	return nil
}

// metaContexts lists the metadata contexts of export name with an empty
// query, and with "qemu:" when the answer had none of those (QEMU 3.0
// forgot them for an empty query). Errors from the server end the list.
func (c *listClient) metaContexts(name string) ([]string, error) {
	if err := c.sendMetaQuery(name, ""); err != nil {
		return nil, err
	}
	var out []string
	seenQemu := false
	for {
		ctx, more, err := c.receiveMetaContext()
		if err != nil {
			return nil, err
		}
		if !more && len(out) > 0 && !seenQemu {
			seenQemu = true
			if err := c.sendMetaQuery(name, "qemu:"); err != nil {
				return nil, err
			}
			continue
		}
		if !more {
			return out, nil
		}
		seenQemu = seenQemu || strings.HasPrefix(ctx, "qemu:")
		out = append(out, ctx)
	}
}

// sendMetaQuery sends NBD_OPT_LIST_META_CONTEXT for export with one
// query, or none when query is empty.
func (c *listClient) sendMetaQuery(export, query string) error {
	if len(export) > maxStringLen {
		return errors.New("export name too long")
	}
	data := binary.BigEndian.AppendUint32(nil, uint32(len(export)))
	data = append(data, export...)
	if query == "" {
		data = binary.BigEndian.AppendUint32(data, 0)
	} else {
		data = binary.BigEndian.AppendUint32(data, 1)
		data = binary.BigEndian.AppendUint32(data, uint32(len(query)))
		data = append(data, query...)
	}
	return c.sendOption(optListMetaContext, data)
}

// receiveMetaContext reads one reply to NBD_OPT_LIST_META_CONTEXT: a
// context name, or the end (more false), which any error reply also is.
func (c *listClient) receiveMetaContext() (name string, more bool, err error) {
	r, err := c.receiveReply(optListMetaContext)
	if err != nil {
		return "", false, err
	}
	if ok, err := c.handleReplyErr(r, false); !ok {
		return "", false, err
	}
	switch r.typ {
	case repAck:
		if r.length != 0 {
			c.abort()
			return "", false, errors.New("Unexpected length to ACK response")
		}
		return "", false, nil
	case repMetaContext:
	default:
		c.abort()
		return "", false, fmt.Errorf("Unexpected reply type %d (%s), expected %d (%s)", uint32(r.typ), repName(r.typ), uint32(repMetaContext), repName(repMetaContext))
	}
	if r.length <= 4 || r.length > maxBufferSize {
		c.abort()
		return "", false, fmt.Errorf("Failed to negotiate meta context, server answered with unexpected length %d", r.length)
	}
	if _, err := c.read32("context id"); err != nil {
		return "", false, err
	}
	b := make([]byte, r.length-4)
	if err := c.read(b, "context name"); err != nil {
		return "", false, err
	}
	return cString(b), true, nil
}

// WriteExportList prints list as qemu-nbd --list prints it.
func WriteExportList(w io.Writer, list []ExportInfo) error {
	bw := bufio.NewWriter(w)
	fmt.Fprintf(bw, "exports available: %d\n", len(list))
	for _, e := range list {
		fmt.Fprintf(bw, " export: '%s'\n", e.Name)
		if e.Description != "" {
			fmt.Fprintf(bw, "  description: %s\n", e.Description)
		}
		if transmissionFlags(e.Flags)&flagHasFlags != 0 {
			fmt.Fprintf(bw, "  size:  %d\n", e.Size)
			fmt.Fprintf(bw, "  flags: 0x%x (", e.Flags)
			for bit, name := range listFlagNames {
				if name != "" && e.Flags&(1<<bit) != 0 {
					fmt.Fprintf(bw, " %s", name)
				}
			}
			fmt.Fprintf(bw, " )\n")
		}
		if e.MinBlock != 0 {
			fmt.Fprintf(bw, "  min block: %d\n", e.MinBlock)
			fmt.Fprintf(bw, "  opt block: %d\n", e.OptBlock)
			fmt.Fprintf(bw, "  max block: %d\n", e.MaxBlock)
		}
		if len(e.Contexts) > 0 {
			fmt.Fprintf(bw, "  available meta contexts: %d\n", len(e.Contexts))
			for _, ctx := range e.Contexts {
				fmt.Fprintf(bw, "   %s\n", ctx)
			}
		}
	}
	return bw.Flush()
}

// listFlagNames are qemu-nbd's names of the transmission flags, by bit.
var listFlagNames = [...]string{
	1:  "readonly",
	2:  "flush",
	3:  "fua",
	4:  "rotational",
	5:  "trim",
	6:  "zeroes",
	7:  "df",
	8:  "multi",
	9:  "resize",
	10: "cache",
	11: "fast-zero",
}

// optName is QEMU's nbd_opt_lookup.
func optName(o optType) string {
	switch o {
	case optExportName:
		return "export name"
	case optAbort:
		return "abort"
	case optList:
		return "list"
	case optStartTLS:
		return "starttls"
	case optInfo:
		return "info"
	case optGo:
		return "go"
	case optStructuredReply:
		return "structured reply"
	case optListMetaContext:
		return "list meta context"
	case optSetMetaContext:
		return "set meta context"
	}
	return "<unknown>"
}

// repName is QEMU's nbd_rep_lookup.
func repName(r repType) string {
	switch r {
	case repAck:
		return "ack"
	case repServer:
		return "server"
	case repInfo:
		return "info"
	case repMetaContext:
		return "meta context"
	case repErrUnsup:
		return "unsupported"
	case repErrPolicy:
		return "denied by policy"
	case repErrInvalid:
		return "invalid"
	case repErrPlatform:
		return "platform lacks support"
	case repErrTLSReqd:
		return "TLS required"
	case repErrUnknown:
		return "export unknown"
	case repErrShutdown:
		return "server shutting down"
	case repErrBlockSizeReqd:
		return "block size required"
	}
	return "<unknown>"
}

// sysMessage is an I/O error's cause as C's strerror words it
// ("Connection reset by peer"); other errors keep their text.
func sysMessage(err error) string {
	var errno syscall.Errno
	if errors.As(err, &errno) {
		err = errno
	}
	s := err.Error()
	if s == "" {
		return s
	}
	return strings.ToUpper(s[:1]) + s[1:]
}
