package img

import (
	"bufio"
	"context"
	"fmt"
	"math"

	"github.com/ovis-storage/ovis/block"
	"github.com/ovis-storage/ovis/qcow2"
)

// MapConfig is what `ovis img map` was given, as qemu-img map's arguments:
// map [-f FMT] [--output=human|json] [--start-offset OFFSET]
// [--max-length LEN] [-U] FILENAME.
type MapConfig struct {
	// Filename is the image to map.
	Filename string
	// Format is "qcow2", "raw" or "" to probe.
	Format string
	// Output is "human" (the default, "") or "json".
	Output string
	// StartOffset and MaxLength are the arguments as typed; "" when
	// absent (the whole image).
	StartOffset, MaxLength string
}

// mapEntry is qemu-img's MapEntry: one run of uniform status.
type mapEntry struct {
	start, length int64
	data, zero    bool
	present       bool
	depth         int
	// offset is the run's offset in file, -1 when it has none.
	offset int64
	file   string
}

// mergeable is qemu-img's entry_mergeable: next continues e.
func (e *mapEntry) mergeable(next *mapEntry) bool {
	if e.length == 0 {
		return false
	}
	if e.zero != next.zero || e.data != next.data || e.depth != next.depth ||
		e.present != next.present || (e.offset >= 0) != (next.offset >= 0) {
		return false
	}
	if e.offset >= 0 && (e.file != next.file || e.offset+e.length != next.offset) {
		return false
	}
	return true
}

// Map prints where an image's data lives as qemu-img map does: runs of
// equal status from the layer that decides them, merged when they
// continue one another, as JSON lines or as qemu-img's human table (which
// lists only data and fails on compressed clusters, as qemu-img's does).
func (e *Env) Map(ctx context.Context, cfg MapConfig) error {
	stdout := e.stdout()
	var start int64
	maxLen := int64(-1)
	var err error
	if cfg.StartOffset != "" {
		if start, err = cvtnum("start offset", cfg.StartOffset, math.MaxInt64); err != nil {
			return err
		}
	}
	if cfg.MaxLength != "" {
		if maxLen, err = cvtnum("max length", cfg.MaxLength, math.MaxInt64); err != nil {
			return err
		}
	}
	json, err := outputFormat(cfg.Output)
	if err != nil {
		return err
	}
	dev, err := e.openImage(cfg.Filename, cfg.Format, qcow2.Options{ReadOnly: true})
	if err != nil {
		return err
	}
	defer dev.Close()
	mapper, length, err := sectorMapper(dev)
	if err != nil {
		return err
	}
	w := bufio.NewWriter(stdout)
	defer w.Flush()
	if json {
		w.WriteByte('[')
	} else {
		fmt.Fprintf(w, "%-16s%-16s%-16s%s\n", "Offset", "Length", "Mapped to", "File")
	}
	if maxLen != -1 {
		// qemu-img's MIN(start + max, length) in int64 arithmetic.
		if s := start + maxLen; s >= 0 && s < length {
			length = s
		}
	}
	curr := mapEntry{start: start, offset: -1}
	for curr.start+curr.length < length {
		off := curr.start + curr.length
		m, err := mapper.MapAt(ctx, off, length-off)
		if err != nil {
			return fmt.Errorf("Could not read file metadata: %s", strerror(err))
		}
		next := mapEntry{start: off, length: m.Length, data: m.Data, zero: m.Zero,
			present: m.Present, depth: m.Depth, offset: m.Offset, file: m.File}
		if next.offset < 0 {
			next.file = ""
		}
		if curr.mergeable(&next) {
			curr.length += next.length
			continue
		}
		if curr.length > 0 {
			if err := dumpMapEntry(w, json, &curr, &next); err != nil {
				return err
			}
		}
		curr = next
	}
	if err := dumpMapEntry(w, json, &curr, nil); err != nil {
		return err
	}
	if json {
		w.WriteString("]\n")
	}
	return nil
}

// dumpMapEntry prints one entry as qemu-img's dump_map_entry does; in
// human form it also relabels next so that entries the table does not
// distinguish merge.
func dumpMapEntry(w *bufio.Writer, json bool, e, next *mapEntry) error {
	if json {
		fmt.Fprintf(w, `{ "start": %d, "length": %d, "depth": %d, "present": %t, "zero": %t, "data": %t`,
			e.start, e.length, e.depth, e.present, e.zero, e.data)
		if e.offset >= 0 {
			fmt.Fprintf(w, `, "offset": %d`, e.offset)
		}
		w.WriteByte('}')
		if next != nil {
			w.WriteString(",\n")
		}
		return nil
	}
	if e.data && e.offset < 0 {
		return fmt.Errorf("File contains external, encrypted or compressed clusters.")
	}
	if e.data && !e.zero {
		fmt.Fprintf(w, "%-16s%-16s%-16s%s\n", cHex(e.start), cHex(e.length), cHex(e.offset), e.file)
	}
	if next != nil && (!next.data || next.zero) {
		next.data, next.zero = false, true
	}
	return nil
}

// cHex formats v as C's %#x does: "0" for zero, else "0x" and hex digits.
func cHex(v int64) string {
	if v == 0 {
		return "0"
	}
	return fmt.Sprintf("%#x", v)
}

// sectorMapper returns dev's Mapper and its size as QEMU sees it: whole
// sectors, a raw file's partial last sector reading as zeros past the end
// of the file.
func sectorMapper(dev block.Device) (block.Mapper, int64, error) {
	m, ok := block.As[block.Mapper](dev)
	if !ok {
		return nil, 0, fmt.Errorf("the image cannot be mapped")
	}
	size := dev.Size()
	if size%512 == 0 {
		return m, size, nil
	}
	return tailMapper{m, size}, (size + 511) &^ 511, nil
}

// tailMapper maps the partial last sector of a raw file as zeros at the
// same offset of the file.
type tailMapper struct {
	block.Mapper
	size int64
}

func (t tailMapper) MapAt(ctx context.Context, off, n int64) (block.MapExtent, error) {
	if off < t.size {
		return t.Mapper.MapAt(ctx, off, min(n, t.size-off))
	}
	m, err := t.Mapper.MapAt(ctx, t.size-1, 1)
	if err != nil {
		return m, err
	}
	return block.MapExtent{Length: n, Present: true, Zero: true, Offset: off, File: m.File}, nil
}
