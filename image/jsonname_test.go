package image

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"

	"pgregory.net/rapid"
)

func TestFlattenJSON(t *testing.T) {
	tests := []struct {
		in       string
		want     string
		fileProt bool
		err      error // nil: any *JSONError when want is ""
	}{
		{in: `{"driver": "qcow2", "file": {"driver": "file", "filename": "a,b"}}`, want: "driver=qcow2,file.driver=file,file.filename=a,,b"},
		{in: `{"driver": "file", "filename": "x", "locking": "off"}`, want: "driver=raw,file.filename=x,file.locking=off", fileProt: true},
		{in: `{"read-only": true, "force-share": false, "node-name": null, "l2-cache-size": 65536}`, want: "read-only=on,force-share=off,l2-cache-size=65536"},
		{in: `{"a": [1, {"b": "c"}]}`, want: "a.0=1,a.1.b=c"},
		{in: `[]`, err: ErrJSONNotObject},
		{in: `"x"`, err: ErrJSONNotObject},
		{in: `{} {}`, err: ErrJSONTrailing},
		{in: `{"a": }`},
		{in: `{"a": 1`},
		{in: ``},
	}
	for _, tt := range tests {
		got, fp, err := FlattenJSON(tt.in)
		if tt.want != "" {
			if err != nil || got != tt.want || fp != tt.fileProt {
				t.Errorf("FlattenJSON(%s) = %q, %v, %v, want %q, %v", tt.in, got, fp, err, tt.want, tt.fileProt)
			}
			continue
		}
		var je *JSONError
		if !errors.As(err, &je) || je.Input != tt.in || tt.err != nil && !errors.Is(err, tt.err) {
			t.Errorf("FlattenJSON(%s) = %q, %v, want a *JSONError (%v)", tt.in, got, err, tt.err)
		}
	}
}

// TestFlattenJSONRoundTrip: a flat object of strings flattens into a list
// that splits back into its members, in order.
func TestFlattenJSONRoundTrip(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		n := rapid.IntRange(0, 5).Draw(t, "n")
		var want []Opt
		var b strings.Builder
		b.WriteByte('{')
		seen := map[string]bool{}
		for range n {
			name := rapid.StringMatching(`[a-z][a-z-]{0,6}`).Draw(t, "name")
			if seen[name] || name == "driver" {
				continue
			}
			seen[name] = true
			value := rapid.StringOf(rapid.SampledFrom([]rune(`ab,= "\`))).Draw(t, "value")
			if len(want) > 0 {
				b.WriteByte(',')
			}
			k, _ := json.Marshal(name)
			v, _ := json.Marshal(value)
			b.Write(k)
			b.WriteByte(':')
			b.Write(v)
			want = append(want, Opt{name, value})
		}
		b.WriteByte('}')
		list, fp, err := FlattenJSON(b.String())
		if err != nil || fp {
			t.Fatalf("FlattenJSON(%s) = %q, %v, %v", b.String(), list, fp, err)
		}
		got := SplitOpts(list)
		if len(got) != len(want) {
			t.Fatalf("%s flattened to %q, which splits into %q", b.String(), list, got)
		}
		for i := range got {
			if got[i] != want[i] {
				t.Fatalf("%s flattened to %q, which splits into %q", b.String(), list, got)
			}
		}
	})
}

// FuzzFlattenJSON: any text flattens or fails with a *JSONError, never a
// panic, and what valid JSON flattens to parses as an option list or
// fails as one.
func FuzzFlattenJSON(f *testing.F) {
	f.Add(`{"driver": "qcow2", "file": {"driver": "file", "filename": "a"}}`)
	f.Add(`{"driver": "file", "filename": "x"}`)
	f.Add(`{"a": [1, true, null, {"b": "c,d"}]}`)
	f.Add(`{"a": }`)
	f.Fuzz(func(t *testing.T, s string) {
		list, _, err := FlattenJSON(s)
		if err != nil {
			var je *JSONError
			if !errors.As(err, &je) || je.Input != s {
				t.Fatalf("%q: error %v is no *JSONError", s, err)
			}
			return
		}
		if !json.Valid([]byte(s)) {
			t.Fatalf("%q is not JSON, yet flattened to %q", s, list)
		}
		if _, err := ParseOpts(list); err != nil {
			var oe *OptError
			if !errors.As(err, &oe) {
				t.Fatalf("%q flattened to %q, whose error %v is no *OptError", s, list, err)
			}
		}
	})
}
