package img

import (
	"testing"

	"github.com/ovis-storage/ovis/block"
)

func TestParseImageOpts(t *testing.T) {
	for _, c := range []struct {
		spec    string
		ok      bool
		check   func(*ImageOpts) bool
		explain string
	}{
		{"file.filename=a", true, func(o *ImageOpts) bool { return o.Driver == "" && o.Cache == block.CacheWriteback && !o.HasCache }, "probe, writeback"},
		{"driver=qcow2,file.filename=a,cache.direct=on", true, func(o *ImageOpts) bool { return o.Cache == block.CacheNone && o.HasCache }, "direct: none"},
		{"driver=qcow2,file.filename=a,cache.no-flush=on", true, func(o *ImageOpts) bool { return o.Cache == block.CacheUnsafe }, "no-flush: unsafe"},
		{"driver=qcow2,file.filename=a,cache.direct=on,cache.no-flush=on", false, nil, "both unsupported"},
		{"driver=qcow2,file.filename=a,,b,l2-cache-size=1M", true, func(o *ImageOpts) bool { return o.Filename == "a,b" && o.L2CacheSize == 1<<20 }, ",, escapes a comma"},
		{"driver=qcow2,file.filename=a,file.locking=off,read-only=on,force-share=on", true, func(o *ImageOpts) bool { return o.NoLock && o.ReadOnly && o.ForceShare }, "flags"},
		{"driver=qcow2,file.filename=a,cache-clean-interval=0", true, func(o *ImageOpts) bool { return o.CacheCleanInterval == 0 }, "interval 0 is given"},
		{"driver=qcow2,file.filename=a", true, func(o *ImageOpts) bool { return o.CacheCleanInterval == -1 }, "interval not given"},
		{"driver=raw,file.filename=a,l2-cache-size=1M", false, nil, "raw has no cache options"},
		{"driver=qcow2,file.filename=a,file.locking=maybe", false, nil, "bad locking"},
		{"driver=qcow2,file.filename=a,cache-clean-interval=-1", false, nil, "negative interval"},
	} {
		o, err := ParseImageOpts(c.spec)
		if (err == nil) != c.ok {
			t.Errorf("%q (%s): err %v, want ok=%v", c.spec, c.explain, err, c.ok)
			continue
		}
		if c.ok && !c.check(o) {
			t.Errorf("%q (%s): parsed %+v", c.spec, c.explain, o)
		}
	}
}

// FuzzParseImageOpts: any string parses or fails with an error, never a
// panic, and what parses names a file and keeps the list as given.
func FuzzParseImageOpts(f *testing.F) {
	f.Add("driver=qcow2,file.filename=a,l2-cache-size=1M,cache.direct=on")
	f.Add("file.filename=a,,b,,")
	f.Add(",=,,=")
	f.Fuzz(func(t *testing.T, s string) {
		o, err := ParseImageOpts(s)
		if err != nil {
			return
		}
		if o.Filename == "" || o.Spec != s {
			t.Fatalf("%q parsed to %+v", s, o)
		}
	})
}
