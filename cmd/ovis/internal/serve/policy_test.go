package serve

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/ovis-storage/ovis/block"
)

// recorder is a block.Device that records the calls that reach it.
type recorder struct {
	size  int64
	calls []string
}

func (r *recorder) ReadAt(p []byte, off int64) (int, error) { return len(p), nil }
func (r *recorder) WriteAt(p []byte, off int64, fua bool) (int, error) {
	r.calls = append(r.calls, fmt.Sprintf("write %d+%d fua=%v", off, len(p), fua))
	return len(p), nil
}
func (r *recorder) WriteZeroes(off, n int64, mayUnmap, fua bool) error {
	r.calls = append(r.calls, fmt.Sprintf("zero %d+%d unmap=%v fua=%v", off, n, mayUnmap, fua))
	return nil
}
func (r *recorder) Discard(off, n int64) error {
	if err := block.CheckRange(off, n, r.size); err != nil {
		return err
	}
	r.calls = append(r.calls, fmt.Sprintf("discard %d+%d", off, n))
	return nil
}
func (r *recorder) Flush() error                              { return nil }
func (r *recorder) Extent(off, n int64) (block.Extent, error) { return block.Extent{Length: n}, nil }
func (r *recorder) Size() int64                               { return r.size }
func (r *recorder) Close() error                              { return nil }

// TestPolicy checks what each --discard and --detect-zeroes combination
// sends to the device, as QEMU's block layer would.
func TestPolicy(t *testing.T) {
	zeros := make([]byte, 100<<10)
	data := make([]byte, 100<<10)
	data[len(data)-1] = 1
	for _, tc := range []struct {
		discard Discard
		zeroes  DetectZeroes
		want    []string
	}{
		{DiscardIgnore, DetectZeroesOff, []string{
			"write 0+102400 fua=false", "write 4096+102400 fua=true",
			"zero 0+8192 unmap=true fua=false", "zero 0+8192 unmap=false fua=true"}},
		{DiscardUnmap, DetectZeroesOff, []string{
			"write 0+102400 fua=false", "write 4096+102400 fua=true",
			"zero 0+8192 unmap=true fua=false", "zero 0+8192 unmap=false fua=true", "discard 512+4096"}},
		{DiscardIgnore, DetectZeroesOn, []string{
			"zero 0+102400 unmap=false fua=false", "write 4096+102400 fua=true",
			"zero 0+8192 unmap=true fua=false", "zero 0+8192 unmap=false fua=true"}},
		{DiscardUnmap, DetectZeroesUnmap, []string{
			"zero 0+102400 unmap=true fua=false", "write 4096+102400 fua=true",
			"zero 0+8192 unmap=true fua=false", "zero 0+8192 unmap=false fua=true", "discard 512+4096"}},
	} {
		t.Run(tc.discard.String()+"/"+tc.zeroes.String(), func(t *testing.T) {
			r := &recorder{size: 1 << 20}
			d := withPolicy(r, tc.discard, tc.zeroes)
			if n, err := d.WriteAt(zeros, 0, false); n != len(zeros) || err != nil {
				t.Fatalf("WriteAt zeros: %d, %v", n, err)
			}
			if _, err := d.WriteAt(data, 4096, true); err != nil {
				t.Fatal(err)
			}
			if err := d.WriteZeroes(0, 8192, true, false); err != nil {
				t.Fatal(err)
			}
			if err := d.WriteZeroes(0, 8192, false, true); err != nil {
				t.Fatal(err)
			}
			if err := d.Discard(512, 4096); err != nil {
				t.Fatal(err)
			}
			if err := d.Discard(1<<20, 1); !errors.Is(err, block.ErrOutOfRange) {
				t.Errorf("Discard past the end: %v, want ErrOutOfRange", err)
			}
			if got, want := strings.Join(r.calls, "\n"), strings.Join(tc.want, "\n"); got != want {
				t.Errorf("calls:\n%s\nwant:\n%s", got, want)
			}
		})
	}
}

func TestValidate(t *testing.T) {
	for _, tc := range []struct {
		cfg  Config
		want string
	}{
		{Config{}, "no image file"},
		{Config{File: "x", Format: "vmdk"}, "Unknown driver 'vmdk'"},
		{Config{File: "x", Socket: "rel.sock"}, "socket path must be absolute"},
		{Config{File: "x", Shared: -1}, "Invalid shared device number '-1'"},
		{Config{File: "x", DetectZeroes: DetectZeroesUnmap}, "not allowed without setting discard operation to unmap"},
		{Config{File: "x", TLSKey: "k"}, "must be given together"},
		{Config{File: "x", TLSCA: "ca"}, "--tls-ca needs"},
		{Config{File: "x", L2CachePolicy: "mru"}, "Invalid l2-cache-policy 'mru'"},
		{Config{File: "x", CacheSize: -1}, "cache-size -1"},
		{Config{File: "x", ExportName: strings.Repeat("a", 4097)}, "too long"},
	} {
		err := tc.cfg.Validate()
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("Validate(%+v) = %v, want %q", tc.cfg, err, tc.want)
		}
	}
	ok := Config{File: "x", Discard: DiscardUnmap, DetectZeroes: DetectZeroesUnmap, Shared: 0, Socket: "/s"}
	if err := ok.Validate(); err != nil {
		t.Errorf("Validate(%+v) = %v", ok, err)
	}
}

func TestParse(t *testing.T) {
	for s, want := range map[string]Discard{"ignore": DiscardIgnore, "off": DiscardIgnore, "unmap": DiscardUnmap, "on": DiscardUnmap} {
		if got, err := ParseDiscard(s); got != want || err != nil {
			t.Errorf("ParseDiscard(%q) = %v, %v", s, got, err)
		}
	}
	if _, err := ParseDiscard("trim"); err == nil || err.Error() != "Invalid discard mode `trim'" {
		t.Errorf("ParseDiscard(trim): %v", err)
	}
	for s, want := range map[string]DetectZeroes{"off": DetectZeroesOff, "on": DetectZeroesOn, "unmap": DetectZeroesUnmap} {
		if got, err := ParseDetectZeroes(s); got != want || err != nil {
			t.Errorf("ParseDetectZeroes(%q) = %v, %v", s, got, err)
		}
	}
	if _, err := ParseCacheMode("fast"); err == nil || err.Error() != "Invalid cache mode `fast'" {
		t.Errorf("ParseCacheMode(fast): %v", err)
	}
}
