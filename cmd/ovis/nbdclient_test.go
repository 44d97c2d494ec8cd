package main

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"time"
)

// nbdConn is the NBD client of the history, kill and stuck-request tests
// (NetworkBlockDevice/nbd doc/proto.md): fixed newstyle handshake,
// NBD_OPT_GO on a named export, then READ, WRITE (FUA or not),
// WRITE_ZEROES and FLUSH with simple replies, one request at a time.
// Every call takes a context: its deadline bounds the call, and its
// cancellation breaks the connection. After any error other than
// an NBD error reply the connection is broken and must be closed.
//
// Not safe for concurrent use.
type nbdConn struct {
	c      net.Conn
	r      *bufio.Reader
	handle uint64
	size   uint64
	flags  uint16 // transmission flags
}

// NBD wire values the client uses.
const (
	nbdMagic          = 0x4e42444d41474943 // NBDMAGIC
	nbdOptsMagic      = 0x49484156454f5054 // IHAVEOPT
	nbdRepMagic       = 0x3e889045565a9
	nbdRequestMagic   = 0x25609513
	nbdReplyMagic     = 0x67446698
	nbdOptGo          = 7
	nbdRepAck         = 1
	nbdCmdWrite       = 1
	nbdCmdFlush       = 3
	nbdCmdWriteZeroes = 6
	nbdFlagFUA        = 1
	nbdInfoExport     = 0 // NBD_INFO_EXPORT
	nbdRepInfo        = 3 // NBD_REP_INFO
	nbdCmdRead        = 0
	nbdFlagReadOnly   = 1 << 1 // NBD_FLAG_READ_ONLY
	nbdFlagSendFUA    = 1 << 3 // NBD_FLAG_SEND_FUA
	nbdMaxOptReply    = 64 << 10
	nbdHandshakeLimit = 16 // option replies before GO's ACK
)

// nbdReplyError is an error reply of the server: errno is NBD's (5 EIO,
// 1 EPERM, 28 ENOSPC).
type nbdReplyError struct{ errno uint32 }

func (e *nbdReplyError) Error() string { return fmt.Sprintf("NBD error %d", e.errno) }

// nbdWithDeadline runs f with c's deadline set from ctx, and c broken if
// ctx ends during f. An error that ctx's end caused wraps ctx's error
// (context.DeadlineExceeded or Canceled).
func nbdWithDeadline(ctx context.Context, c net.Conn, f func() error) error {
	if d, ok := ctx.Deadline(); ok {
		c.SetDeadline(d)
	} else {
		c.SetDeadline(time.Time{})
	}
	stop := context.AfterFunc(ctx, func() { c.SetDeadline(time.Unix(1, 0)) })
	err := f()
	stop()
	switch {
	case err == nil:
	case ctx.Err() != nil:
		return fmt.Errorf("%w (%w)", ctx.Err(), err)
	case errors.Is(err, os.ErrDeadlineExceeded):
		// The connection's deadline, which is ctx's, can pass before
		// ctx's own timer fires.
		return fmt.Errorf("%w (%w)", context.DeadlineExceeded, err)
	}
	return err
}

// dialNBD connects to the NBD server at addr on network ("tcp" for
// host:port, "unix" for a socket's path) and opens the export name.
func dialNBD(ctx context.Context, network, addr, name string) (*nbdConn, error) {
	var d net.Dialer
	c, err := d.DialContext(ctx, network, addr)
	if err != nil {
		return nil, fmt.Errorf("nbd dial %s: %w", addr, err)
	}
	h := &nbdConn{c: c, r: bufio.NewReader(c)}
	if err := nbdWithDeadline(ctx, c, func() error { return h.handshake(name) }); err != nil {
		c.Close()
		return nil, fmt.Errorf("nbd handshake with %s for %q: %w", addr, name, err)
	}
	return h, nil
}

