package qcow2

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"math/bits"
	"sync"

	"github.com/klauspost/compress/flate"
	"github.com/klauspost/compress/zstd"
)

// Compressed clusters.
//
// A compressed cluster is stored as a byte stream that starts at an
// arbitrary host offset; its L2 descriptor gives its length only in whole
// 512-byte sectors. A reader therefore hands the decompressor more bytes
// than the stream holds (the rest of the last sector, often the start of the
// next compressed cluster), and decompression stops as soon as one cluster
// of output has come out. Both functions below follow QEMU
// (block/qcow2-threads.c) so that images move freely between the two.
//
// Deflate (compression type 0, "zlib" in QEMU) is a raw RFC 1951 stream
// without zlib header or checksum. QEMU writes it with a 4 KiB window
// (window bits -12), and so does compressCluster: a reader that inflates
// through a 4 KiB window can decode every stream ovis writes. Reading
// accepts the full 32 KiB window of the format.
//
// Zstandard (compression type 1) is written as one frame with no length
// prefix; ovis's frames carry the content size and a checksum, which QEMU
// verifies. A reader must accept several frames back to back and stops
// once the cluster is full.
//
// Both functions are safe for concurrent use. Encoders and decoders are
// kept in pools; a Compressor instead keeps one encoder for the goroutine
// that owns it (conversion compresses on every core at once, and a
// pooled zstd encoder does not survive a GC).

const (
	// maxClusterSize is the largest cluster a compressed cluster can fill.
	maxClusterSize = 1 << MaxClusterBits

	// deflateWindow is the deflate window QEMU uses on write.
	deflateWindow = 4 << 10

	// minZstdWindow is the smallest window a zstd frame can declare.
	minZstdWindow = zstd.MinWindowSize
)

// checkClusterLen rejects buffer lengths that cannot be one cluster.
func checkClusterLen(what string, n int) error {
	if n <= 0 || n > maxClusterSize {
		return fmt.Errorf("qcow2: compressed cluster: %s of %d bytes is not a cluster of 1..%d bytes", what, n, maxClusterSize)
	}
	return nil
}

// decompressCluster fills dst, which is exactly one cluster, by
// decompressing src with compression type typ (CompressionDeflate or
// CompressionZstd).
//
// src may run past the end of the compressed stream: bytes after the point
// where dst is full are never looked at, as QEMU does. A stream that stops
// short of filling dst, or that is malformed before dst is full, yields a
// *CorruptError; the caller adds the host offset of the cluster.
//
// Memory use does not depend on src: deflate needs a fixed 32 KiB window,
// and a zstd frame that declares a window of more than twice len(dst)
// (rounded up to a power of two, at least 1 KiB) is rejected before
// anything is allocated for it. One cluster never needs a larger window:
// libzstd, as QEMU calls it, declares at most the cluster size, and some
// encoders round a power-of-two input up to the next power.
func decompressCluster(typ uint8, src, dst []byte) error {
	if err := checkClusterLen("destination", len(dst)); err != nil {
		return err
	}
	switch typ {
	case CompressionDeflate:
		return inflateCluster(src, dst)
	case CompressionZstd:
		return unzstdCluster(src, dst)
	default:
		return &UnsupportedError{Feature: fmt.Sprintf("compression type %d", typ)}
	}
}

// compressCluster returns the compressed form of src, one cluster, with
// compression type typ (CompressionDeflate or CompressionZstd).
//
// ok is false, and out nil, when compression does not make the cluster
// smaller: the result would be len(src) bytes or more. The caller then
// writes the cluster uncompressed. This is QEMU's rule
// (qcow2_co_pwritev_compressed_task gives the compressor a buffer of one
// byte less than the cluster and falls back to a normal write when it does
// not fit). Compressed clusters are packed at byte granularity, so every
// byte saved is saved on the host.
//
// out is a new slice that the caller owns. err is non-nil only for an
// invalid typ or src length.
func compressCluster(typ uint8, src []byte) (out []byte, ok bool, err error) {
	if err := checkClusterLen("source", len(src)); err != nil {
		return nil, false, err
	}
	switch typ {
	case CompressionDeflate:
		return deflateCluster(src)
	case CompressionZstd:
		return zstdCluster(src)
	default:
		return nil, false, &UnsupportedError{Feature: fmt.Sprintf("compression type %d", typ)}
	}
}

// Compressor compresses guest clusters for one image (its compression
// type and cluster size) with an encoder of its own, kept between calls.
// It exists so that a caller can compress on as many goroutines as it
// likes and hand the results to WritePrecompressed, possibly from one
// goroutine that keeps the writes in order; and so that each of those
// goroutines keeps its encoder (pooled encoders are dropped at every GC,
// and a zstd encoder with its tables is costly to make again).
//
// Not safe for concurrent use: give each goroutine its own.
type Compressor struct {
	typ         uint8
	clusterSize int
	deflate     *deflater     // CompressionDeflate
	zstd        *zstd.Encoder // CompressionZstd
	pad         []byte        // the short last cluster, padded to a whole one
}

