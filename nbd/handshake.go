package nbd

import (
	"bufio"
	"context"
	"crypto/tls"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"slices"
	"strings"
)

// maxOptionLen bounds the data of one option. The largest legitimate
// option is a GO or META_CONTEXT naming a 4096-byte export with a few
// queries; anything longer is answered with NBD_REP_ERR_TOO_BIG and the
// connection is closed without reading it (a client sending it is deemed
// hostile, as the spec allows).
const maxOptionLen = 64 << 10

// Handshake errors that end a connection. They are logged, never sent.
var (
	errAbort       = errors.New("nbd: client aborted the handshake")
	errBadMagic    = errors.New("nbd: bad option magic")
	errClientFlags = errors.New("nbd: unknown client flags")
	errNoExport    = errors.New("nbd: EXPORT_NAME of an unknown export")
	errTLSRequired = errors.New("nbd: client needs TLS but cannot negotiate it")
	errOptTooBig   = errors.New("nbd: option data too long")
	errTLSPipeline = errors.New("nbd: client sent data before the TLS handshake")
)

// metaContext is one negotiated metadata context.
type metaContext struct {
	id   uint32
	name string
	// bitmap is set for a qemu:dirty-bitmap context.
	bitmap *ExportBitmap
}

// Context ids. They are transient per the spec; fixed values make traces
// easier to read.
const (
	idBaseAllocation uint32 = 1
	idAllocDepth     uint32 = 2
	// idFirstBitmap is the id of an export's first dirty-bitmap context.
	idFirstBitmap uint32 = 3
)

// negotiated is the outcome of a successful handshake: the export chosen
// and how to talk to the client in transmission.
type negotiated struct {
	export *Export
	// conn is the connection to use from now on: the TLS connection
	// after STARTTLS, else the accepted one.
	conn net.Conn
	// r holds bytes the client may already have pipelined after GO.
	r          *bufio.Reader
	w          *bufio.Writer
	structured bool
	contexts   []metaContext
	flags      transmissionFlags
	tls        bool
}

// handshake is the state of the option haggling on one connection. It is
// driven by run and owned by the connection's goroutine.
type handshake struct {
	srv  *Server
	conn net.Conn
	r    *bufio.Reader
	w    *bufio.Writer

	fixed    bool
	noZeroes bool
	tls      bool
	// structured: NBD_OPT_STRUCTURED_REPLY was acknowledged.
	structured bool
	// contexts were selected by the last SET_META_CONTEXT, for
	// contextExport.
	contexts      []metaContext
	contextExport *Export
}

// qemuError is a handshake failure that qemu-nbd reports on its stderr,
// with its words ("option negotiation failed: " and msg), wrapping ovis's
// own error.
type qemuError struct {
	msg string
	err error
}

func (e *qemuError) Error() string { return e.err.Error() }
func (e *qemuError) Unwrap() error { return e.err }

// readFailure says why a read of the client failed as QEMU's
// qio_channel_read_all does.
func readFailure(err error) string {
	if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
		return "Unexpected end-of-file before all data were read"
	}
	return "Unable to read from socket: " + sysMessage(err)
}

// QemuReport returns the line qemu-nbd prints on its stderr for a
// client's handshake that ended with err (without the "qemu-nbd: "
// prefix), and whether it prints one: a client that hung up or sent
// garbage before or between options. Errors qemu-nbd keeps quiet about
// (an aborted handshake, a refused export) give false.
func QemuReport(err error) (string, bool) {
	var q *qemuError
	if errors.As(err, &q) {
		return "option negotiation failed: " + q.msg, true
	}
	return "", false
}

// runHandshake performs the fixed newstyle handshake on conn and returns
// what was negotiated, or the error that ended the connection. The caller
// sets the deadline that bounds it.
func (s *Server) runHandshake(ctx context.Context, conn net.Conn) (*negotiated, error) {
	h := &handshake{
		srv:  s,
		conn: conn,
		r:    bufio.NewReaderSize(conn, 64<<10),
		w:    bufio.NewWriterSize(conn, 16<<10),
	}
	return h.run(ctx)
}

