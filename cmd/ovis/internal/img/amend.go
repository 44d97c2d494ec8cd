package img

import (
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"sort"
	"strings"
	"syscall"

	"github.com/ovis-storage/ovis/block"
	"github.com/ovis-storage/ovis/qcow2"
)

// AmendConfig is what `ovis img amend` was given, as qemu-img amend's
// arguments: amend [-p] [-q] [-f FMT] [-t CACHE] [--force] -o OPTIONS
// FILENAME.
type AmendConfig struct {
	// Format is "qcow2", "raw" or "" to probe.
	Format string
	// Options are the -o arguments in order; they are joined with commas.
	Options []string
	// Cache (-t) is checked and otherwise unused: every step of an
	// amendment is synced, whatever the cache mode.
	Cache string
	// Progress (-p) prints QEMU's progress figure on stdout, unless Quiet
	// (-q).
	Progress, Quiet bool
	// Force (--force) is accepted; QEMU uses it only for encryption.
	Force bool
	// Filenames are the arguments: one image, or any number when Format
	// is given and the options ask for help.
	Filenames []string
}

// amendable are the qcow2 options amend can change, as QEMU 7.2's
// qcow2_amend_opts lists them (less encryption, which ovis does not
// support): the create options of the same names.
var amendable = map[string]bool{
	optKeySize: true, optKeyCompat: true, optKeyBackingFile: true, optKeyBackingFmt: true,
	optKeyDataFile: true, optKeyDataFileRaw: true, optKeyLazyRefcounts: true, optKeyRefcountBits: true,
}

// amendEncryptOpts are QEMU's LUKS amend options. ovis accepts them only to
// refuse them as QEMU does for an image without encryption, which every
// image ovis opens is; -o help does not list them.
var amendEncryptOpts = []optDesc{
	{"encrypt.state", optString, "", ""},
	{"encrypt.keyslot", optNumber, "", ""},
	{"encrypt.old-secret", optString, "", ""},
	{"encrypt.new-secret", optString, "", ""},
	{"encrypt.iter-time", optNumber, "", ""},
}

// createOnlyEncryptOpts are qcow2's encryption create options that amend
// does not take, for the "only supported for image creation" hint.
var createOnlyEncryptOpts = []optDesc{
	{"encryption", optBool, "", ""},
	{"encrypt.format", optString, "", ""},
	{"encrypt.key-secret", optString, "", ""},
	{"encrypt.cipher-alg", optString, "", ""},
	{"encrypt.cipher-mode", optString, "", ""},
	{"encrypt.ivgen-alg", optString, "", ""},
	{"encrypt.ivgen-hash-alg", optString, "", ""},
	{"encrypt.hash-alg", optString, "", ""},
}

// qcow2AmendOpts returns the options amend parses, encryption first as in
// QEMU's list, whose order is the order the values are checked in.
func qcow2AmendOpts() []optDesc {
	desc := append([]optDesc(nil), amendEncryptOpts...)
	for _, d := range qcow2CreateOpts {
		if amendable[d.name] {
			desc = append(desc, d)
		}
	}
	return desc
}

// Amend changes the options of an image as qemu-img amend does, with its
// checks, messages and progress output, or prints the amendable options
// for -o help. Only qcow2 images can be amended.
func (e *Env) Amend(ctx context.Context, cfg AmendConfig) error {
	stdout, stderr := e.stdout(), e.stderr()
	if len(cfg.Options) == 0 {
		return UsageError("Must specify options (-o)")
	}
	options, err := accumulateOptions(cfg.Options)
	if err != nil {
		return err
	}
	prog := newQemuProgress(cfg.Progress && !cfg.Quiet, stdout, 1)
	defer prog.end()
	help := hasHelpOption(options)
	if cfg.Format != "" && help {
		return printAmendHelp(stdout, cfg.Format)
	}
	if len(cfg.Filenames) != 1 {
		return errors.New("Expecting one image file name")
	}
	if cfg.Cache != "" {
		if _, err := block.ParseCacheMode(cfg.Cache); err != nil {
			return fmt.Errorf("Invalid cache option: %s", cfg.Cache)
		}
	}
	filename := cfg.Filenames[0]
	dev, err := e.openWritable(ctx, filename, cfg.Format, qcow2.Options{}, stderr)
	if err != nil {
		return err
	}
	if err := repairDirty(ctx, dev, filename, stderr); err != nil {
		dev.Close()
		return err
	}
	err = amendDevice(ctx, dev, options, help, prog, stdout)
	if cerr := dev.Close(); err == nil && cerr != nil {
		err = fmt.Errorf("%s: closing: %w", filename, cerr)
	}
	return err
}

