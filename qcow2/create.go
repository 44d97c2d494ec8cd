package qcow2

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math/bits"
	"os"

	"github.com/ovis-storage/ovis/block"
)

// Create makes a new qcow2 image at path, replacing any file there. The
// layout matches qemu-img's: header, refcount table, refcount block(s),
// L1 table. With preallocation other than off, every L2 table and data
// cluster is allocated too.
func Create(path string, o CreateOptions) error {
	if err := o.validate(); err != nil {
		return err
	}
	if o.Size == 0 && o.BackingFile != "" {
		bp := o.BackingFile
		if !isAbs(bp) {
			bp = joinDir(path, bp)
		}
		b, err := openDevice(bp, o.BackingFormat, Options{ReadOnly: true}, nil)
		if err != nil {
			return fmt.Errorf("Could not open backing file: %w", err)
		}
		o.Size = b.Size()
		b.Close()
	}
	// QEMU rounds the virtual size up to whole sectors.
	o.Size = (o.Size + 511) &^ 511
	h, err := newHeader(o)
	if err != nil {
		return err
	}
	f, err := block.CreateFile(path)
	if err != nil {
		return err
	}
	if err := writeLayout(f, h); err != nil {
		f.Close()
		return fmt.Errorf("qcow2: creating %s: %w", path, err)
	}
	if err := f.Close(); err != nil {
		return err
	}
	if o.DataFile != "" {
		dp := o.DataFile
		if !isAbs(dp) {
			dp = joinDir(path, dp)
		}
		df, err := os.OpenFile(dp, os.O_RDWR|os.O_CREATE|os.O_TRUNC, 0o644)
		if err != nil {
			return fmt.Errorf("qcow2: creating data file: %w", err)
		}
		err = df.Truncate(o.Size)
		if cerr := df.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			return err
		}
	}
	if o.Preallocation == PreallocOff {
		return nil
	}
	img, err := Open(path, Options{NoBacking: true})
	if err != nil {
		return err
	}
	if err := img.preallocate(context.Background(), o.Preallocation, 0, false); err != nil {
		img.Close()
		return err
	}
	return img.Close()
}

func newHeader(o CreateOptions) (*Header, error) {
	h := &Header{
		Version:       3,
		ClusterBits:   uint32(bits.TrailingZeros64(uint64(o.ClusterSize))),
		Size:          uint64(o.Size),
		RefcountOrder: uint32(bits.TrailingZeros(uint(o.RefcountBits))),
		HeaderLength:  112,
		BackingFile:   o.BackingFile,
		BackingFormat: o.BackingFormat,
		DataFile:      o.DataFile,
	}
	if o.Compat == "0.10" {
		h.Version, h.HeaderLength = 2, v2HeaderLen
	} else if o.ClusterSize > 4096 {
		// QEMU writes the table only for clusters larger than 4 KiB.
		h.FeatureNames = defaultFeatureNames()
	}
	if o.LazyRefcounts {
		h.CompatibleFeatures |= CompatLazyRefcounts
	}
	if o.ExtendedL2 {
		h.IncompatibleFeatures |= IncompatExtendedL2
	}
	if o.CompressionType == "zstd" {
		h.IncompatibleFeatures |= IncompatCompression
		h.CompressionType = CompressionZstd
	}
	if o.DataFile != "" {
		h.IncompatibleFeatures |= IncompatDataFile
		if o.DataFileRaw {
			h.AutoclearFeatures |= AutoclearDataFileRaw
		}
	}
	l1 := l1EntriesFor(h.Size, h.ClusterBits, h.L2EntrySize())
	if l1*8 > maxL1Bytes {
		return nil, fmt.Errorf("The image size is too large for file format 'qcow2' (try using a larger cluster size)")
	}
	h.L1Size = uint32(l1)
	return h, nil
}

