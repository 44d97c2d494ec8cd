package membership

import (
	"errors"
	"strings"
	"testing"
	"unicode"
	"unicode/utf8"

	"github.com/ovis-storage/ovis/cluster/object"
)

func TestValidateVDI(t *testing.T) {
	f := Format{Copies: 2, ObjectShift: object.DefaultSizeShift}
	ok := VDI{Name: "disk0", Size: 1 << 30}
	with := func(mod func(*VDI)) VDI { v := ok; mod(&v); return v }
	tests := []struct {
		name  string
		v     VDI
		zones int
		bad   string // a word the error must contain; "" for valid
	}{
		{"valid with defaults", ok, 3, ""},
		{"valid explicit", with(func(v *VDI) { v.Copies = 3; v.ObjectShift = 20 }), 3, ""},
		{"name of 255 bytes", with(func(v *VDI) { v.Name = strings.Repeat("x", 255) }), 3, ""},
		{"unicode name", with(func(v *VDI) { v.Name = "dïsk ünicode" }), 3, ""},
		{"empty name", with(func(v *VDI) { v.Name = "" }), 3, "empty"},
		{"long name", with(func(v *VDI) { v.Name = strings.Repeat("x", 256) }), 3, "256 bytes"},
		{"slash", with(func(v *VDI) { v.Name = "a/b" }), 3, "'/'"},
		{"newline", with(func(v *VDI) { v.Name = "a\nb" }), 3, "non-printable"},
		{"nul", with(func(v *VDI) { v.Name = "a\x00" }), 3, "non-printable"},
		{"del", with(func(v *VDI) { v.Name = "a\x7f" }), 3, "non-printable"},
		{"bad utf8", with(func(v *VDI) { v.Name = "a\xff" }), 3, "UTF-8"},
		{"dot dot", with(func(v *VDI) { v.Name = ".." }), 3, "reserved"},
		{"zero size", with(func(v *VDI) { v.Size = 0 }), 3, "size 0"},
		{"negative size", with(func(v *VDI) { v.Size = -512 }), 3, "size -512"},
		{"unaligned size", with(func(v *VDI) { v.Size = 1000 }), 3, "multiple of 512"},
		{"size at the limit", with(func(v *VDI) { v.Size = object.MaxVDISize(4 << 20) }), 3, ""},
		{"too large", with(func(v *VDI) { v.Size = object.MaxVDISize(4<<20) + 512 }), 3, "more than"},
		{"64 TiB with 1 MiB objects", with(func(v *VDI) { v.Size = 64 << 40; v.ObjectShift = 20 }), 3, ""},
		{"copies above zones", with(func(v *VDI) { v.Copies = 3 }), 2, "zones"},
		{"default copies above zones", ok, 1, "zones"},
		{"no zones", ok, 0, "zones"},
		{"negative copies", with(func(v *VDI) { v.Copies = -1 }), 3, "copies -1"},
		{"too many copies", with(func(v *VDI) { v.Copies = MaxCopies + 1 }), 100, "copies 17"},
		{"object too small", with(func(v *VDI) { v.ObjectShift = 19 }), 3, "2^19"},
		{"object too big", with(func(v *VDI) { v.ObjectShift = 27 }), 3, "2^27"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := ValidateVDI(tt.v, f, tt.zones)
			if tt.bad == "" {
				if err != nil {
					t.Fatalf("ValidateVDI: %v", err)
				}
				return
			}
			if err == nil {
				t.Fatalf("ValidateVDI accepted %+v with %d zones", tt.v, tt.zones)
			}
			if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), tt.bad) {
				t.Fatalf("ValidateVDI: %v; want ErrInvalid mentioning %q", err, tt.bad)
			}
		})
	}
}

func TestFormatValidate(t *testing.T) {
	tests := []struct {
		f  Format
		ok bool
	}{
		{Format{Copies: 1}, true},
		{Format{Copies: 3, ObjectShift: 26}, true},
		{Format{Copies: 0}, false},
		{Format{Copies: MaxCopies + 1}, false},
		{Format{Copies: 1, ObjectShift: 12}, false},
	}
	for _, tt := range tests {
		if err := tt.f.Validate(); (err == nil) != tt.ok {
			t.Errorf("Validate(%+v) = %v, want ok %v", tt.f, err, tt.ok)
		}
	}
}

func TestConfigValidate(t *testing.T) {
	tests := []struct {
		cfg  Config
		want string
	}{
		{Config{Endpoints: []string{"http://x:1"}}, ""},
		{Config{}, "no etcd endpoints"},
		{Config{Endpoints: []string{""}}, "empty etcd endpoint"},
		{Config{Endpoints: []string{"x"}, Prefix: "ovis"}, `prefix "ovis"`},
		{Config{Endpoints: []string{"x"}, DialTimeout: -1}, "negative"},
	}
	for _, tt := range tests {
		err := tt.cfg.Validate()
		if tt.want == "" && err != nil || tt.want != "" && (err == nil || !strings.Contains(err.Error(), tt.want)) {
			t.Errorf("Validate(%+v) = %v, want %q", tt.cfg, err, tt.want)
		}
	}
}

// FuzzValidName checks that every accepted name is safe to put in a
// key and print: no '/', valid UTF-8, printable, 1 to 255 bytes.
func FuzzValidName(f *testing.F) {
	for _, s := range []string{"disk0", "", "a/b", "a\x00", "\xff", "..", "dïsk", strings.Repeat("x", 256), "a b", "\u200b"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		if validName(s) != nil {
			return
		}
		if s == "" || len(s) > MaxNameLen || strings.Contains(s, "/") || !utf8.ValidString(s) {
			t.Fatalf("accepted %q", s)
		}
		for _, r := range s {
			if unicode.IsControl(r) {
				t.Fatalf("accepted %q with control character %U", s, r)
			}
		}
	})
}

// FuzzParseEpochKey checks that epoch keys round-trip and that nothing
// else parses.
func FuzzParseEpochKey(f *testing.F) {
	k := keys{"/ovis/"}
	f.Add(k.epochAt(1))
	f.Add(k.epochAt(1 << 60))
	f.Add("/ovis/epochs/xyz")
	f.Add("/ovis/epochs/-000000000000001")
	f.Fuzz(func(t *testing.T, s string) {
		e, err := k.parseEpochKey(s)
		if err != nil {
			return
		}
		if k.epochAt(e) != s {
			t.Fatalf("%q parsed as %d, which renders as %q", s, e, k.epochAt(e))
		}
	})
}
