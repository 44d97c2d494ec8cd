package convert_test

import (
	"bytes"
	"context"
	"fmt"
	"log"
	"os"
	"path/filepath"

	"github.com/ovis-storage/ovis/block"
	"github.com/ovis-storage/ovis/convert"
	"github.com/ovis-storage/ovis/qcow2"
)

// Example converts a sparse qcow2 image to raw: only the written range is
// copied, the rest of the new raw file stays a hole.
func Example() {
	ctx := context.Background()
	dir, err := os.MkdirTemp("", "convert-example")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(dir)

	// A 4 MiB qcow2 image with 64 KiB of data at 1 MiB.
	src := filepath.Join(dir, "disk.qcow2")
	if err := qcow2.Create(src, qcow2.CreateOptions{Size: 4 << 20}); err != nil {
		log.Fatal(err)
	}
	img, err := qcow2.Open(src, qcow2.Options{})
	if err != nil {
		log.Fatal(err)
	}
	defer img.Close()
	pattern := bytes.Repeat([]byte("ovis"), 16<<10)
	if _, err := img.WriteAt(ctx, pattern, 1<<20, 0); err != nil {
		log.Fatal(err)
	}
	runs, err := img.Extents(ctx, 0, img.Size(), nil)
	if err != nil {
		log.Fatal(err)
	}
	for _, e := range runs {
		fmt.Printf("source extent: %d bytes, hole %v\n", e.Length, e.Status&block.StatusHole != 0)
	}

	// A new raw file of the same size reads as zeros: TargetIsZero.
	out := filepath.Join(dir, "disk.raw")
	if err := os.WriteFile(out, nil, 0o644); err != nil {
		log.Fatal(err)
	}
	if err := os.Truncate(out, img.Size()); err != nil {
		log.Fatal(err)
	}
	raw, err := block.OpenRaw(out, false)
	if err != nil {
		log.Fatal(err)
	}
	defer raw.Close()
	var done int64
	err = convert.Copy(ctx, raw, img, convert.Options{
		TargetIsZero: true,
		Progress:     func(d, total int64) { done = d },
	})
	if err != nil {
		log.Fatal(err)
	}

	got := make([]byte, len(pattern))
	if _, err := raw.ReadAt(ctx, got, 1<<20); err != nil {
		log.Fatal(err)
	}
	fmt.Printf("copied %d of %d bytes, pattern intact: %v\n", done, raw.Size(), bytes.Equal(got, pattern))
	// Output:
	// source extent: 1048576 bytes, hole true
	// source extent: 65536 bytes, hole false
	// source extent: 3080192 bytes, hole true
	// copied 4194304 of 4194304 bytes, pattern intact: true
}

// ExampleConcat reads two raw files as one source; the first, 1000
// bytes long, is padded with zeros to whole sectors.
func ExampleConcat() {
	dir, err := os.MkdirTemp("", "concat-example")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(dir)
	var parts []block.Device
	for i, size := range []int{1000, 512} {
		p := filepath.Join(dir, fmt.Sprint(i))
		if err := os.WriteFile(p, bytes.Repeat([]byte{'a' + byte(i)}, size), 0o644); err != nil {
			log.Fatal(err)
		}
		r, err := block.OpenRaw(p, true)
		if err != nil {
			log.Fatal(err)
		}
		parts = append(parts, r)
	}
	src := convert.Concat(parts...)
	defer src.Close()
	b := make([]byte, 4)
	if _, err := src.ReadAt(context.Background(), b, 1022); err != nil {
		log.Fatal(err)
	}
	fmt.Printf("size %d, bytes at 1022: %q\n", src.Size(), b)
	// Output:
	// size 1536, bytes at 1022: "\x00\x00bb"
}