// writeLayout writes header, refcount table, refcount blocks and an empty
// L1 table, sized by a fixed point: the refcount structures count
// themselves.
func writeLayout(f block.File, h *Header) error {
	cs := h.ClusterSize()
	perBlock := cs * 8 / int64(h.RefcountBits())
	l1Clusters := (int64(h.L1Size)*8 + cs - 1) / cs
	rtClusters, blocks := int64(1), int64(1)
	for {
		total := 1 + rtClusters + blocks + l1Clusters
		nb := (total + perBlock - 1) / perBlock
		nt := max((nb*8+cs-1)/cs, 1)
		if nb == blocks && nt == rtClusters {
			break
		}
		blocks, rtClusters = max(nb, blocks), max(nt, rtClusters)
	}
	total := 1 + rtClusters + blocks + l1Clusters
	h.RefcountTableOffset = uint64(cs)
	h.RefcountTableClusters = uint32(rtClusters)
	if int64(h.RefcountTableClusters)*cs > maxRefcountTableBytes {
		return errors.New("refcount table too large")
	}
	blockStart := 1 + rtClusters
	h.L1TableOffset = uint64((blockStart + blocks) * cs)
	if h.L1Size == 0 {
		h.L1TableOffset = 0
	}
	hdr, err := h.Encode()
	if err != nil {
		return err
	}
	rest := make([]byte, (total-1)*cs)
	for b := int64(0); b < blocks; b++ {
		binary.BigEndian.PutUint64(rest[b*8:], uint64((blockStart+b)*cs))
	}
	for i := int64(0); i < total; i++ {
		blk := rest[(blockStart-1+i/perBlock)*cs:]
		setRefcount(blk, i%perBlock, h.RefcountBits(), 1)
	}
	if err := f.Truncate(total * cs); err != nil {
		return err
	}
	if _, err := f.WriteAt(hdr, 0); err != nil {
		return err
	}
	if _, err := f.WriteAt(rest, cs); err != nil {
		return err
	}
	return f.Sync()
}

// preallocate allocates every L2 table and data cluster from guest offset
// from (the old size of a grown image, or 0) to the end (metadata), and
// with falloc or full also reserves or zero-fills the data clusters'
// host space. Extended L2 subclusters are left unallocated, as QEMU's
// preallocation leaves them (a backing file still shows through), except
// for falloc and full growth over a longer backing file (zeroNew), where
// QEMU allocates them to hide it. An external data file is extended to
// the new size instead. It stops between runs once ctx is done.
func (img *Image) preallocate(ctx context.Context, mode string, from int64, zeroNew bool) error {
	hostEnd, err := img.preallocOldEnd(ctx, mode, from, zeroNew)
	if err != nil {
		return err
	}
	allocSubs := zeroNew && (mode == PreallocFalloc || mode == PreallocFull) && !img.hasDataFile
	n := (img.size + img.clusterSize - 1) >> img.clusterBits
	var end uint64
	type run struct{ off, n int64 }
	var runs []run
	end = uint64(hostEnd)
	for c := (from + img.clusterSize - 1) >> img.clusterBits; c < n; {
		if ctx.Err() != nil {
			break // still extend the file below: the mapped runs lie past its end
		}
		k := min(img.slEntries-c%img.slEntries, n-c)
		var host uint64
		done := false
		err := img.withMetadata(ctx, func() error {
			e, idx, err := img.writableL2Locked(c)
			if err != nil {
				return err
			}
			if img.hasDataFile {
				host = uint64(c << img.clusterBits)
			} else if !done {
				if host, err = img.allocRunLocked(k); err != nil {
					return err
				}
				done = true
			}
			for i := int64(0); i < k; i++ {
				m := mapping{entry: (host + uint64(i<<img.clusterBits)) | flagCopied}
				if allocSubs {
					m.bitmap = 1<<img.nsub - 1
				}
				img.writeEntry(e.buf, idx+i, m)
			}
			img.l2.markDirtyLocked(e)
			return nil
		})
		if err != nil {
			return err
		}
		end = max(end, host+uint64(k<<img.clusterBits))
		runs = append(runs, run{int64(host), k << img.clusterBits})
		c += k
		if err := img.endWrite(true, false); err != nil {
			return err
		}
	}
	if err := img.Flush(ctx); err != nil {
		return err
	}
	if tail := img.size & (img.subSize - 1); tail != 0 && len(runs) > 0 && ctx.Err() == nil && (mode == PreallocMetadata || img.hasDataFile) {
		// QEMU's preallocate_co copies on write: the newly mapped last
		// (sub)cluster gets zeros past the end, which extends a data file.
		r := runs[len(runs)-1]
		at := r.off + r.n - img.clusterSize + img.size&(img.clusterSize-1)
		if _, err := img.data.WriteAt(make([]byte, img.subSize-tail), at); err != nil {
			return fmt.Errorf("qcow2: writing the last cluster's tail: %w", err)
		}
	}
	if img.hasDataFile {
		// QEMU's preallocate_co: metadata only maps the data file; falloc
		// and full reserve what it lacks up to the new end.
		dataMode := mode
		if dataMode == PreallocMetadata {
			dataMode = PreallocOff
		}
		if err := img.growDataFile(img.size, dataMode); err != nil {
			return err
		}
		return ctx.Err()
	}
	size, err := img.data.Size()
	if err != nil {
		return err
	}
	if int64(end) > size {
		if err := img.data.Truncate(int64(end)); err != nil {
			return err
		}
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	if mode != PreallocFalloc && mode != PreallocFull {
		return nil
	}
	for _, r := range runs {
		if err := ctx.Err(); err != nil {
			return err
		}
		if err := img.reserveHost(mode, r.off, r.n); err != nil {
			return err
		}
	}
	return img.data.Sync()
}