// NewCompressor returns a Compressor for the image's compression type.
// It returns an *UnsupportedError for a compression type ovis does not
// know.
func (img *Image) NewCompressor() (*Compressor, error) {
	c := &Compressor{typ: img.compression, clusterSize: int(img.clusterSize)}
	switch c.typ {
	case CompressionDeflate:
		c.deflate = newDeflater()
	case CompressionZstd:
		c.zstd = newZstdEncoder()
	default:
		return nil, &UnsupportedError{Feature: fmt.Sprintf("compression type %d", c.typ)}
	}
	return c, nil
}

// Compress compresses p, one whole guest cluster, or what remains of the
// disk for the last cluster (which is compressed padded with zeros, as
// WriteCompressed does). The result is built in dst's storage when it
// fits in cap(dst) (a cluster's worth always does), else in a new slice;
// the caller owns it. ok is false, and z nil, when compression does not
// make the cluster smaller: WritePrecompressed then writes it as it is.
func (c *Compressor) Compress(dst, p []byte) (z []byte, ok bool, err error) {
	if len(p) == 0 || len(p) > c.clusterSize {
		return nil, false, fmt.Errorf("qcow2: compressing %d bytes: not one cluster of %d bytes", len(p), c.clusterSize)
	}
	src := p
	if len(p) < c.clusterSize {
		if c.pad == nil {
			c.pad = make([]byte, c.clusterSize)
		}
		copy(c.pad, p)
		clear(c.pad[len(p):])
		src = c.pad
	}
	switch c.typ {
	case CompressionDeflate:
		c.deflate.out.use(dst, len(src)-1)
		z, ok, err = c.deflate.deflate(src)
		c.deflate.out.buf = nil // dst belongs to the caller
	default:
		z, ok = zstdInto(c.zstd, dst, src)
	}
	if !ok {
		return nil, false, err
	}
	return z, true, nil
}

// Deflate.

// inflater is a pooled deflate decoder with its input reader.
type inflater struct {
	src bytes.Reader
	r   io.ReadCloser // also a flate.Resetter
}

var inflaters = sync.Pool{
	New: func() any {
		f := new(inflater)
		f.r = flate.NewReader(&f.src)
		return f
	},
}

func inflateCluster(src, dst []byte) error {
	f := inflaters.Get().(*inflater)
	defer inflaters.Put(f)
	f.src.Reset(src)
	if err := f.r.(flate.Resetter).Reset(&f.src, nil); err != nil {
		return fmt.Errorf("qcow2: compressed cluster: resetting deflate reader: %w", err)
	}
	// io.ReadFull stops reading as soon as dst is full, so whatever
	// follows the cluster in src, valid or not, is never decoded.
	n, err := io.ReadFull(f.r, dst)
	f.src.Reset(nil) // drop the reference to the caller's buffer
	switch {
	case err == nil:
		return nil
	case errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF):
		return corruptf("compressed cluster: deflate stream of %d bytes ends after %d of %d bytes", len(src), n, len(dst))
	default:
		return corruptf("compressed cluster: deflate stream of %d bytes is invalid after %d of %d bytes: %v", len(src), n, len(dst), err)
	}
}

// deflater is a pooled deflate encoder with its output buffer.
type deflater struct {
	w   *flate.Writer
	out limitBuffer
}

var deflaters = sync.Pool{
	New: func() any { return newDeflater() },
}

func newDeflater() *deflater {
	d := new(deflater)
	w, err := flate.NewWriterWindow(&d.out, deflateWindow)
	if err != nil {
		panic("qcow2: creating deflate writer: " + err.Error()) // constant arguments
	}
	d.w = w
	return d
}

func deflateCluster(src []byte) ([]byte, bool, error) {
	d := deflaters.Get().(*deflater)
	defer deflaters.Put(d)
	d.out.reset(len(src) - 1)
	out, ok, err := d.deflate(src)
	if !ok {
		return nil, ok, err
	}
	return bytes.Clone(out), true, nil
}

// deflate compresses src into d.out, which the caller has reset.
func (d *deflater) deflate(src []byte) ([]byte, bool, error) {
	d.w.Reset(&d.out)
	if _, err := d.w.Write(src); err != nil {
		return notSmaller(err)
	}
	if err := d.w.Close(); err != nil {
		return notSmaller(err)
	}
	return d.out.buf, true, nil
}

// notSmaller maps errOutputFull, which ends compression early when the
// output reaches the size of the input, to ok == false.
func notSmaller(err error) ([]byte, bool, error) {
	if errors.Is(err, errOutputFull) {
		return nil, false, nil
	}
	return nil, false, fmt.Errorf("qcow2: compressed cluster: deflate: %w", err)
}

var errOutputFull = errors.New("compressed output does not fit")

// limitBuffer is an io.Writer that collects at most limit bytes and fails
// with errOutputFull beyond that, so incompressible data stops costing
// memory as soon as it is known not to shrink.
type limitBuffer struct {
	buf   []byte
	limit int
}

func (b *limitBuffer) reset(limit int) {
	b.limit = limit
	if cap(b.buf) < limit {
		b.buf = make([]byte, 0, limit)
	}
	b.buf = b.buf[:0]
}

