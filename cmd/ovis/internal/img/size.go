package img

import (
	"errors"
	"fmt"
	"math"
	"strconv"

	"github.com/ovis-storage/ovis/image"
)

// The errors of ParseSize, as QEMU's qemu_strtosz returns them.
var (
	// errSizeSyntax is -EINVAL: not a size.
	errSizeSyntax = image.ErrSizeSyntax
	// errSizeRange is -ERANGE: the value does not fit in 64 bits.
	errSizeRange = image.ErrSizeRange
)

// ParseSize parses a byte count the way QEMU's qemu_strtosz does; see
// image.ParseSize. The error is errSizeSyntax or errSizeRange.
func ParseSize(s string) (uint64, error) { return image.ParseSize(s) }

// cvtnum parses a size command-line argument and checks it against
// [0, max], with qemu-img's messages, which name the argument
// ("image size", "buffer size for sparse output").
func cvtnum(name, s string, max int64) (int64, error) {
	v, err := ParseSize(s)
	if err != nil && !errors.Is(err, errSizeRange) {
		// Two messages, as QEMU reports two lines.
		return 0, errors.Join(
			fmt.Errorf("Invalid %s specified. You may use k, M, G, T, P or E suffixes for", name),
			errors.New("kilobytes, megabytes, gigabytes, terabytes, petabytes and exabytes."))
	}
	if err != nil || v > uint64(max) {
		return 0, fmt.Errorf("Invalid %s specified. Must be between 0 and %d.", name, max)
	}
	return int64(v), nil
}

// FormatSize renders a byte count as QEMU's size_to_str does: three
// significant digits and a binary unit, "196 KiB", "1.25 MiB", "0 B". It
// switches to the next unit once the number reaches 1000.
func FormatSize(v uint64) string {
	_, e := math.Frexp(float64(v) / (1000.0 / 1024.0))
	i := (e - 1) / 10
	suffixes := []string{"", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei"}
	i = max(0, min(i, len(suffixes)-1))
	div := uint64(1) << (10 * i)
	return strconv.FormatFloat(float64(v)/float64(div), 'g', 3, 64) + " " + suffixes[i] + "B"
}
