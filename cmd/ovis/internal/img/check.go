package img

import (
	"context"
	"fmt"
	"io"
	"strings"

	"github.com/ovis-storage/ovis/block"
	"github.com/ovis-storage/ovis/qcow2"
)

// CheckConfig is what `ovis img check` was given, as qemu-img check's
// arguments: check [-f FMT] [-r leaks|all] [--output=human|json] [-q] [-U]
// FILENAME.
type CheckConfig struct {
	// Filename is the image to check.
	Filename string
	// Format is "qcow2", "raw" or "" to probe.
	Format string
	// Repair (-r) is "", "leaks" or "all".
	Repair string
	// Output is "human" (the default, "") or "json".
	Output string
	// Quiet (-q) prints nothing on stdout.
	Quiet bool
	// Cache (-T) is the image's cache mode; "" is writeback. none and
	// directsync read with O_DIRECT.
	Cache string
}

// Exit codes of qemu-img check besides 0 (clean) and 1 (check failed).
const (
	checkExitCorrupt     = 2
	checkExitLeaks       = 3
	checkExitUnsupported = 63
)

// ParseRepair checks a -r value with qemu-img's message.
func ParseRepair(s string) error {
	switch s {
	case "leaks", "all":
		return nil
	}
	return UsageError("Unknown option value for -r (expecting 'leaks' or 'all'): %s", s)
}

// Check checks (and with Repair, repairs) an image as qemu-img check does:
// the engine's message for each problem goes to stderr, the summary to
// stdout (human text or JSON with qemu-img's fields), and the result is
// an *ExitError with qemu-img's code: 2 when corruptions remain, 3 when
// only leaks do, 63 for a format without checks, 1 when the check itself
// failed. Once ctx is done the engine stops between repairs; Check then
// prints the messages so far (qemu-img prints them as it goes) and
// returns ctx's error.
func (e *Env) Check(ctx context.Context, cfg CheckConfig) error {
	stdout, stderr := e.stdout(), e.stderr()
	json, err := outputFormat(cfg.Output)
	if err != nil {
		return err
	}
	mode := qcow2.RepairNone
	switch cfg.Repair {
	case "":
	case "leaks":
		mode = qcow2.RepairLeaks
	case "all":
		mode = qcow2.RepairAll
	default:
		return ParseRepair(cfg.Repair)
	}
	openFile, err := sourceCache(cfg.Cache)
	if err != nil {
		return err
	}
	dev, err := e.openWritable(ctx, cfg.Filename, cfg.Format, qcow2.Options{ReadOnly: mode == qcow2.RepairNone, ForCheck: true, OpenFile: openFile}, stderr)
	if err != nil {
		return err
	}
	img, ok := block.As[*qcow2.Image](dev)
	if !ok {
		dev.Close()
		return exitWith(checkExitUnsupported, fmt.Errorf("This image format does not support checks"))
	}
	res, err := img.Check(ctx, mode)
	if res != nil {
		io.WriteString(stderr, checkLines(res.Messages))
	}
	if err != nil && ctx.Err() != nil {
		return stopped(img, err)
	}
	out := ""
	if err == nil && (res.LeaksFixed != 0 || res.CorruptionsFixed != 0) {
		// As qemu-img: report the repairs, then check again without
		// repairing and show that result with the repair counts.
		if !json {
			out = fmt.Sprintf("The following inconsistencies were found and repaired:\n\n"+
				"    %d leaked clusters\n    %d corruptions\n\nDouble checking the fixed image now...\n",
				res.LeaksFixed, res.CorruptionsFixed)
		}
		fixed := res
		res, err = img.Check(ctx, qcow2.RepairNone)
		if res != nil {
			io.WriteString(stderr, checkLines(res.Messages))
			res.LeaksFixed, res.CorruptionsFixed = fixed.LeaksFixed, fixed.CorruptionsFixed
		}
		if err != nil && ctx.Err() != nil {
			return stopped(img, err)
		}
	}
	if cerr := img.Close(); err == nil && cerr != nil {
		err = cerr
	}
	if err != nil {
		if !cfg.Quiet {
			io.WriteString(stdout, out)
		}
		return fmt.Errorf("Check failed: %s", strerror(err))
	}
	if json {
		out += qemuJSON(checkQDict(cfg.Filename, "qcow2", res)) + "\n"
	} else {
		out += humanCheck(res)
	}
	if !cfg.Quiet {
		io.WriteString(stdout, out)
	}
	switch {
	case res.CheckErrors != 0:
		return fmt.Errorf("Check failed")
	case res.Corruptions != 0:
		return exitWith(checkExitCorrupt, nil)
	case res.Leaks != 0:
		return exitWith(checkExitLeaks, nil)
	}
	return nil
}

