package image

import (
	"errors"
	"path/filepath"
	"strings"
	"testing"

	"pgregory.net/rapid"

	"github.com/ovis-storage/ovis/block"
	"github.com/ovis-storage/ovis/internal/testutil"
)

// TestParseOpts checks what lists parse to, and for those that do not,
// the error's cause, the option it names and the driver it blames.
func TestParseOpts(t *testing.T) {
	tests := []struct {
		spec string
		// check is for a list that parses.
		check func(*Opts) bool
		// err, name and driver are for one that does not.
		err          error
		name, driver string
	}{
		{spec: "file.filename=a", check: func(o *Opts) bool {
			return o.Driver == "" && o.Filename == "a" && o.Cache == block.CacheWriteback && !o.HasCache && o.CacheCleanInterval == -1
		}},
		{spec: "driver=qcow2,file.filename=a,cache.direct=on", check: func(o *Opts) bool { return o.Cache == block.CacheNone && o.HasCache }},
		{spec: "driver=qcow2,file.filename=a,cache.no-flush=on", check: func(o *Opts) bool { return o.Cache == block.CacheUnsafe && o.HasCache }},
		{spec: "driver=raw,file.filename=a,cache.direct=off", check: func(o *Opts) bool { return o.Cache == block.CacheWriteback && o.HasCache }},
		{spec: "driver=qcow2,file.filename=a,,b,l2-cache-size=1M", check: func(o *Opts) bool { return o.Filename == "a,b" && o.L2CacheSize == 1<<20 }},
		{spec: "file.filename=a,read-only,noforce-share", check: func(o *Opts) bool { return o.ReadOnly && !o.ForceShare }},
		{spec: "driver=qcow2,file.filename=a,file.locking=off,read-only=yes,force-share=y", check: func(o *Opts) bool { return o.NoLock && o.ReadOnly && o.ForceShare }},
		{spec: "file.filename=a,file.filename=b", check: func(o *Opts) bool { return o.Filename == "b" }},
		{spec: "file.filename=a,cache-clean-interval=0", check: func(o *Opts) bool { return o.CacheCleanInterval == 0 }},
		{spec: "file.filename=a,discard=unmap,detect-zeroes=on,node-name=x,file.aio=native", check: func(o *Opts) bool { return o.Discard == "unmap" && o.DetectZeroes == "on" }},
		{spec: "file.filename=a,refcount-cache-size=64k,cache-size=0x100000,l2-cache-entry-size=4k", check: func(o *Opts) bool {
			return o.RefcountCacheSize == 64<<10 && o.CacheSize == 1<<20 && o.L2CacheEntrySize == 4<<10
		}},

		{spec: "driver=vmdk,file.filename=a", err: ErrUnknownDriver, name: "driver"},
		{spec: "file.driver=nbd,file.filename=a", err: ErrUnknownDriver, name: "file.driver"},
		{spec: "driver=qcow2,file=node0", err: ErrNodeName, name: "file"},
		{spec: "driver=raw,file.filename=a,l2-cache-size=1M", err: ErrOptUnsupported, name: "l2-cache-size", driver: "raw"},
		{spec: "file.filename=a,bogus=1", err: ErrOptUnsupported, name: "bogus", driver: "qcow2"},
		{spec: "file.filename=a,file.bogus=1", err: ErrOptUnsupported, name: "file.bogus", driver: "file"},
		{spec: "file.filename=a,read-only=maybe", err: ErrOptBool, name: "read-only"},
		{spec: "file.filename=a,cache-size=1Q", err: ErrOptSize, name: "cache-size"},
		{spec: "file.filename=a,cache-size=8E", err: ErrOptSize, name: "cache-size"},
		{spec: "file.filename=a,cache-clean-interval=-1", err: ErrOptNumber, name: "cache-clean-interval"},
		{spec: "file.filename=a,cache-clean-interval=2147483648", err: ErrOptNumber, name: "cache-clean-interval"},
		{spec: "file.filename=a,file.locking=maybe", err: ErrOptValue, name: "file.locking"},
		{spec: "l2-cache-size=1M", err: ErrNoFilename},
		{spec: "driver=raw", err: ErrNoFilename, driver: "raw"},
		{spec: "file.filename=a,cache.direct=on,cache.no-flush=on", err: ErrOptConflict, name: "cache.no-flush"},
	}
	for _, tt := range tests {
		o, err := ParseOpts(tt.spec)
		if tt.err == nil {
			if err != nil || o.Spec != tt.spec || !tt.check(o) {
				t.Errorf("ParseOpts(%q) = %+v, %v", tt.spec, o, err)
			}
			continue
		}
		var oe *OptError
		if !errors.As(err, &oe) || !errors.Is(err, tt.err) || oe.Name != tt.name || oe.Driver != tt.driver || oe.Spec != tt.spec || o != nil {
			t.Errorf("ParseOpts(%q) = %v (%+v), want %v naming %q, driver %q", tt.spec, err, oe, tt.err, tt.name, tt.driver)
		}
	}
}

