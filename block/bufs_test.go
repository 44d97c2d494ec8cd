package block

import (
	"testing"
	"unsafe"
)

func TestCopyBuffers(t *testing.T) {
	for _, tt := range []struct{ n, size int }{{0, 4096}, {1, 1}, {3, 5000}, {16, 2 << 20}, {2, 2<<20 + 64<<10 + 512}} {
		bufs, release := CopyBuffers(tt.n, tt.size)
		if len(bufs) != tt.n {
			t.Fatalf("CopyBuffers(%d, %d): %d buffers", tt.n, tt.size, len(bufs))
		}
		for i, b := range bufs {
			if len(b) != tt.size || cap(b) != tt.size {
				t.Fatalf("CopyBuffers(%d, %d): buffer %d has len %d cap %d", tt.n, tt.size, i, len(b), cap(b))
			}
			if a := uintptr(unsafe.Pointer(unsafe.SliceData(b))); a%DirectAlign != 0 {
				t.Fatalf("CopyBuffers(%d, %d): buffer %d at %#x is not aligned", tt.n, tt.size, i, a)
			}
			if !IsZero(b) {
				t.Fatalf("CopyBuffers(%d, %d): buffer %d is not zeroed", tt.n, tt.size, i)
			}
			// Fill each buffer with its own byte; overlapping buffers
			// would show another's.
			for j := range b {
				b[j] = byte(i + 1)
			}
		}
		for i, b := range bufs {
			for j := range b {
				if b[j] != byte(i+1) {
					t.Fatalf("CopyBuffers(%d, %d): buffer %d byte %d is %d: buffers overlap", tt.n, tt.size, i, j, b[j])
				}
			}
		}
		release()
	}
}
