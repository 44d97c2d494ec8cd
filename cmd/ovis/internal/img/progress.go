package img

import (
	"fmt"
	"io"
)

// qemuProgress is QEMU's simple progress printer (util/qemu-progress.c), as
// qemu-img compare, commit and rebase show it with -p: "    (12.34/100%)"
// and a carriage return on stdout, redrawn when the figure moved by at
// least minSkip points, and a newline at the end. A nil *qemuProgress
// prints nothing.
//
// Not safe for concurrent use.
type qemuProgress struct {
	w                  io.Writer
	current, lastPrint float32
	minSkip            float32
}

// newQemuProgress returns a progress printer writing to w when enabled,
// else nil.
func newQemuProgress(enabled bool, w io.Writer, minSkip float32) *qemuProgress {
	if !enabled {
		return nil
	}
	return &qemuProgress{w: w, minSkip: minSkip}
}

// print adds delta percent of max (or, with max 0, sets the figure to
// delta) and redraws when due, as qemu_progress_print does.
func (p *qemuProgress) print(delta float32, max int) {
	if p == nil {
		return
	}
	current := delta
	if max != 0 {
		current = p.current + delta/100*float32(max)
	}
	current = min(current, 100)
	p.current = current
	if current > p.lastPrint+p.minSkip || current < p.lastPrint-p.minSkip || current == 0 || current == 100 {
		p.lastPrint = current
		fmt.Fprintf(p.w, "    (%3.2f/100%%)\r", current)
	}
}

// end finishes the line.
func (p *qemuProgress) end() {
	if p == nil {
		return
	}
	fmt.Fprint(p.w, "\n")
}