func (h *nbdConn) handshake(name string) error {
	var hello [18]byte
	if _, err := io.ReadFull(h.r, hello[:]); err != nil {
		return fmt.Errorf("greeting: %w", err)
	}
	if binary.BigEndian.Uint64(hello[0:8]) != nbdMagic || binary.BigEndian.Uint64(hello[8:16]) != nbdOptsMagic || hello[17]&1 == 0 {
		return fmt.Errorf("not a fixed newstyle server: %x", hello)
	}
	msg := binary.BigEndian.AppendUint32(nil, 1|uint32(hello[17]&2)) // FIXED_NEWSTYLE, NO_ZEROES if offered
	msg = binary.BigEndian.AppendUint64(msg, nbdOptsMagic)
	msg = binary.BigEndian.AppendUint32(msg, nbdOptGo)
	msg = binary.BigEndian.AppendUint32(msg, uint32(4+len(name)+2))
	msg = binary.BigEndian.AppendUint32(msg, uint32(len(name)))
	msg = append(msg, name...)
	msg = binary.BigEndian.AppendUint16(msg, 0) // no information requests: NBD_INFO_EXPORT comes anyway
	if _, err := h.c.Write(msg); err != nil {
		return err
	}
	for range nbdHandshakeLimit {
		var rep [20]byte
		if _, err := io.ReadFull(h.r, rep[:]); err != nil {
			return fmt.Errorf("GO reply: %w", err)
		}
		typ, n := binary.BigEndian.Uint32(rep[12:16]), binary.BigEndian.Uint32(rep[16:20])
		if binary.BigEndian.Uint64(rep[0:8]) != nbdRepMagic || n > nbdMaxOptReply {
			return fmt.Errorf("bad option reply %x", rep)
		}
		data := make([]byte, n)
		if _, err := io.ReadFull(h.r, data); err != nil {
			return fmt.Errorf("GO reply data: %w", err)
		}
		switch {
		case typ&(1<<31) != 0:
			return fmt.Errorf("GO refused (%#x): %s", typ, data[min(len(data), 4):])
		case typ == nbdRepInfo && len(data) >= 12 && binary.BigEndian.Uint16(data[0:2]) == nbdInfoExport:
			h.size = binary.BigEndian.Uint64(data[2:10])
			h.flags = binary.BigEndian.Uint16(data[10:12])
		case typ == nbdRepAck:
			if h.size == 0 {
				return errors.New("GO acknowledged without NBD_INFO_EXPORT")
			}
			return nil
		}
	}
	return fmt.Errorf("no ACK to GO after %d replies", nbdHandshakeLimit)
}

// readOnly says whether the server serves the export read-only (its node
// does not hold the VDI's lock).
func (h *nbdConn) readOnly() bool { return h.flags&nbdFlagReadOnly != 0 }

// request sends one request and waits for its simple reply; a READ's data
// goes to out.
func (h *nbdConn) request(ctx context.Context, cmd, flags uint16, off uint64, data []byte, length uint32, out []byte) error {
	return nbdWithDeadline(ctx, h.c, func() error {
		h.handle++
		var hd [28]byte
		binary.BigEndian.PutUint32(hd[0:4], nbdRequestMagic)
		binary.BigEndian.PutUint16(hd[4:6], flags)
		binary.BigEndian.PutUint16(hd[6:8], cmd)
		binary.BigEndian.PutUint64(hd[8:16], h.handle)
		binary.BigEndian.PutUint64(hd[16:24], off)
		binary.BigEndian.PutUint32(hd[24:28], length)
		if _, err := h.c.Write(append(hd[:], data...)); err != nil {
			return err
		}
		var rep [16]byte
		if _, err := io.ReadFull(h.r, rep[:]); err != nil {
			return err
		}
		switch {
		case binary.BigEndian.Uint32(rep[0:4]) != nbdReplyMagic:
			return fmt.Errorf("bad reply magic %x", rep[0:4])
		case binary.BigEndian.Uint64(rep[8:16]) != h.handle:
			return fmt.Errorf("reply for handle %d, want %d", binary.BigEndian.Uint64(rep[8:16]), h.handle)
		case binary.BigEndian.Uint32(rep[4:8]) != 0:
			return &nbdReplyError{binary.BigEndian.Uint32(rep[4:8])}
		}
		if out != nil {
			if _, err := io.ReadFull(h.r, out); err != nil {
				return fmt.Errorf("read data: %w", err)
			}
		}
		return nil
	})
}

// read reads len(buf) bytes at off.
func (h *nbdConn) read(ctx context.Context, off uint64, buf []byte) error {
	return h.request(ctx, nbdCmdRead, 0, off, nil, uint32(len(buf)), buf)
}

// write writes data at off, with FUA when fua is set.
func (h *nbdConn) write(ctx context.Context, off uint64, data []byte, fua bool) error {
	var flags uint16
	if fua {
		flags = nbdFlagFUA
	}
	return h.request(ctx, nbdCmdWrite, flags, off, data, uint32(len(data)), nil)
}

// writeZeroes zeroes n bytes at off and lets the server unmap them.
func (h *nbdConn) writeZeroes(ctx context.Context, off uint64, n uint32) error {
	return h.request(ctx, nbdCmdWriteZeroes, 0, off, nil, n, nil)
}

func (h *nbdConn) flush(ctx context.Context) error {
	return h.request(ctx, nbdCmdFlush, 0, 0, nil, 0, nil)
}

func (h *nbdConn) Close() error { return h.c.Close() }