// use makes the buffer collect into dst's storage from its start (it
// allocates only if limit is beyond cap(dst)).
func (b *limitBuffer) use(dst []byte, limit int) {
	b.buf, b.limit = dst[:0], limit
}

func (b *limitBuffer) Write(p []byte) (int, error) {
	if len(p) > b.limit-len(b.buf) {
		return 0, errOutputFull
	}
	b.buf = append(b.buf, p...)
	return len(p), nil
}

// Zstandard.

// zstdEncoders pools single-threaded encoders. Each produces one frame per
// EncodeAll call with the content size and a checksum in the frame. The
// frame is a single segment, so its window is exactly the cluster size, as
// with libzstd.
var zstdEncoders = sync.Pool{
	New: func() any { return &zstdEncoder{e: newZstdEncoder()} },
}

func newZstdEncoder() *zstd.Encoder {
	e, err := zstd.NewWriter(nil,
		zstd.WithEncoderConcurrency(1),
		zstd.WithEncoderLevel(zstd.SpeedDefault),
		zstd.WithWindowSize(maxClusterSize),
		zstd.WithSingleSegment(true),
		zstd.WithEncoderCRC(true),
	)
	if err != nil {
		panic("qcow2: creating zstd encoder: " + err.Error()) // constant arguments
	}
	return e
}

type zstdEncoder struct {
	e   *zstd.Encoder
	buf []byte
}

func zstdCluster(src []byte) ([]byte, bool, error) {
	z := zstdEncoders.Get().(*zstdEncoder)
	defer zstdEncoders.Put(z)
	if cap(z.buf) < len(src) {
		// EncodeAll appends; with room for a whole cluster it does not
		// allocate again for compressible data.
		z.buf = make([]byte, 0, len(src))
	}
	out, ok := zstdInto(z.e, z.buf, src)
	if !ok {
		return nil, false, nil
	}
	return bytes.Clone(out), true, nil
}

// zstdInto compresses src as one frame appended to dst[:0]; ok is false
// when the frame is not smaller than src.
func zstdInto(e *zstd.Encoder, dst, src []byte) ([]byte, bool) {
	out := e.EncodeAll(src, dst[:0])
	if len(out) >= len(src) {
		return nil, false
	}
	return out, true
}

// zstdDecoders holds one pool per destination size class, indexed by the
// base-2 logarithm of the largest window its decoders accept. A decoder
// grows its history to the window a frame declares, so bounding the window
// by twice the cluster bounds the memory a hostile frame can claim.
var zstdDecoders [MaxClusterBits + 2]sync.Pool

type zstdDecoder struct {
	src bytes.Reader
	d   *zstd.Decoder
}

// zstdWindowBits returns the base-2 logarithm of the largest window that a
// frame decoded into n bytes may declare: twice n rounded up to a power of
// two, and no less than the zstd minimum.
func zstdWindowBits(n int) int {
	b := bits.Len(uint(n-1)) + 1
	if minBits := bits.Len(uint(minZstdWindow - 1)); b < minBits {
		b = minBits
	}
	return b
}

func getZstdDecoder(windowBits int) (*zstdDecoder, error) {
	if z, ok := zstdDecoders[windowBits].Get().(*zstdDecoder); ok {
		return z, nil
	}
	z := new(zstdDecoder)
	d, err := zstd.NewReader(nil,
		// One goroutine-free decoder per call; parallelism comes from the
		// callers.
		zstd.WithDecoderConcurrency(1),
		zstd.WithDecoderMaxWindow(1<<windowBits),
		zstd.WithDecoderMaxMemory(1<<windowBits),
		// Never decode the whole input in one go: src may carry bytes
		// that are not zstd after the cluster.
		zstd.WithDecodeBuffersBelow(0),
	)
	if err != nil {
		return nil, fmt.Errorf("qcow2: compressed cluster: creating zstd decoder: %w", err)
	}
	z.d = d
	return z, nil
}

func unzstdCluster(src, dst []byte) error {
	wb := zstdWindowBits(len(dst))
	z, err := getZstdDecoder(wb)
	if err != nil {
		return err
	}
	defer zstdDecoders[wb].Put(z)
	z.src.Reset(src)
	if err := z.d.Reset(&z.src); err != nil {
		return fmt.Errorf("qcow2: compressed cluster: resetting zstd decoder: %w", err)
	}
	// The streaming decoder moves on to the next frame by itself; reading
	// stops once dst is full, leaving any trailing bytes undecoded.
	n, err := io.ReadFull(z.d, dst)
	// Release the caller's buffer. Reset(nil) only fails on a closed
	// decoder, which pooled decoders never are.
	_ = z.d.Reset(nil)
	z.src.Reset(nil)
	switch {
	case err == nil:
		return nil
	case errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF):
		return corruptf("compressed cluster: zstd stream of %d bytes ends after %d of %d bytes", len(src), n, len(dst))
	default:
		return corruptf("compressed cluster: zstd stream of %d bytes is invalid after %d of %d bytes: %v", len(src), n, len(dst), err)
	}
}
