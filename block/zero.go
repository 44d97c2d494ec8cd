package block

import "bytes"

// zeroBytes is what IsZero compares against, a chunk at a time
// (bytes.Equal runs vectorised, unlike a byte loop).
var zeroBytes [64 << 10]byte

// IsZero reports whether p holds only zero bytes.
func IsZero(p []byte) bool {
	for len(p) > 0 {
		n := min(len(p), len(zeroBytes))
		if !bytes.Equal(p[:n], zeroBytes[:n]) {
			return false
		}
		p = p[n:]
	}
	return true
}