func (h *handshake) run(ctx context.Context) (*negotiated, error) {
	var hello [18]byte
	binary.BigEndian.PutUint64(hello[0:8], nbdMagic)
	binary.BigEndian.PutUint64(hello[8:16], optsMagic)
	binary.BigEndian.PutUint16(hello[16:18], uint16(flagFixedNewstyle|flagNoZeroes))
	if _, err := h.w.Write(hello[:]); err != nil {
		return nil, err
	}
	if err := h.w.Flush(); err != nil {
		return nil, err
	}
	var cf [4]byte
	if _, err := io.ReadFull(h.r, cf[:]); err != nil {
		return nil, &qemuError{"Failed to read flags: " + readFailure(err), fmt.Errorf("nbd: read client flags: %w", err)}
	}
	flags := clientFlags(binary.BigEndian.Uint32(cf[:]))
	if flags&^knownClientFlags != 0 {
		return nil, &qemuError{fmt.Sprintf("Unknown client flags 0x%x received", uint32(flags)), fmt.Errorf("%w: %#x", errClientFlags, uint32(flags))}
	}
	h.fixed = flags&flagCFixedNewstyle != 0
	h.noZeroes = flags&flagCNoZeroes != 0
	if h.srv.tlsConfig != nil && !h.fixed {
		// TLS needs fixed newstyle, and this server insists on TLS.
		return nil, errTLSRequired
	}
	for {
		opt, data, err := h.readOption()
		if err != nil {
			return nil, err
		}
		n, err := h.option(ctx, opt, data)
		if err != nil || n != nil {
			return n, err
		}
	}
}

// readOption reads one option header and its data. Data longer than
// maxOptionLen is not read: the client gets NBD_REP_ERR_TOO_BIG and the
// connection ends.
func (h *handshake) readOption() (optType, []byte, error) {
	var hdr [optHeaderLen]byte
	if n, err := io.ReadFull(h.r, hdr[:]); err != nil {
		// QEMU reads and checks the magic, then the option, then
		// its length, and says which it could not read.
		what := "opts magic"
		switch {
		case n >= 8 && binary.BigEndian.Uint64(hdr[0:8]) != optsMagic:
			return 0, nil, &qemuError{"Bad magic received", errBadMagic}
		case n >= 12:
			what = "option length"
		case n >= 8:
			what = "option"
		}
		return 0, nil, &qemuError{"Failed to read " + what + ": " + readFailure(err), fmt.Errorf("nbd: read option: %w", err)}
	}
	if binary.BigEndian.Uint64(hdr[0:8]) != optsMagic {
		return 0, nil, &qemuError{"Bad magic received", errBadMagic}
	}
	opt := optType(binary.BigEndian.Uint32(hdr[8:12]))
	n := binary.BigEndian.Uint32(hdr[12:16])
	if n > maxOptionLen {
		if opt != optExportName {
			h.replyErr(opt, repErrTooBig, "option data too long")
			h.w.Flush()
		}
		return opt, nil, fmt.Errorf("%w: option %v, %d bytes", errOptTooBig, opt, n)
	}
	data := make([]byte, n)
	if _, err := io.ReadFull(h.r, data); err != nil {
		return opt, nil, fmt.Errorf("nbd: read option %v data: %w", opt, err)
	}
	return opt, data, nil
}

