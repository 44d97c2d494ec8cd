package img

import (
	"fmt"
	"io"
	"sort"
	"strconv"
	"strings"

	"github.com/ovis-storage/ovis/image"
)

// optType is a QemuOptType: how an option's value is parsed and printed.
type optType int

const (
	optString optType = iota
	optBool
	optNumber
	optSize
)

func (t optType) String() string {
	return [...]string{"str", "bool (on/off)", "num", "size"}[t]
}

// optDesc describes one -o option, as a QemuOptDesc does.
type optDesc struct {
	name string
	typ  optType
	help string
	// def is printed in the "Formatting" line when the option is not
	// set; "" means the option is then left out.
	def string
}

// Option names, as QEMU's BLOCK_OPT_* names them.
const (
	optKeySize          = "size"
	optKeyClusterSize   = "cluster_size"
	optKeyCompat        = "compat"
	optKeyPrealloc      = "preallocation"
	optKeyLazyRefcounts = "lazy_refcounts"
	optKeyRefcountBits  = "refcount_bits"
	optKeyExtendedL2    = "extended_l2"
	optKeyCompression   = "compression_type"
	optKeyBackingFile   = "backing_file"
	optKeyBackingFmt    = "backing_fmt"
	optKeyDataFile      = "data_file"
	optKeyDataFileRaw   = "data_file_raw"
)

// qcow2CreateOpts lists the qcow2 options ovis supports in the order QEMU
// 7.2 keeps them (qcow2's create_opts merged with the file protocol's),
// which is the order of the "Formatting" line. QEMU's encryption options
// and the file protocol's nocow and extent_size_hint are not supported.
var qcow2CreateOpts = []optDesc{
	{optKeyClusterSize, optSize, "qcow2 cluster size", "65536"},
	{optKeyExtendedL2, optBool, "Extended L2 tables", "off"},
	{optKeyPrealloc, optString, "Preallocation mode (allowed values: off, metadata, falloc, full)", ""},
	{optKeyCompression, optString, "Compression method used for image cluster compression", "zlib"},
	{optKeySize, optSize, "Virtual disk size", ""},
	{optKeyCompat, optString, "Compatibility level (v2 [0.10] or v3 [1.1])", ""},
	{optKeyBackingFile, optString, "File name of a base image", ""},
	{optKeyBackingFmt, optString, "Image format of the base image", ""},
	{optKeyDataFile, optString, "File name of an external data file", ""},
	{optKeyDataFileRaw, optBool, "The external data file must stay valid as a raw image", ""},
	{optKeyLazyRefcounts, optBool, "Postpone refcount updates", "off"},
	{optKeyRefcountBits, optNumber, "Width of a reference count entry in bits", "16"},
}

// rawCreateOpts are raw's options followed by the file protocol's.
var rawCreateOpts = []optDesc{
	{optKeySize, optSize, "Virtual disk size", ""},
	{optKeyPrealloc, optString, "Preallocation mode (allowed values: off, falloc, full)", ""},
}

// formatOpts returns the create options of a format, and whether ovis
// knows the format.
func formatOpts(format string) ([]optDesc, bool) {
	switch format {
	case "qcow2":
		return qcow2CreateOpts, true
	case "raw":
		return rawCreateOpts, true
	}
	return nil, false
}

// optValue is one parsed option.
type optValue struct {
	str  string // as given, or formatted by setNumber
	num  uint64 // for optNumber and optSize
	bool bool   // for optBool
}

// opts is a parsed -o list for one format (a QemuOpts). When an option is
// given twice the last value wins, as in QEMU.
type opts struct {
	desc []optDesc
	vals map[string]optValue
}

func newOpts(desc []optDesc) *opts {
	return &opts{desc: desc, vals: map[string]optValue{}}
}

func (o *opts) find(name string) (optDesc, bool) {
	for _, d := range o.desc {
		if d.name == name {
			return d, true
		}
	}
	return optDesc{}, false
}

// has reports whether name was set.
func (o *opts) has(name string) bool {
	_, ok := o.vals[name]
	return ok
}

func (o *opts) str(name string) string   { return o.vals[name].str }
func (o *opts) num(name string) uint64   { return o.vals[name].num }
func (o *opts) boolean(name string) bool { return o.vals[name].bool }

