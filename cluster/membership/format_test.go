package membership

import (
	"errors"
	"strings"
	"testing"

	"github.com/ovis-storage/ovis/cluster/object"
)

func TestNewFormat(t *testing.T) {
	tests := []struct {
		name  string
		f     Format
		zones int
		want  int    // the copies of the result
		bad   string // a word the error must contain; "" for valid
	}{
		{"copies default to 1", Format{}, 1, 1, ""},
		{"copies as many as zones", Format{Copies: 3}, 3, 3, ""},
		{"fewer copies than zones", Format{Copies: 2, ObjectShift: 20}, 5, 2, ""},
		// ovis up formats with copies = the nodes it starts, each its
		// own zone: it passes; one more copy than nodes does not.
		{"ovis up: copies = nodes", Format{Copies: 4}, 4, 4, ""},
		{"copies above zones", Format{Copies: 4}, 3, 0, "the cluster has 3 nodes"},
		{"no node yet", Format{}, 0, 0, "copies 1"},
		{"too many copies", Format{Copies: MaxCopies + 1}, 100, 0, "copies 17"},
		{"negative copies", Format{Copies: -1}, 3, 0, "copies -1"},
		{"object too small", Format{Copies: 1, ObjectShift: 19}, 3, 0, "2^19"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f, err := NewFormat(tt.f, tt.zones)
			if tt.bad == "" {
				if err != nil || f.Copies != tt.want || f.ObjectShift != tt.f.ObjectShift {
					t.Fatalf("NewFormat(%+v, %d) = %+v, %v; want copies %d", tt.f, tt.zones, f, err, tt.want)
				}
				return
			}
			if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), tt.bad) {
				t.Fatalf("NewFormat(%+v, %d): %v; want ErrInvalid mentioning %q", tt.f, tt.zones, err, tt.bad)
			}
		})
	}
	var ze *ZonesError
	if _, err := NewFormat(Format{Copies: 2}, 1); !errors.As(err, &ze) || ze.Copies != 2 || ze.Zones != 1 {
		t.Fatalf("copies 2 in 1 zone: %v, want a ZonesError{2, 1}", err)
	}
}

func TestNewVDIFillsDefaults(t *testing.T) {
	for _, tt := range []struct {
		name   string
		f      Format
		v      VDI
		copies int
		shift  uint8
	}{
		{"the format's", Format{Copies: 2, ObjectShift: 20}, VDI{Name: "a", Size: 1 << 30}, 2, 20},
		{"its own", Format{Copies: 2, ObjectShift: 20}, VDI{Name: "a", Size: 1 << 30, Copies: 1, ObjectShift: 23}, 1, 23},
		{"the default object size", Format{Copies: 1}, VDI{Name: "a", Size: 1 << 30}, 1, object.DefaultSizeShift},
	} {
		v, err := NewVDI(tt.v, tt.f, 3)
		if err != nil || v.Copies != tt.copies || v.ObjectShift != tt.shift || v.Name != tt.v.Name || v.Size != tt.v.Size {
			t.Errorf("%s: NewVDI = %+v, %v; want copies %d, shift %d", tt.name, v, err, tt.copies, tt.shift)
		}
	}
	if _, err := NewVDI(VDI{Name: "a", Size: 1 << 30}, Format{Copies: 3}, 2); !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "zones") {
		t.Fatalf("default copies 3 in 2 zones: %v, want ErrInvalid naming the zones", err)
	}
}

// FormatIn is what every entry point formats with: it checks the copies
// against the view's zones before anything is written.
func TestFormatInChecksZones(t *testing.T) {
	t.Parallel()
	c := newClient(t, shared.Endpoints(), "")
	join(t, c, "n1", 0)
	join(t, c, "n2", 0)
	v, err := c.View(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.FormatIn(ctx, v, Format{Copies: 3}, false); !errors.Is(err, ErrInvalid) {
		t.Fatalf("copies 3 on 2 nodes: %v, want ErrInvalid", err)
	}
	if _, err := c.GetFormat(ctx); !errors.Is(err, ErrNotFormatted) {
		t.Fatalf("a refused FormatIn wrote a format: %v", err)
	}
	f, err := c.FormatIn(ctx, v, Format{}, false)
	if err != nil {
		t.Fatal(err)
	}
	if f.Copies != 1 || f.ObjectShift != object.DefaultSizeShift || f.ClusterID == "" {
		t.Fatalf("FormatIn with defaults gave %+v: want copies 1, the default object size, an id", f)
	}
	if _, err := c.FormatIn(ctx, v, Format{Copies: 2}, false); !errors.Is(err, ErrFormatted) {
		t.Fatalf("second FormatIn: %v, want ErrFormatted", err)
	}
	if f, err = c.FormatIn(ctx, v, Format{Copies: 2}, true); err != nil || f.Copies != 2 {
		t.Fatalf("forced FormatIn: %+v, %v", f, err)
	}
}