// option answers one option. It returns a non-nil negotiated when the
// client entered transmission, or an error that ends the connection.
func (h *handshake) option(ctx context.Context, opt optType, data []byte) (*negotiated, error) {
	h.srv.log.Debug("option received", "option", opt.String(), "len", len(data))
	if h.srv.tlsConfig != nil && !h.tls {
		// FORCEDTLS: nothing but STARTTLS and ABORT before the
		// upgrade, so that not even the export list leaks.
		switch opt {
		case optStartTLS, optAbort:
		case optExportName:
			return nil, errTLSRequired
		default:
			// qemu-nbd's words, which its clients print.
			return nil, h.finish(h.replyErr(opt, repErrTLSReqd, fmt.Sprintf("Option 0x%x not permitted before TLS", uint32(opt))))
		}
	}
	if h.srv.shuttingDown() && opt != optAbort {
		if opt == optExportName {
			return nil, ErrServerClosed
		}
		return nil, h.finish(h.replyErr(opt, repErrShutdown, "server is shutting down"))
	}
	switch opt {
	case optExportName:
		return h.exportName(ctx, data)
	case optAbort:
		h.reply(opt, repAck, nil)
		h.w.Flush()
		return nil, errAbort
	case optList:
		return nil, h.finish(h.list(ctx, data))
	case optStartTLS:
		return nil, h.startTLS(ctx, data)
	case optInfo, optGo:
		return h.infoGo(ctx, opt, data)
	case optStructuredReply:
		if len(data) != 0 {
			return nil, h.finish(h.replyErr(opt, repErrInvalid, "STRUCTURED_REPLY takes no data"))
		}
		h.structured = true
		return nil, h.finish(h.reply(opt, repAck, nil))
	case optListMetaContext, optSetMetaContext:
		return nil, h.finish(h.metaContext(ctx, opt, data))
	default:
		return nil, h.finish(h.replyErr(opt, repErrUnsup, fmt.Sprintf("option %v is not supported", opt)))
	}
}

// finish flushes the replies of one option.
func (h *handshake) finish(err error) error {
	if err != nil {
		return err
	}
	return h.w.Flush()
}

// reply writes one option reply.
func (h *handshake) reply(opt optType, typ repType, data []byte) error {
	var hdr [20]byte
	binary.BigEndian.PutUint64(hdr[0:8], repMagic)
	binary.BigEndian.PutUint32(hdr[8:12], uint32(opt))
	binary.BigEndian.PutUint32(hdr[12:16], uint32(typ))
	binary.BigEndian.PutUint32(hdr[16:20], uint32(len(data)))
	if _, err := h.w.Write(hdr[:]); err != nil {
		return err
	}
	_, err := h.w.Write(data)
	return err
}

// replyErr writes an error reply carrying a message for humans.
func (h *handshake) replyErr(opt optType, typ repType, msg string) error {
	if len(msg) > maxStringLen {
		msg = msg[:maxStringLen]
	}
	return h.reply(opt, typ, []byte(msg))
}

// exportName handles NBD_OPT_EXPORT_NAME, which cannot fail politely: an
// unknown export ends the connection.
func (h *handshake) exportName(ctx context.Context, data []byte) (*negotiated, error) {
	e, err := h.srv.lookup(ctx, string(data))
	if err != nil {
		return nil, fmt.Errorf("%w: %q: %w", errNoExport, truncate(string(data)), err)
	}
	n := h.negotiated(e)
	var b [8 + 2 + exportNameZeroPadLen]byte
	binary.BigEndian.PutUint64(b[0:8], uint64(e.Device.Size()))
	binary.BigEndian.PutUint16(b[8:10], uint16(n.flags))
	out := b[:]
	if h.noZeroes {
		out = b[:10]
	}
	if _, err := h.w.Write(out); err != nil {
		return nil, err
	}
	if err := h.w.Flush(); err != nil {
		return nil, err
	}
	return n, nil
}

// refuseExport answers an option naming an export that lookup did not
// return: NBD_REP_ERR_UNKNOWN, with qemu-nbd's words when there is no
// such export. A failed lookup is logged, not shown to the client.
func (h *handshake) refuseExport(opt optType, name string, err error) error {
	if errors.Is(err, ErrUnknownExport) {
		return h.replyErr(opt, repErrUnknown, fmt.Sprintf("export '%s' not present", sanitizeName(name)))
	}
	h.srv.log.Warn("export lookup failed", "option", opt.String(), "export", truncate(name), "err", err)
	return h.replyErr(opt, repErrUnknown, fmt.Sprintf("export '%s' not available", sanitizeName(name)))
}

// negotiated builds the transmission parameters for export e.
func (h *handshake) negotiated(e *Export) *negotiated {
	n := &negotiated{
		export:     e,
		conn:       h.conn,
		r:          h.r,
		w:          h.w,
		structured: h.structured,
		flags:      exportFlags(e, h.structured),
		tls:        h.tls,
	}
	n.contexts = h.contextsFor(e)
	return n
}