// set parses value for name with QEMU's messages: "Invalid parameter",
// "expects 'on' or 'off'", "expects a number", "expects a non-negative
// number below 2^64".
func (o *opts) set(name, value string) error {
	d, ok := o.find(name)
	if !ok {
		return fmt.Errorf("Invalid parameter '%s'", name)
	}
	v := optValue{str: value}
	switch d.typ {
	case optBool:
		switch value {
		case "on", "yes", "true", "y":
			v.bool = true
		case "off", "no", "false", "n":
		default:
			return fmt.Errorf("Parameter '%s' expects 'on' or 'off'", name)
		}
	case optNumber:
		n, err := strconv.ParseUint(value, 0, 64)
		if err != nil {
			return fmt.Errorf("Parameter '%s' expects a number", name)
		}
		v.num = n
	case optSize:
		n, err := ParseSize(value)
		if err != nil {
			return fmt.Errorf("Parameter '%s' expects a non-negative number below 2^64\n"+
				"Optional suffix k, M, G, T, P or E means kilo-, mega-, giga-, tera-, peta-\n"+
				"and exabytes, respectively.", name)
		}
		v.num = n
	}
	o.vals[name] = v
	return nil
}

// setNumber sets a size or number option from a value, as
// qemu_opt_set_number does.
func (o *opts) setNumber(name string, n uint64) {
	o.vals[name] = optValue{str: strconv.FormatUint(n, 10), num: n}
}

// print renders the options as qemu_opts_print does for the "Formatting"
// line: every option that is set or has a default, in list order, strings
// with commas doubled, sizes and numbers that were set in decimal.
func (o *opts) print() string {
	var parts []string
	for _, d := range o.desc {
		v, set := o.vals[d.name]
		value := d.def
		if set {
			value = v.str
		}
		if !set && d.def == "" {
			continue
		}
		switch {
		case d.typ == optString:
			value = strings.ReplaceAll(value, ",", ",,")
		case (d.typ == optSize || d.typ == optNumber) && set:
			value = strconv.FormatUint(v.num, 10)
		}
		parts = append(parts, d.name+"="+value)
	}
	return strings.Join(parts, " ")
}

// validOptionList checks one -o argument as qemu-img's
// is_valid_option_list does: not empty, no leading comma, no odd run of
// trailing commas.
func validOptionList(s string) bool {
	if s == "" || s[0] == ',' {
		return false
	}
	i := len(s)
	for i > 0 && s[i-1] == ',' {
		i--
	}
	return (len(s)-i)%2 == 0
}

// accumulateOptions joins -o arguments with commas, checking each, with
// qemu-img's "Invalid option list" message.
func accumulateOptions(args []string) (string, error) {
	for _, a := range args {
		if !validOptionList(a) {
			return "", fmt.Errorf("Invalid option list: %s", a)
		}
	}
	return strings.Join(args, ","), nil
}

// optPair is one name=value item of an option list.
type optPair struct{ name, value string }

// splitOptions splits an option list as QEMU's opts_do_parse does
// (image.SplitOpts): items are separated by single commas, ",," is a
// literal comma inside a value, a name runs to the first '=' or ',', and
// a bare name is a flag: "foo" means foo=on and "nofoo" foo=off.
func splitOptions(s string) []optPair {
	var out []optPair
	for _, o := range image.SplitOpts(s) {
		out = append(out, optPair{o.Name, o.Value})
	}
	return out
}

// hasHelpOption reports whether any item of the list is "help" or "?".
func hasHelpOption(s string) bool {
	for _, p := range splitOptions(s) {
		if (p.name == "help" || p.name == "?") && p.value == "on" {
			return true
		}
	}
	return false
}

// parseOptions parses an accumulated option list against desc.
func parseOptions(desc []optDesc, s string) (*opts, error) {
	o := newOpts(desc)
	for _, p := range splitOptions(s) {
		if err := o.set(p.name, p.value); err != nil {
			return nil, err
		}
	}
	return o, nil
}

// printOptionHelp writes the -o help text as print_block_option_help does.
// With a filename QEMU adds the protocol's options and drops the footer.
func printOptionHelp(w io.Writer, format, filename string) error {
	desc, ok := formatOpts(format)
	if !ok {
		return fmt.Errorf("Unknown file format '%s'", format)
	}
	if format == "raw" && filename == "" {
		desc = desc[:1] // raw's own option; preallocation is the protocol's
	}
	if filename != "" {
		fmt.Fprintln(w, "Supported options:")
	} else {
		fmt.Fprintf(w, "Supported %s options:\n", format)
	}
	sorted := append([]optDesc(nil), desc...)
	sort.Slice(sorted, func(i, j int) bool { return sorted[i].name < sorted[j].name })
	for _, d := range sorted {
		line := fmt.Sprintf("  %s=<%s>", d.name, d.typ)
		if len(line) < 24 {
			line += strings.Repeat(" ", 24-len(line))
		}
		fmt.Fprintf(w, "%s - %s\n", line, d.help)
	}
	if filename == "" {
		fmt.Fprint(w, "\nThe protocol level may support further options.\n"+
			"Specify the target filename to include those options.\n")
	}
	return nil
}
