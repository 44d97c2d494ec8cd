package qcow2

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/ovis-storage/ovis/block"
)

// memFile is a read-only in-memory block.File.
type memFile struct{ b []byte }

func (m *memFile) ReadAt(p []byte, off int64) (int, error) {
	if off >= int64(len(m.b)) {
		clear(p)
		return 0, nil
	}
	n := copy(p, m.b[off:])
	clear(p[n:])
	return len(p), nil
}
func (m *memFile) WriteAt(p []byte, off int64) (int, error) { return 0, block.ErrReadOnly }
func (m *memFile) Sync() error                              { return nil }
func (m *memFile) Truncate(int64) error                     { return block.ErrReadOnly }
func (m *memFile) Size() (int64, error)                     { return int64(len(m.b)), nil }
func (m *memFile) Close() error                             { return nil }

// fuzzReadLimit bounds how much of a fuzzed disk is read.
const fuzzReadLimit = 8 << 20

// FuzzImage opens a fuzzed image read-only (no backing or data file is
// ever opened: the hook refuses other names), walks its L1/L2 tables by
// reading the disk and mapping it, and runs check. It must never panic,
// hang or allocate beyond what the file justifies.
func FuzzImage(f *testing.F) {
	for _, s := range fuzzImageSeeds(f) {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		o := Options{ReadOnly: true, NoBacking: true, OpenFile: func(name string, ro bool) (block.File, error) {
			if name != "fuzz.qcow2" {
				return nil, os.ErrNotExist
			}
			return &memFile{data}, nil
		}}
		img, err := Open("fuzz.qcow2", o)
		if err != nil {
			return
		}
		defer img.Close()
		buf := make([]byte, 64<<10)
		size := img.Size()
		step := max(size/128, int64(len(buf)))
		read := int64(0)
		for off := int64(0); off < size && read < fuzzReadLimit; off += step {
			n := min(int64(len(buf)), size-off)
			img.ReadAt(ctx, buf[:n], off)
			read += n
		}
		for off, i := int64(0), 0; off < size && i < 256; i++ {
			m, err := img.MapAt(ctx, off, size-off)
			if err != nil || m.Length <= 0 {
				break
			}
			off += m.Length
		}
		for _, b := range img.Bitmaps() {
			img.BitmapBits(b.Name)
			for off, i := int64(0), 0; off < size && i < 64; i++ {
				n, _, err := img.BitmapExtent(b.Name, off, size-off)
				if err != nil || n <= 0 {
					break
				}
				off += n
			}
		}
		img.Check(ctx, RepairNone)
	})
}

// fuzzImageSeeds returns small images made by qemu-img and qemu-io in
// several variants; they are also committed under testdata/fuzz.
func fuzzImageSeeds(f *testing.F) [][]byte {
	dir := f.TempDir()
	var seeds [][]byte
	for i, args := range [][]string{
		{"-o", "cluster_size=512"},
		{"-o", "cluster_size=4096,refcount_bits=1"},
		{"-o", "cluster_size=4096,compat=0.10"},
		{"-o", "cluster_size=16384,extended_l2=on"},
		{"-o", "cluster_size=4096,compression_type=zstd"},
	} {
		p := filepath.Join(dir, "s.qcow2")
		os.Remove(p)
		cmd := append([]string{"create", "-f", "qcow2"}, args...)
		if out, err := exec.Command("qemu-img", append(cmd, p, "256k")...).CombinedOutput(); err != nil {
			f.Fatalf("qemu-img: %v %s", err, out)
		}
		if out, err := exec.Command("qemu-io", "-c", "write -P 1 0 8k", "-c", "write -z 64k 16k", "-c", "write -c -P 3 128k 16k", p).CombinedOutput(); err != nil && i != 2 {
			f.Fatalf("qemu-io: %v %s", err, out)
		}
		exec.Command("qemu-img", "snapshot", "-c", "s", p).Run()
		if i == 1 {
			// Bitmaps: one enabled that recorded a write, one disabled.
			exec.Command("qemu-img", "bitmap", "--add", "-g", "4k", p, "b0").Run()
			exec.Command("qemu-img", "bitmap", "--add", "--disable", p, "b1").Run()
			exec.Command("qemu-io", "-c", "write -P 5 32k 8k", p).Run()
		}
		b, err := os.ReadFile(p)
		if err != nil {
			f.Fatal(err)
		}
		seeds = append(seeds, bytes.Clone(b))
	}
	return seeds
}
