package img

import (
	"fmt"
	"sort"
	"strings"
	"unicode/utf8"
)

// qdict is a JSON object whose keys iterate in the order of QEMU's QDict:
// by hash bucket (tdb_hash(key) % 512), and within a bucket newest first.
// qemu-img's JSON and the "Format specific information" lines come out in
// that order, which is neither insertion nor alphabetical order, so ovis
// builds the same structure to print the same bytes.
//
// Values are string, int64, bool, *qdict or []any.
type qdict struct {
	keys []string // insertion order
	vals map[string]any
}

func newQDict() *qdict { return &qdict{vals: map[string]any{}} }

// put sets key, replacing an earlier value in place as qdict_put_obj does.
func (d *qdict) put(key string, v any) {
	if _, ok := d.vals[key]; !ok {
		d.keys = append(d.keys, key)
	}
	d.vals[key] = v
}

// qdictBuckets is QDICT_BUCKET_MAX.
const qdictBuckets = 512

// tdbHash is the hash QEMU's QDict uses (qobject/qdict.c).
func tdbHash(name string) uint32 {
	value := 0x238F13AF * uint32(len(name))
	for i := 0; i < len(name); i++ {
		value += uint32(name[i]) << (uint(i*5) % 24)
	}
	return 1103515243*value + 12345
}

// order returns the keys in QDict iteration order.
func (d *qdict) order() []string {
	type kb struct {
		key    string
		bucket uint32
		seq    int
	}
	ks := make([]kb, len(d.keys))
	for i, k := range d.keys {
		ks[i] = kb{k, tdbHash(k) % qdictBuckets, i}
	}
	sort.Slice(ks, func(i, j int) bool {
		if ks[i].bucket != ks[j].bucket {
			return ks[i].bucket < ks[j].bucket
		}
		return ks[i].seq > ks[j].seq // QLIST_INSERT_HEAD: newest first
	})
	out := make([]string, len(ks))
	for i, k := range ks {
		out[i] = k.key
	}
	return out
}

// jsonWriter reproduces QEMU's pretty JSONWriter (qobject/json-writer.c):
// four-space indents, "key": value, an empty container printed as an
// opening bracket, a newline and the closing bracket.
type jsonWriter struct {
	b         strings.Builder
	depth     int
	needComma bool
}

// qemuJSON renders v as qobject_to_json_pretty does, without a trailing
// newline.
func qemuJSON(v any) string {
	var w jsonWriter
	w.value("", v)
	return w.b.String()
}

func (w *jsonWriter) newline() {
	w.b.WriteByte('\n')
	w.b.WriteString(strings.Repeat(" ", 4*w.depth))
}

func (w *jsonWriter) commaName(name string) {
	if w.needComma {
		w.b.WriteByte(',')
		w.newline()
	} else {
		if w.b.Len() > 0 {
			w.newline()
		}
		w.needComma = true
	}
	if name != "" {
		quoteJSON(&w.b, name)
		w.b.WriteString(": ")
	}
}

func (w *jsonWriter) value(name string, v any) {
	switch v := v.(type) {
	case *qdict:
		w.commaName(name)
		w.b.WriteByte('{')
		w.depth++
		w.needComma = false
		for _, k := range v.order() {
			w.value(k, v.vals[k])
		}
		w.depth--
		w.newline()
		w.b.WriteByte('}')
		w.needComma = true
	case []any:
		w.commaName(name)
		w.b.WriteByte('[')
		w.depth++
		w.needComma = false
		for _, e := range v {
			w.value("", e)
		}
		w.depth--
		w.newline()
		w.b.WriteByte(']')
		w.needComma = true
	case string:
		w.commaName(name)
		quoteJSON(&w.b, v)
	case int64:
		w.commaName(name)
		fmt.Fprintf(&w.b, "%d", v)
	case bool:
		w.commaName(name)
		fmt.Fprintf(&w.b, "%t", v)
	default:
		panic(fmt.Sprintf("img: qemuJSON of %T", v))
	}
}

// quoteJSON writes s as QEMU's quoted_str does: the usual backslash
// escapes, printable ASCII as is, everything else as \uXXXX (upper-case
// hex, surrogate pairs beyond the BMP) and invalid UTF-8 as U+FFFD.
func quoteJSON(b *strings.Builder, s string) {
	b.WriteByte('"')
	for len(s) > 0 {
		r, n := utf8.DecodeRuneInString(s)
		s = s[n:]
		switch r {
		case '"':
			b.WriteString(`\"`)
		case '\\':
			b.WriteString(`\\`)
		case '\b':
			b.WriteString(`\b`)
		case '\f':
			b.WriteString(`\f`)
		case '\n':
			b.WriteString(`\n`)
		case '\r':
			b.WriteString(`\r`)
		case '\t':
			b.WriteString(`\t`)
		default:
			switch {
			case r > 0xFFFF:
				fmt.Fprintf(b, `\u%04X\u%04X`, 0xD800+((r-0x10000)>>10), 0xDC00+((r-0x10000)&0x3FF))
			case r < 0x20 || r >= 0x7F:
				fmt.Fprintf(b, `\u%04X`, r)
			default:
				b.WriteRune(r)
			}
		}
	}
	b.WriteByte('"')
}

// dumpQDict writes a QDict as qemu-img's human output does for "Format
// specific information" (dump_qdict in block/qapi.c): one "key: value" per
// line, dashes in keys shown as spaces, nested containers indented by four
// more spaces.
func dumpQDict(b *strings.Builder, indent int, d *qdict) {
	for _, k := range d.order() {
		v := d.vals[k]
		fmt.Fprintf(b, "%*s%s:", indent*4, "", strings.ReplaceAll(k, "-", " "))
		switch v.(type) {
		case *qdict, []any:
			b.WriteByte('\n')
		default:
			b.WriteByte(' ')
		}
		dumpQObject(b, indent+1, v)
	}
}

func dumpQObject(b *strings.Builder, indent int, v any) {
	switch v := v.(type) {
	case *qdict:
		dumpQDict(b, indent, v)
	case []any:
		for i, e := range v {
			_, composite := e.(*qdict)
			if _, l := e.([]any); l {
				composite = true
			}
			fmt.Fprintf(b, "%*s[%d]:%s", indent*4, "", i, map[bool]string{true: "\n", false: " "}[composite])
			dumpQObject(b, indent+1, e)
		}
	case string:
		fmt.Fprintf(b, "%s\n", v)
	case int64:
		fmt.Fprintf(b, "%d\n", v)
	case bool:
		fmt.Fprintf(b, "%t\n", v)
	}
}
