package nbd

import (
	"slices"
	"testing"
)

// TestMatchContexts selects contexts by query for LIST and SET, with two
// dirty bitmaps on the export.
func TestMatchContexts(t *testing.T) {
	e := &Export{Bitmaps: []ExportBitmap{{Name: "b0"}, {Name: "b:1"}}}
	all := contextsOf(e)
	tests := []struct {
		queries []string
		list    bool
		want    []string
	}{
		{nil, true, []string{"base:allocation", "qemu:allocation-depth", "qemu:dirty-bitmap:b0", "qemu:dirty-bitmap:b:1"}},
		{nil, false, nil},
		{[]string{"qemu:"}, true, []string{"qemu:allocation-depth", "qemu:dirty-bitmap:b0", "qemu:dirty-bitmap:b:1"}},
		{[]string{"qemu:"}, false, nil},
		{[]string{"qemu:dirty-bitmap:"}, true, []string{"qemu:dirty-bitmap:b0", "qemu:dirty-bitmap:b:1"}},
		{[]string{"qemu:dirty-bitmap:"}, false, nil},
		{[]string{"qemu:dirty-bitmap:b:1", "base:allocation"}, false, []string{"base:allocation", "qemu:dirty-bitmap:b:1"}},
		{[]string{"qemu:dirty-bitmap:b0", "qemu:dirty-bitmap:b0"}, false, []string{"qemu:dirty-bitmap:b0"}},
		{[]string{"qemu:dirty-bitmap:b"}, true, nil},
		{[]string{"qemu:dirty-bitmap:nosuch", "foo", "x:y"}, false, nil},
	}
	for _, tt := range tests {
		var got []string
		for _, c := range matchContexts(all, tt.queries, tt.list) {
			got = append(got, c.name)
		}
		if !slices.Equal(got, tt.want) {
			t.Errorf("matchContexts(%q, list=%v) = %q, want %q", tt.queries, tt.list, got, tt.want)
		}
	}
}