// TestParseOptsLikeQEMU: the lists ovis takes are those qemu-img info
// --image-opts takes, for options both implement.
func TestParseOptsLikeQEMU(t *testing.T) {
	dir := t.TempDir()
	q := filepath.Join(dir, "a.qcow2")
	testutil.QemuImg(t, "create", "-f", "qcow2", q, "1M")
	for _, list := range []string{
		"driver=qcow2,file.filename=" + q,
		"file.filename=" + q + ",l2-cache-size=64k,read-only=on",
		"driver=raw,file.filename=" + q + ",cache.direct=off",
		"driver=qcow2,file.filename=" + q + ",file.locking=off,force-share=on,read-only=on",
		"driver=qcow2,file.filename=" + q + ",cache-clean-interval=30",
		"driver=raw,file.filename=" + q + ",l2-cache-size=1M",
		"driver=qcow2,file.filename=" + q + ",bogus=1",
		"driver=qcow2,file.filename=" + q + ",file.bogus=1",
		"driver=qcow2,file.filename=" + q + ",read-only=maybe",
		"driver=qcow2,file.filename=" + q + ",cache-size=1Q",
		"driver=qcow2,file.filename=" + q + ",file.locking=maybe",
		"driver=qcow2,file.filename=" + q + ",cache-clean-interval=-1",
		"driver=nosuch,file.filename=" + q,
		"driver=qcow2",
		"l2-cache-size=1M",
	} {
		_, err := ParseOpts(list)
		out, code := testutil.QemuImgExit(t, "info", "--image-opts", list)
		if (err == nil) != (code == 0) {
			t.Errorf("%q: ParseOpts: %v; qemu-img exits %d: %s", list, err, code, out)
		}
	}
}

// TestOptsApply: what a list gives replaces or adds to the options, and
// what it does not give leaves them as they were.
func TestOptsApply(t *testing.T) {
	base := Options{ReadOnly: false, L2CacheSize: 1 << 20, CacheSize: 5 << 20, CacheCleanInterval: 600}
	o, err := ParseOpts("file.filename=a,read-only=on,l2-cache-size=2M,cache-clean-interval=0,file.locking=off")
	if err != nil {
		t.Fatal(err)
	}
	got := o.Apply(base)
	if !got.ReadOnly || !got.NoLock || got.ForceShare || got.L2CacheSize != 2<<20 || got.CacheSize != 5<<20 || got.CacheCleanInterval != 0 || got.OpenFile != nil {
		t.Errorf("Apply = %+v", got)
	}
	o, err = ParseOpts("file.filename=a,cache.direct=on")
	if err != nil {
		t.Fatal(err)
	}
	got = o.Apply(Options{ReadOnly: true, CacheCleanInterval: 600})
	if !got.ReadOnly || got.OpenFile == nil || got.CacheCleanInterval != 600 {
		t.Errorf("Apply of cache.direct = %+v", got)
	}
}

// TestSplitOptsRoundTrip: a list made from pairs by escaping commas in
// values splits back into the same pairs.
func TestSplitOptsRoundTrip(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		// Names hold no '=' or ','; ones starting "no" are fine with a
		// value.
		n := rapid.IntRange(0, 6).Draw(t, "n")
		var want []Opt
		var parts []string
		for i := range n {
			name := rapid.StringMatching(`[a-z][a-z.-]{0,8}`).Draw(t, "name")
			value := rapid.StringOf(rapid.SampledFrom([]rune("ab=,.x "))).Draw(t, "value")
			_ = i
			want = append(want, Opt{name, value})
			parts = append(parts, name+"="+strings.ReplaceAll(value, ",", ",,"))
		}
		got := SplitOpts(strings.Join(parts, ","))
		if len(got) != len(want) {
			t.Fatalf("%q split into %q, want %q", strings.Join(parts, ","), got, want)
		}
		for i := range got {
			if got[i] != want[i] {
				t.Fatalf("%q split into %q, want %q", strings.Join(parts, ","), got, want)
			}
		}
	})
}

// TestSplitOptsFlags: bare names are flags.
func TestSplitOptsFlags(t *testing.T) {
	got := SplitOpts("read-only,noforce-share,a=1,,2,")
	want := []Opt{{"read-only", "on"}, {"force-share", "off"}, {"a", "1,2"}}
	if len(got) != len(want) {
		t.Fatalf("SplitOpts = %q, want %q", got, want)
	}
	for i := range got {
		if got[i] != want[i] {
			t.Fatalf("SplitOpts = %q, want %q", got, want)
		}
	}
}

// FuzzParseOpts: any string parses or fails with an *OptError, never a
// panic; what parses names a file, keeps the list as given, and parses
// the same again.
func FuzzParseOpts(f *testing.F) {
	f.Add("driver=qcow2,file.filename=a,l2-cache-size=1M,cache.direct=on")
	f.Add("file.filename=a,,b,,")
	f.Add(",=,,=")
	f.Add("driver=raw,file.filename=x,file.locking=off,read-only,noforce-share")
	f.Add("file=node,driver=qcow2")
	f.Fuzz(func(t *testing.T, s string) {
		o, err := ParseOpts(s)
		if err != nil {
			var oe *OptError
			if !errors.As(err, &oe) || oe.Spec != s || oe.Err == nil {
				t.Fatalf("%q: error %v is no *OptError for the list", s, err)
			}
			return
		}
		if o.Filename == "" || o.Spec != s {
			t.Fatalf("%q parsed to %+v", s, o)
		}
		again, err := ParseOpts(s)
		if err != nil || *again != *o {
			t.Fatalf("%q parsed to %+v, then %+v, %v", s, o, again, err)
		}
	})
}
