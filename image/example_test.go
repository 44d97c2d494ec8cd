package image_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log"
	"os"
	"path/filepath"

	"github.com/ovis-storage/ovis/image"
	"github.com/ovis-storage/ovis/qcow2"
)

// Example inspects a two-layer chain: a raw base of 1 MiB and a qcow2
// overlay that rewrote its first 64 KiB. Open probes the overlay's
// format and opens the base through the registry.
func Example() {
	ctx := context.Background()
	dir, err := os.MkdirTemp("", "image-example")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(dir)

	base := filepath.Join(dir, "base.raw")
	if err := os.WriteFile(base, bytes.Repeat([]byte{1}, 1<<20), 0o644); err != nil {
		log.Fatal(err)
	}
	top := filepath.Join(dir, "top.qcow2")
	err = qcow2.Create(top, qcow2.CreateOptions{BackingFile: base, BackingFormat: "raw"})
	if err != nil {
		log.Fatal(err)
	}
	dev, err := image.Open(top, "", image.Options{})
	if err != nil {
		log.Fatal(err)
	}
	if _, err := dev.WriteAt(ctx, bytes.Repeat([]byte{2}, 64<<10), 0, 0); err != nil {
		log.Fatal(err)
	}

	format, err := image.Probe(top)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("%s: %s, %d bytes\n", filepath.Base(top), format, dev.Size())
	runs, err := dev.Extents(ctx, 0, dev.Size(), nil)
	if err != nil {
		log.Fatal(err)
	}
	for _, e := range runs {
		fmt.Printf("  %7d bytes in layer %d\n", e.Length, e.Depth)
	}
	if err := dev.Close(); err != nil {
		log.Fatal(err)
	}
	fmt.Println("formats:", image.Formats())
	// Output:
	// top.qcow2: qcow2, 1048576 bytes
	//     65536 bytes in layer 1
	//    983040 bytes in layer 2
	// formats: [qcow2 raw]
}

// ExampleParseOpts reads an --image-opts list and refuses one whose
// option the format does not have, with the option and the cause in the
// error for the caller to word.
func ExampleParseOpts() {
	l, err := image.ParseOpts("driver=qcow2,file.filename=disk,,1.qcow2,l2-cache-size=4M,read-only=on")
	if err != nil {
		log.Fatal(err)
	}
	o := l.Apply(image.Options{})
	fmt.Printf("%s as %s: read-only %v, L2 cache %d bytes\n", l.Filename, l.Driver, o.ReadOnly, o.L2CacheSize)

	_, err = image.ParseOpts("driver=raw,file.filename=disk.raw,l2-cache-size=4M")
	var oe *image.OptError
	if errors.As(err, &oe) && errors.Is(err, image.ErrOptUnsupported) {
		fmt.Printf("%s has no option %s\n", oe.Driver, oe.Name)
	}
	// Output:
	// disk,1.qcow2 as qcow2: read-only true, L2 cache 4194304 bytes
	// raw has no option l2-cache-size
}