// contextsFor returns the contexts SET_META_CONTEXT selected, if they
// were selected on export e. An Exports may return a new *Export for the
// same export at each lookup: the selection then carries over when e has
// the same name and still offers each selected context under the same id
// and name (the client was told the ids), each then taken from e; else
// it is dropped, as the spec says for another export.
func (h *handshake) contextsFor(e *Export) []metaContext {
	switch {
	case h.contextExport == nil:
		return nil
	case h.contextExport == e:
		return h.contexts
	case h.contextExport.Name != e.Name:
		return nil
	}
	offered := contextsOf(e)
	out := make([]metaContext, 0, len(h.contexts))
	for _, c := range h.contexts {
		i := slices.IndexFunc(offered, func(o metaContext) bool { return o.id == c.id })
		if i < 0 || offered[i].name != c.name {
			return nil
		}
		out = append(out, offered[i])
	}
	return out
}

// list handles NBD_OPT_LIST: one NBD_REP_SERVER per export, its
// description after the name, then ACK.
func (h *handshake) list(ctx context.Context, data []byte) error {
	if len(data) != 0 {
		return h.replyErr(optList, repErrInvalid, "LIST takes no data")
	}
	exps, err := h.srv.exports.List(ctx)
	if err != nil {
		h.srv.log.Warn("listing exports failed", "err", err)
		return h.replyErr(optList, repErrUnknown, "export list not available")
	}
	for _, e := range exps {
		if e == nil {
			continue
		}
		if err := checkExport(e); err != nil {
			h.srv.log.Warn("export not listed", "err", err)
			continue
		}
		b := make([]byte, 4, 4+len(e.Name)+len(e.Description))
		binary.BigEndian.PutUint32(b, uint32(len(e.Name)))
		b = append(b, e.Name...)
		b = append(b, e.Description...)
		if err := h.reply(optList, repServer, b); err != nil {
			return err
		}
	}
	return h.reply(optList, repAck, nil)
}

// startTLS handles NBD_OPT_STARTTLS: ACK, then the TLS handshake on the
// same connection. Everything negotiated before is forgotten, as the spec
// requires.
func (h *handshake) startTLS(ctx context.Context, data []byte) error {
	switch {
	case h.srv.tlsConfig == nil:
		return h.finish(h.replyErr(optStartTLS, repErrPolicy, "TLS is not configured"))
	case h.tls:
		return h.finish(h.replyErr(optStartTLS, repErrInvalid, "TLS is already running"))
	case len(data) != 0:
		return h.finish(h.replyErr(optStartTLS, repErrInvalid, "STARTTLS takes no data"))
	}
	if err := h.finish(h.reply(optStartTLS, repAck, nil)); err != nil {
		return err
	}
	if h.r.Buffered() != 0 {
		// The client must wait for the ACK before its ClientHello;
		// plaintext bytes here would be lost or misread.
		return errTLSPipeline
	}
	tc := tls.Server(h.conn, h.srv.tlsConfig)
	if err := tc.HandshakeContext(ctx); err != nil {
		return fmt.Errorf("nbd: tls handshake: %w", err)
	}
	h.conn = tc
	h.r = bufio.NewReaderSize(tc, 64<<10)
	h.w = bufio.NewWriterSize(tc, 16<<10)
	h.tls = true
	h.structured = false
	h.contexts, h.contextExport = nil, nil
	return nil
}

// infoRequest is the decoded data of NBD_OPT_INFO and NBD_OPT_GO.
type infoRequest struct {
	name  string
	infos []infoType
}

