package img

import (
	"strings"
	"testing"
)

// TestQDictOrder checks the key orders qemu-img 7.2 prints for ImageInfo,
// ImageInfoSpecificQCow2 and SnapshotInfo, whatever the insertion order.
func TestQDictOrder(t *testing.T) {
	tests := []struct {
		keys string // insertion order
		want string
	}{
		{
			"filename format dirty-flag actual-size virtual-size cluster-size backing-filename full-backing-filename backing-filename-format snapshots format-specific",
			"backing-filename-format snapshots virtual-size filename cluster-size format actual-size format-specific full-backing-filename backing-filename dirty-flag",
		},
		{
			"compat data-file data-file-raw extended-l2 lazy-refcounts corrupt refcount-bits compression-type",
			"compat compression-type lazy-refcounts refcount-bits data-file data-file-raw corrupt extended-l2",
		},
		{
			"id name vm-state-size date-sec date-nsec vm-clock-sec vm-clock-nsec icount",
			"icount vm-clock-nsec name date-sec date-nsec vm-clock-sec id vm-state-size",
		},
		{"type data", "type data"},
	}
	for _, tt := range tests {
		d := newQDict()
		for _, k := range strings.Fields(tt.keys) {
			d.put(k, int64(0))
		}
		if got := strings.Join(d.order(), " "); got != tt.want {
			t.Errorf("order of %s\n got %s\nwant %s", tt.keys, got, tt.want)
		}
	}
}

func TestQemuJSON(t *testing.T) {
	d := newQDict()
	d.put("virtual-size", int64(1073741824))
	d.put("filename", "a \"b\"\\\n\tä😀\x01")
	spec := newQDict()
	spec.put("compat", "1.1")
	spec.put("corrupt", false)
	d.put("format-specific", spec)
	d.put("snapshots", []any{})
	want := `{
    "snapshots": [
    ],
    "virtual-size": 1073741824,
    "filename": "a \"b\"\\\n\t\u00E4\uD83D\uDE00\u0001",
    "format-specific": {
        "compat": "1.1",
        "corrupt": false
    }
}`
	if got := qemuJSON(d); got != want {
		t.Errorf("qemuJSON\n got %s\nwant %s", got, want)
	}
	if got := qemuJSON([]any{newQDict()}); got != "[\n    {\n    }\n]" {
		t.Errorf("qemuJSON of a list holding an empty dict = %q", got)
	}
}

func TestDumpQDict(t *testing.T) {
	d := newQDict()
	d.put("compat", "1.1")
	d.put("lazy-refcounts", true)
	d.put("refcount-bits", int64(16))
	inner := newQDict()
	inner.put("name", "b0")
	d.put("bitmaps", []any{inner})
	var b strings.Builder
	dumpQDict(&b, 1, d)
	want := "    compat: 1.1\n" +
		"    lazy refcounts: true\n" +
		"    bitmaps:\n" +
		"        [0]:\n" +
		"            name: b0\n" +
		"    refcount bits: 16\n"
	if b.String() != want {
		t.Errorf("dumpQDict\n got %q\nwant %q", b.String(), want)
	}
}
