package nbd

import (
	"bufio"
	"encoding/binary"
	"math/bits"
	"sync"
)

var be = binary.BigEndian

// writeSimple writes a simple reply header. A successful READ's data
// follows it.
func writeSimple(w *bufio.Writer, handle uint64, errno Errno) error {
	var b [simpleReplyLen]byte
	be.PutUint32(b[0:4], simpleReplyMagic)
	be.PutUint32(b[4:8], uint32(errno))
	be.PutUint64(b[8:16], handle)
	_, err := w.Write(b[:])
	return err
}

// writeChunkHeader writes the header of a structured reply chunk whose
// payload is n bytes.
func writeChunkHeader(w *bufio.Writer, handle uint64, fl replyFlags, typ replyType, n uint32) error {
	var b [structuredHeaderLen]byte
	be.PutUint32(b[0:4], structuredReplyMagic)
	be.PutUint16(b[4:6], uint16(fl))
	be.PutUint16(b[6:8], uint16(typ))
	be.PutUint64(b[8:16], handle)
	be.PutUint32(b[16:20], n)
	_, err := w.Write(b[:])
	return err
}

// writeDataChunk writes an NBD_REPLY_TYPE_OFFSET_DATA chunk; data is not
// empty and shorter than 2^32-8 bytes.
func writeDataChunk(w *bufio.Writer, handle uint64, fl replyFlags, off int64, data []byte) error {
	if err := writeChunkHeader(w, handle, fl, replyTypeOffsetData, uint32(8+len(data))); err != nil {
		return err
	}
	var b [8]byte
	be.PutUint64(b[:], uint64(off))
	if _, err := w.Write(b[:]); err != nil {
		return err
	}
	_, err := w.Write(data)
	return err
}

// writeHoleChunk writes an NBD_REPLY_TYPE_OFFSET_HOLE chunk; n is not 0.
func writeHoleChunk(w *bufio.Writer, handle uint64, fl replyFlags, off int64, n uint32) error {
	if err := writeChunkHeader(w, handle, fl, replyTypeOffsetHole, 12); err != nil {
		return err
	}
	var b [12]byte
	be.PutUint64(b[0:8], uint64(off))
	be.PutUint32(b[8:12], n)
	_, err := w.Write(b[:])
	return err
}

// writeErrorChunk writes a final NBD_REPLY_TYPE_ERROR chunk with a message
// for humans.
func writeErrorChunk(w *bufio.Writer, handle uint64, errno Errno, msg string) error {
	if len(msg) > maxStringLen {
		msg = msg[:maxStringLen]
	}
	if err := writeChunkHeader(w, handle, replyFlagDone, replyTypeError, uint32(6+len(msg))); err != nil {
		return err
	}
	var b [6]byte
	be.PutUint32(b[0:4], uint32(errno))
	be.PutUint16(b[4:6], uint16(len(msg)))
	if _, err := w.Write(b[:]); err != nil {
		return err
	}
	_, err := w.WriteString(msg)
	return err
}

// Request and reply buffers come from pools by power-of-two size class,
// from 4 KiB (class 12) to 256 MiB (class 28), the largest MaxPayload.
const (
	minBufClass = 12
	maxBufClass = 28
)

var bufPools [maxBufClass + 1]sync.Pool

// getBuf returns a buffer of length n. Return it with putBuf once no one
// refers to it.
func getBuf(n int) []byte {
	if n == 0 {
		return nil
	}
	c := max(bits.Len(uint(n-1)), minBufClass)
	if c > maxBufClass {
		return make([]byte, n)
	}
	if p, ok := bufPools[c].Get().(*[]byte); ok {
		return (*p)[:n]
	}
	return make([]byte, n, 1<<c)
}

// bufSize is the capacity of the buffer getBuf returns for n bytes: what
// the buffer budgets count.
func bufSize(n int) int {
	if n <= 0 {
		return 0
	}
	c := max(bits.Len(uint(n-1)), minBufClass)
	if c > maxBufClass {
		return n
	}
	return 1 << c
}

// putBuf returns a buffer from getBuf to its pool.
func putBuf(b []byte) {
	c := bits.Len(uint(cap(b) - 1))
	if cap(b) == 0 || cap(b) != 1<<c || c < minBufClass || c > maxBufClass {
		return
	}
	b = b[:0]
	bufPools[c].Put(&b)
}