// parseInfoRequest decodes INFO/GO data: a 32-bit name length, the name,
// a 16-bit count and that many 16-bit information requests, and nothing
// else.
func parseInfoRequest(data []byte) (infoRequest, bool) {
	if len(data) < 6 {
		return infoRequest{}, false
	}
	nameLen := binary.BigEndian.Uint32(data[0:4])
	if uint64(nameLen) > uint64(len(data)-6) {
		return infoRequest{}, false
	}
	req := infoRequest{name: string(data[4 : 4+nameLen])}
	rest := data[4+nameLen:]
	n := int(binary.BigEndian.Uint16(rest[0:2]))
	rest = rest[2:]
	if len(rest) != 2*n {
		return infoRequest{}, false
	}
	for i := 0; i < n; i++ {
		req.infos = append(req.infos, infoType(binary.BigEndian.Uint16(rest[2*i:])))
	}
	return req, true
}

// infoGo handles NBD_OPT_INFO and NBD_OPT_GO: INFO_EXPORT and
// INFO_BLOCK_SIZE always, INFO_NAME and INFO_DESCRIPTION when asked for,
// then ACK; after a GO's ACK the connection is in transmission.
func (h *handshake) infoGo(ctx context.Context, opt optType, data []byte) (*negotiated, error) {
	req, ok := parseInfoRequest(data)
	if !ok {
		return nil, h.finish(h.replyErr(opt, repErrInvalid, "malformed INFO/GO request"))
	}
	e, err := h.srv.lookup(ctx, req.name)
	if err != nil {
		return nil, h.finish(h.refuseExport(opt, req.name, err))
	}
	n := h.negotiated(e)

	var exp [12]byte
	binary.BigEndian.PutUint16(exp[0:2], uint16(infoExport))
	binary.BigEndian.PutUint64(exp[2:10], uint64(e.Device.Size()))
	binary.BigEndian.PutUint16(exp[10:12], uint16(n.flags))
	if err := h.reply(opt, repInfo, exp[:]); err != nil {
		return nil, err
	}
	var bs [14]byte
	binary.BigEndian.PutUint16(bs[0:2], uint16(infoBlockSize))
	binary.BigEndian.PutUint32(bs[2:6], minBlockSize)
	binary.BigEndian.PutUint32(bs[6:10], preferredBlockSize)
	binary.BigEndian.PutUint32(bs[10:14], uint32(h.srv.cfg.MaxPayload))
	if err := h.reply(opt, repInfo, bs[:]); err != nil {
		return nil, err
	}
	for _, it := range req.infos {
		var s string
		switch it {
		case infoName:
			s = e.Name
		case infoDescription:
			if e.Description == "" {
				continue
			}
			s = e.Description
		default:
			continue // EXPORT and BLOCK_SIZE are sent already; unknown ones are ignored
		}
		b := make([]byte, 2, 2+len(s))
		binary.BigEndian.PutUint16(b, uint16(it))
		if err := h.reply(opt, repInfo, append(b, s...)); err != nil {
			return nil, err
		}
	}
	if err := h.finish(h.reply(opt, repAck, nil)); err != nil {
		return nil, err
	}
	if opt == optGo {
		return n, nil
	}
	return nil, nil
}

// Block size constraints advertised with NBD_INFO_BLOCK_SIZE: devices
// take any alignment, 4 KiB is efficient, and the maximum is the
// configured payload limit.
const (
	minBlockSize       = 1
	preferredBlockSize = 4096
)

// metaRequest is the decoded data of LIST_META_CONTEXT and
// SET_META_CONTEXT.
type metaRequest struct {
	export  string
	queries []string
}

// parseMetaRequest decodes META_CONTEXT data: a 32-bit export name
// length, the name, a 32-bit query count and that many length-prefixed
// queries, and nothing else.
func parseMetaRequest(data []byte) (metaRequest, bool) {
	rest := data
	next := func() (string, bool) {
		if len(rest) < 4 {
			return "", false
		}
		n := binary.BigEndian.Uint32(rest)
		rest = rest[4:]
		if uint64(n) > uint64(len(rest)) {
			return "", false
		}
		s := string(rest[:n])
		rest = rest[n:]
		return s, true
	}
	var req metaRequest
	var ok bool
	if req.export, ok = next(); !ok {
		return metaRequest{}, false
	}
	if len(rest) < 4 {
		return metaRequest{}, false
	}
	count := binary.BigEndian.Uint32(rest)
	rest = rest[4:]
	if uint64(count) > uint64(len(rest)/4) {
		return metaRequest{}, false
	}
	req.queries = make([]string, 0, count)
	for i := uint32(0); i < count; i++ {
		q, ok := next()
		if !ok {
			return metaRequest{}, false
		}
		req.queries = append(req.queries, q)
	}
	if len(rest) != 0 {
		return metaRequest{}, false
	}
	return req, true
}