func amendDevice(ctx context.Context, dev block.Device, options string, help bool, prog *qemuProgress, stdout io.Writer) error {
	format := "raw"
	img, ok := block.As[*qcow2.Image](dev)
	if ok {
		format = "qcow2"
	}
	if help {
		return printAmendHelp(stdout, format)
	}
	if !ok {
		return fmt.Errorf("Format driver '%s' does not support option amendment", format)
	}
	desc := qcow2AmendOpts()
	o, err := parseOptions(desc, options)
	if err != nil {
		// As qemu-img: when the list would parse as create options, say
		// that the option is for creation only.
		all := slices.Concat(desc, qcow2CreateOpts, createOnlyEncryptOpts)
		if _, cerr := parseOptions(all, options); cerr == nil {
			return fmt.Errorf("%v\nThis option is only supported for image creation", err)
		}
		return err
	}
	ao, err := amendOptions(o)
	if err != nil {
		return err
	}
	ao.Progress = func(done, total int64) {
		if total > 0 {
			// qemu-img's float arithmetic, which decides the printed digits.
			prog.print(float32(100)*float32(done)/float32(total), 0)
		}
	}
	prog.print(0, 0)
	err = img.Amend(ctx, ao)
	prog.print(100, 0)
	if errors.Is(err, qcow2.ErrAmendBacking) {
		return fmt.Errorf("%v\nYou can use 'ovis img rebase' instead.", err)
	}
	return err
}

// amendOptions turns parsed options into the engine's, checking what QEMU
// checks before the engine sees them: encryption, which comes first in
// QEMU's list, and the compat level, which comes next.
func amendOptions(o *opts) (qcow2.AmendOptions, error) {
	var ao qcow2.AmendOptions
	for _, d := range amendEncryptOpts {
		if o.has(d.name) {
			return ao, errors.New("Can't amend encryption options - encryption not present")
		}
	}
	if o.has(optKeyCompat) {
		switch v := o.str(optKeyCompat); v {
		case "0.10", "v2", "1.1", "v3":
			ao.Compat = v
		default:
			return ao, fmt.Errorf("Unknown compatibility level %s", v)
		}
	}
	if o.has(optKeySize) {
		// QEMU's int64: sizes of 8E and more wrap negative and are refused
		// by the engine in their turn.
		ao.Size = int64(o.num(optKeySize))
	}
	str := func(name string) *string {
		if !o.has(name) {
			return nil
		}
		s := o.str(name)
		return &s
	}
	boolean := func(name string) *bool {
		if !o.has(name) {
			return nil
		}
		b := o.boolean(name)
		return &b
	}
	ao.BackingFile, ao.BackingFormat = str(optKeyBackingFile), str(optKeyBackingFmt)
	ao.DataFile, ao.DataFileRaw = str(optKeyDataFile), boolean(optKeyDataFileRaw)
	ao.LazyRefcounts = boolean(optKeyLazyRefcounts)
	if o.has(optKeyRefcountBits) {
		// QEMU keeps the number in a C int; 0 means "unchanged" to the
		// engine, so a given 0 (invalid) is passed as another invalid width.
		ao.RefcountBits = int(int32(o.num(optKeyRefcountBits)))
		if ao.RefcountBits == 0 {
			ao.RefcountBits = -1
		}
	}
	return ao, nil
}

// printAmendHelp prints the amendable options of a format as qemu-img's
// print_amend_option_help does.
func printAmendHelp(w io.Writer, format string) error {
	switch format {
	case "qcow2":
	case "raw":
		return fmt.Errorf("Format driver '%s' does not support option amendment", format)
	default:
		return fmt.Errorf("Unknown file format '%s'", format)
	}
	var desc []optDesc
	for _, d := range qcow2AmendOpts() {
		if !strings.HasPrefix(d.name, "encrypt.") {
			desc = append(desc, d)
		}
	}
	sort.Slice(desc, func(i, j int) bool { return desc[i].name < desc[j].name })
	fmt.Fprintf(w, "Amend options for '%s':\n", format)
	for _, d := range desc {
		line := fmt.Sprintf("  %s=<%s>", d.name, d.typ)
		if len(line) < 24 {
			line += strings.Repeat(" ", 24-len(line))
		}
		fmt.Fprintf(w, "%s - %s\n", line, d.help)
	}
	return nil
}

// repairDirty repairs a qcow2 image left dirty (lazy refcounts, unclean
// shutdown) as QEMU's qcow2_open does for a writable open: a check with
// every repair, its messages printed on stderr, and the open failing if
// the check could not finish.
func repairDirty(ctx context.Context, dev block.Device, filename string, stderr io.Writer) error {
	img, ok := block.As[*qcow2.Image](dev)
	if !ok || img.Header().IncompatibleFeatures&qcow2.IncompatDirty == 0 {
		return nil
	}
	res, err := img.Check(ctx, qcow2.RepairAll)
	if res != nil {
		io.WriteString(stderr, checkLines(res.Messages))
	}
	if err == nil && res.CheckErrors != 0 {
		err = syscall.EIO
	}
	if err != nil {
		return fmt.Errorf("Could not open '%s': Could not repair dirty image: %s", filename, strerror(err))
	}
	return nil
}

// RepairDirty is what QEMU does when it opens a dirty lazy-refcounts
// image for writing (qemu-nbd included): it repairs the refcounts and
// prints the repair on stderr. A device that is not a dirty qcow2 image
// is left alone.
func RepairDirty(ctx context.Context, dev block.Device, filename string, stderr io.Writer) error {
	return repairDirty(ctx, dev, filename, stderr)
}
