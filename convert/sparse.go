package convert

import "bytes"

var zeroSector [512]byte

// spans splits data read at off into the runs to write and the zero
// runs to zero instead, where qemu-img convert splits its buffer
// (is_allocated_sectors_min): a run of zero sectors counts only if it
// starts the buffer or is at least minSparse long, and the ends of data
// runs are rounded up to the alignment (minSparse rounded down to a power
// of two) while zero runs shrink to it, so that writes stay aligned.
func (c *copier) spans(p []byte, off int64) []span {
	if c.minSparse <= 0 {
		return []span{{0, len(p), false}}
	}
	nsec := (len(p) + 511) / 512
	minSec := max(int(c.minSparse/512), 1)
	align := 1
	for align*2 <= minSec {
		align *= 2
	}
	var spans []span
	add := func(from, to int, zero bool) {
		to = min(to*512, len(p))
		from *= 512
		if k := len(spans); k > 0 && spans[k-1].zero == zero {
			spans[k-1].to = to
			return
		}
		spans = append(spans, span{from, to, zero})
	}
	sector := off / 512
	for i := 0; i < nsec; {
		data, n := allocatedSectorsMin(p, i, nsec-i, minSec, sector+int64(i), align)
		add(i, i+n, !data)
		i += n
	}
	return spans
}

// sectorIsZero reports whether sector i of p (maybe short at the end)
// is all zeros.
func sectorIsZero(p []byte, i int) bool {
	s := p[i*512 : min(i*512+512, len(p))]
	return bytes.Equal(s, zeroSector[:len(s)])
}

// allocatedSectors is qemu-img's is_allocated_sectors over the n sectors
// of p from sector i (device sector number sector): whether the first
// holds data, and how many share its state, the run's end aligned.
func allocatedSectors(p []byte, i, n int, sector int64, align int) (bool, int) {
	if n <= 0 {
		return false, 0
	}
	zero := sectorIsZero(p, i)
	k := 1
	for k < n && sectorIsZero(p, i+k) == zero {
		k++
	}
	if k == n {
		return !zero, k
	}
	if tail := int((sector + int64(k)) & int64(align-1)); tail != 0 {
		if zero && k <= tail {
			// The data that follows rewrites this short zero tail anyway.
			zero = false
		}
		if !zero {
			k = min(k+align-tail, n)
		} else {
			k -= tail
		}
	}
	return !zero, k
}

// allocatedSectorsMin is qemu-img's is_allocated_sectors_min: a data run
// goes on over zero runs shorter than minSec sectors.
func allocatedSectorsMin(p []byte, i, n, minSec int, sector int64, align int) (bool, int) {
	minSec = min(minSec, n)
	data, k := allocatedSectors(p, i, n, sector, align)
	if !data {
		return false, k
	}
	used, checked := k, k
	i, n, sector = i+k, n-k, sector+int64(k)
	for n > 0 {
		data, k = allocatedSectors(p, i, n, sector, align)
		i, n, sector = i+k, n-k, sector+int64(k)
		checked += k
		if data {
			used = checked
		} else if k >= minSec {
			break
		}
	}
	return true, used
}