// contextsOf lists the contexts export e offers, in id order: the two
// fixed ones (qemu:allocation-depth unless e.NoAllocationDepth), then one
// qemu:dirty-bitmap context per bitmap.
func contextsOf(e *Export) []metaContext {
	out := []metaContext{{id: idBaseAllocation, name: contextBaseAllocation}}
	if !e.NoAllocationDepth {
		out = append(out, metaContext{id: idAllocDepth, name: contextAllocDepth})
	}
	for i := range e.Bitmaps {
		out = append(out, metaContext{id: idFirstBitmap + uint32(i), name: contextDirtyBitmap + e.Bitmaps[i].Name, bitmap: &e.Bitmaps[i]})
	}
	return out
}

// matchContexts returns the contexts that queries select, in id order and
// without duplicates. With list set (LIST_META_CONTEXT) no query selects
// everything and a bare namespace ("base:", "qemu:") is a wildcard for
// it; for SET_META_CONTEXT a bare namespace selects nothing, as the spec
// requires. Unknown namespaces, unknown leaves and queries without a colon
// are ignored.
func matchContexts(allContexts []metaContext, queries []string, list bool) []metaContext {
	if list && len(queries) == 0 {
		return allContexts
	}
	picked := make([]bool, len(allContexts))
	for _, q := range queries {
		ns, leaf, ok := strings.Cut(q, ":")
		if !ok {
			continue
		}
		for i, c := range allContexts {
			cns, cleaf, _ := strings.Cut(c.name, ":")
			if ns != cns {
				continue
			}
			// In a list, "qemu:dirty-bitmap:" lists every bitmap.
			prefix := list && strings.HasSuffix(leaf, ":") && strings.HasPrefix(cleaf, leaf)
			if leaf == cleaf || (list && leaf == "") || prefix {
				picked[i] = true
			}
		}
	}
	var out []metaContext
	for i, c := range allContexts {
		if picked[i] {
			out = append(out, c)
		}
	}
	return out
}

// metaContext handles LIST_META_CONTEXT and SET_META_CONTEXT. SET replaces
// the selection even when it fails.
func (h *handshake) metaContext(ctx context.Context, opt optType, data []byte) error {
	set := opt == optSetMetaContext
	if set {
		h.contexts, h.contextExport = nil, nil
	}
	if !h.structured {
		return h.replyErr(opt, repErrInvalid, "negotiate structured replies first")
	}
	req, ok := parseMetaRequest(data)
	if !ok {
		return h.replyErr(opt, repErrInvalid, "malformed META_CONTEXT request")
	}
	e, err := h.srv.lookup(ctx, req.export)
	if err != nil {
		return h.refuseExport(opt, req.export, err)
	}
	picked := matchContexts(contextsOf(e), req.queries, !set)
	for _, c := range picked {
		b := make([]byte, 4, 4+len(c.name))
		if set {
			binary.BigEndian.PutUint32(b, c.id)
		}
		if err := h.reply(opt, repMetaContext, append(b, c.name...)); err != nil {
			return err
		}
	}
	if set {
		h.contexts, h.contextExport = picked, e
	}
	return h.reply(opt, repAck, nil)
}

// truncate shortens a client-supplied string for messages and logs.
// sanitizeName is QEMU's nbd_sanitize_name: a name in a refusal is cut
// to 80 bytes and marked with "...", so clients see qemu-nbd's message.
func sanitizeName(s string) string {
	const max = 80
	if len(s) >= max {
		return s[:max] + "..."
	}
	return s
}

func truncate(s string) string {
	const max = 256
	if len(s) > max {
		return s[:max] + "..."
	}
	return s
}
