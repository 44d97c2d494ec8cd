package qcow2

import (
	"fmt"
	"math/bits"
)

// AmendOptions are the image options qemu-img amend can change. Nil or
// zero fields are left alone.
type AmendOptions struct {
	// Compat "0.10" downgrades to version 2, "1.1" upgrades to version 3.
	Compat        string
	LazyRefcounts *bool
	// RefcountBits rewrites the refcount structures at a new width.
	RefcountBits int
	// DataFile renames the external data file (only for images that have
	// one, as in QEMU).
	DataFile    *string
	DataFileRaw *bool
}

// SetBacking rewrites the backing file name and format in the header (""
// removes the backing file), as qemu-img rebase -u does. The open backing
// device is not changed; reopen the image to use the new one.
func (img *Image) SetBacking(name, format string) error {
	return img.exclusive(func() error {
		if name != "" && img.dataFileRaw {
			return fmt.Errorf("qcow2: an image with data_file_raw cannot have a backing file")
		}
		old := img.hdr
		img.hdr.BackingFile, img.hdr.BackingFormat = name, format
		if name == "" {
			img.hdr.BackingFormat = ""
		}
		if _, err := img.hdr.Encode(); err != nil {
			img.hdr = old
			return err
		}
		return img.writeHeaderLocked()
	})
}

// Amend changes image options in place, as qemu-img amend does.
func (img *Image) Amend(o AmendOptions) error {
	if o.Compat == "v2" {
		o.Compat = "0.10"
	}
	if o.Compat == "v3" {
		o.Compat = "1.1"
	}
	switch o.Compat {
	case "", "0.10", "1.1":
	default:
		return fmt.Errorf("qcow2: unknown compatibility level %q", o.Compat)
	}
	if o.RefcountBits != 0 && (o.RefcountBits > 64 || o.RefcountBits&(o.RefcountBits-1) != 0) {
		return fmt.Errorf("Refcount width must be a power of two and may not exceed 64 bits")
	}
	downgrade := o.Compat == "0.10" && img.v3
	if downgrade {
		if err := img.checkDowngrade(o); err != nil {
			return err
		}
		// Version 2 has no zero flag: turn zero clusters into something
		// v2 reads as zeros, through the normal write path.
		if err := img.expandZeroClusters(); err != nil {
			return err
		}
	}
	return img.exclusive(func() error {
		h := &img.hdr
		if o.Compat == "1.1" && !img.v3 {
			h.Version, h.HeaderLength, h.RefcountOrder = 3, 112, 4
			if img.clusterSize > 4096 {
				h.FeatureNames = defaultFeatureNames()
			}
		}
		if o.LazyRefcounts != nil {
			if *o.LazyRefcounts && h.Version < 3 {
				return fmt.Errorf("Lazy refcounts only supported with compatibility level 1.1 and above (use compat=1.1 or greater)")
			}
			if *o.LazyRefcounts {
				h.CompatibleFeatures |= CompatLazyRefcounts
			} else {
				h.CompatibleFeatures &^= CompatLazyRefcounts
			}
		}
		if o.DataFile != nil {
			if !img.hasDataFile {
				return fmt.Errorf("data-file can only be set for images that use an external data file")
			}
			h.DataFile = *o.DataFile
		}
		if o.DataFileRaw != nil {
			if *o.DataFileRaw && !img.hasDataFile {
				return fmt.Errorf("data-file-raw cannot be set on existing images without an external data file")
			}
			if *o.DataFileRaw {
				h.AutoclearFeatures |= AutoclearDataFileRaw
			} else {
				h.AutoclearFeatures &^= AutoclearDataFileRaw
			}
		}
		if downgrade {
			h.Version, h.HeaderLength = 2, v2HeaderLen
			h.FeatureNames, h.Trailing = nil, nil
			h.IncompatibleFeatures, h.CompatibleFeatures, h.AutoclearFeatures = 0, 0, 0
		}
		if o.RefcountBits != 0 && o.RefcountBits != img.rcBits {
			if h.Version < 3 {
				return fmt.Errorf("Different refcount widths than 16 bits require compatibility level 1.1 or above (use compat=1.1 or greater)")
			}
			h.RefcountOrder = uint32(bits.TrailingZeros(uint(o.RefcountBits)))
			img.rcBits = o.RefcountBits
			img.rcPerBlock = img.clusterSize * 8 / int64(img.rcBits)
			// The new table and blocks are written and synced before the
			// header that names them and their width.
			if err := img.rebuildRefcountsLocked(); err != nil {
				return err
			}
		}
		if _, err := h.Encode(); err != nil {
			return err
		}
		if err := img.writeHeaderLocked(); err != nil {
			return err
		}
		img.v3 = h.Version >= 3
		img.lazy = h.LazyRefcounts()
		img.dataFileRaw = h.DataFileRaw()
		return nil
	})
}

func (img *Image) checkDowngrade(o AmendOptions) error {
	switch {
	case img.rcBits != 16 && o.RefcountBits != 16:
		return fmt.Errorf("Cannot downgrade an image with refcount_bits != 16")
	case o.RefcountBits != 0 && o.RefcountBits != 16:
		return fmt.Errorf("Different refcount widths than 16 bits require compatibility level 1.1 or above (use compat=1.1 or greater)")
	case img.extL2:
		return fmt.Errorf("Cannot downgrade an image with extended L2 entries")
	case img.compression != CompressionDeflate:
		return fmt.Errorf("Cannot downgrade an image with a compression type other than zlib")
	case img.hasDataFile:
		return fmt.Errorf("Cannot downgrade an image with a data file")
	case o.LazyRefcounts != nil && *o.LazyRefcounts:
		return fmt.Errorf("Lazy refcounts only supported with compatibility level 1.1 and above (use compat=1.1 or greater)")
	}
	if len(img.snapshots) > 0 {
		// Zero clusters in snapshot tables would need expanding too.
		for _, s := range img.snapshots {
			l1, err := img.readL1Exclusive(s)
			if err != nil {
				return err
			}
			for _, e := range l1 {
				if off := e & l1OffsetMask; off != 0 {
					buf, err := img.readTableFile(off, img.clusterSize)
					if err != nil {
						return err
					}
					for j := int64(0); j < img.l2Entries; j++ {
						if m := img.readEntry(buf, j); m.entry&flagZero != 0 && m.entry&flagCompressed == 0 {
							return fmt.Errorf("qcow2: cannot downgrade: snapshot %q has zero clusters", s.Name)
						}
					}
				}
			}
		}
	}
	return nil
}

// expandZeroClusters rewrites the active layer's zero clusters so that a
// version 2 reader sees zeros: unallocated when nothing shows through,
// real zeros otherwise.
func (img *Image) expandZeroClusters() error {
	n := (img.size + img.clusterSize - 1) >> img.clusterBits
	hasBacking := img.hdr.BackingFile != ""
	zero := make([]byte, img.clusterSize)
	for c := int64(0); c < n; c++ {
		var m mapping
		if err := img.withMetadata(func() error {
			var err error
			m, err = img.lookupLocked(c)
			return err
		}); err != nil {
			return err
		}
		if m.entry&flagZero == 0 || m.entry&flagCompressed != 0 {
			continue
		}
		_, hasHost := img.host(m)
		if !hasBacking && !hasHost {
			if err := img.withMetadata(func() error { return img.setEntryLocked(c, mapping{}, false) }); err != nil {
				return err
			}
			continue
		}
		size := min(img.clusterSize, img.size-c<<img.clusterBits)
		if _, err := img.writeCluster(c, 0, zero[:size]); err != nil {
			return err
		}
	}
	return img.Flush()
}