// stopped closes an image whose check was interrupted and returns err,
// the context's error, unless closing failed as well.
func stopped(img *qcow2.Image, err error) error {
	if cerr := img.Close(); cerr != nil {
		return fmt.Errorf("%w; closing the image: %v", err, cerr)
	}
	return err
}

// humanCheck renders a result as qemu-img's dump_human_image_check.
func humanCheck(r *qcow2.CheckResult) string {
	var s string
	if r.Corruptions == 0 && r.Leaks == 0 && r.CheckErrors == 0 {
		s = "No errors were found on the image.\n"
	} else {
		if r.Corruptions != 0 {
			s += fmt.Sprintf("\n%d errors were found on the image.\n"+
				"Data may be corrupted, or further writes to the image may corrupt it.\n", r.Corruptions)
		}
		if r.Leaks != 0 {
			s += fmt.Sprintf("\n%d leaked clusters were found on the image.\n"+
				"This means waste of disk space, but no harm to data.\n", r.Leaks)
		}
		if r.CheckErrors != 0 {
			s += fmt.Sprintf("\n%d internal errors have occurred during the check.\n", r.CheckErrors)
		}
	}
	if r.TotalClusters != 0 && r.AllocatedClusters != 0 {
		a := float64(r.AllocatedClusters)
		s += fmt.Sprintf("%d/%d = %0.2f%% allocated, %0.2f%% fragmented, %0.2f%% compressed clusters\n",
			r.AllocatedClusters, r.TotalClusters, a*100/float64(r.TotalClusters),
			float64(r.FragmentedClusters)*100/a, float64(r.CompressedClusters)*100/a)
	}
	if r.ImageEndOffset != 0 {
		s += fmt.Sprintf("Image end offset: %d\n", r.ImageEndOffset)
	}
	return s
}

// checkQDict builds QEMU's ImageCheck in the QAPI schema's member order;
// counters that are zero are left out, as qemu-img leaves them out.
func checkQDict(filename, format string, r *qcow2.CheckResult) *qdict {
	d := newQDict()
	d.put("filename", filename)
	d.put("format", format)
	d.put("check-errors", int64(r.CheckErrors))
	opt := func(k string, v int64) {
		if v != 0 {
			d.put(k, v)
		}
	}
	opt("image-end-offset", r.ImageEndOffset)
	opt("corruptions", int64(r.Corruptions))
	opt("leaks", int64(r.Leaks))
	opt("corruptions-fixed", int64(r.CorruptionsFixed))
	opt("leaks-fixed", int64(r.LeaksFixed))
	opt("total-clusters", r.TotalClusters)
	opt("allocated-clusters", r.AllocatedClusters)
	opt("fragmented-clusters", r.FragmentedClusters)
	opt("compressed-clusters", r.CompressedClusters)
	return d
}

// checkLines renders check messages, those qemu-img prints through
// error_report with the program's name.
func checkLines(msgs []string) string {
	out := make([]string, len(msgs))
	for i, m := range msgs {
		if r, ok := strings.CutPrefix(m, qcow2.ErrorReport); ok {
			m = "ovis: " + r
		}
		out[i] = m
	}
	return lines(out)
}
