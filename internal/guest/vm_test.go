package guest

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// bootRaw boots script against a fresh raw file of size bytes.
func bootRaw(t *testing.T, script string, size int64) *VM {
	t.Helper()
	k, err := FindKernel()
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	disk := filepath.Join(dir, "disk.raw")
	if err := os.WriteFile(disk, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(disk, size); err != nil {
		t.Fatal(err)
	}
	v, err := Start(context.Background(), Config{Kernel: k, Script: script, Drive: disk, Dir: dir, Timeout: 2 * time.Minute, AnswerTimeout: 30 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		v.Close()
		if t.Failed() {
			t.Logf("guest console (%s):\n%s", v.Accel(), v.Console())
		}
	})
	return v
}

// TestGuestPhases boots the guest against a raw file: the phases reach the
// test in order with their values, the answer releases the guest, and the
// power-off ends QEMU.
func TestGuestPhases(t *testing.T) {
	v := bootRaw(t, `
phase one cache="$(tr ' ' _ < /sys/block/vda/cache_type)"
dd if=/dev/urandom of=/tmp/p bs=64k count=16 2>/dev/null
dd if=/tmp/p of=/dev/vda bs=64k oflag=direct 2>/dev/null
a=$(md5sum < /tmp/p | cut -d' ' -f1)
b=$(dd if=/dev/vda bs=64k count=16 iflag=direct 2>/dev/null | md5sum | cut -d' ' -f1)
[ "$a" = "$b" ] || fail "read back $b, wrote $a"
say NOTE sum=$a
phase two sum=$a
mkfs.ext4 -q -F /dev/vda
mount /dev/vda /mnt
cp /tmp/p /mnt/p
umount /mnt
e2fsck -fn /dev/vda
`, 64<<20)
	ctx := context.Background()
	e, err := v.Phase(ctx, "one")
	if err != nil {
		t.Fatal(err)
	}
	if got := e.Args["cache"]; got != "write_back" {
		t.Errorf("cache_type of a writeback drive: %s, want write_back", got)
	}
	if err := v.Continue(); err != nil {
		t.Fatal(err)
	}
	e, err = v.Phase(ctx, "two")
	if err != nil {
		t.Fatal(err)
	}
	if len(e.Args["sum"]) != 32 {
		t.Errorf("phase two: sum %q", e.Args["sum"])
	}
	if err := v.Continue(); err != nil {
		t.Fatal(err)
	}
	if err := v.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	var note bool
	for _, e := range v.Events() {
		note = note || e.Kind == "NOTE"
	}
	if !note {
		t.Errorf("events %v: no NOTE", v.Events())
	}
	t.Logf("%s: %v", v.Accel(), v.Elapsed())
}

// TestGuestFailures: every way a run can go wrong ends as an error that
// names it, within the configured time, not as a hang.
func TestGuestFailures(t *testing.T) {
	for _, c := range []struct {
		name   string
		script string
		phase  string // a phase to wait for first
		answer bool   // and to answer
		cfg    func(*Config)
		want   string
	}{
		{"failing command", "false\n", "", false, nil, "script exited"},
		{"fail", "fail disk on fire\n", "", false, nil, "disk on fire"},
		{"no answer", "phase wait\n", "wait", false, func(c *Config) { c.AnswerTimeout = 2 * time.Second }, "phase wait: no answer in 2 s"},
		{"phase nobody expects", "phase surprise\n", "", false, nil, "surprise"},
		{"run timeout", "sleep 600\n", "", false, func(c *Config) { c.Timeout = 10 * time.Second }, "QEMU exited (signal: killed)"},
		{"panic", "phase go\necho c > /proc/sysrq-trigger\n", "go", true, nil, "QEMU exited"},
	} {
		t.Run(c.name, func(t *testing.T) {
			k, err := FindKernel()
			if err != nil {
				t.Fatal(err)
			}
			dir := t.TempDir()
			disk := filepath.Join(dir, "disk.raw")
			if err := os.WriteFile(disk, make([]byte, 1<<20), 0o644); err != nil {
				t.Fatal(err)
			}
			cfg := Config{Kernel: k, Script: c.script, Drive: disk, Dir: dir, Timeout: time.Minute, AnswerTimeout: 30 * time.Second}
			if c.cfg != nil {
				c.cfg(&cfg)
			}
			v, err := Start(context.Background(), cfg)
			if err != nil {
				t.Fatal(err)
			}
			defer v.Close()
			if c.phase != "" {
				if _, err := v.Phase(context.Background(), c.phase); err != nil {
					t.Fatal(err)
				}
			}
			if c.answer {
				if err := v.Continue(); err != nil {
					t.Fatal(err)
				}
			}
			err = v.Wait(context.Background())
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("Wait: %v; want an error with %q\nconsole:\n%s", err, c.want, v.Console())
			}
			if v.Elapsed() > cfg.Timeout+10*time.Second {
				t.Errorf("the run took %v, past its %v timeout", v.Elapsed(), cfg.Timeout)
			}
		})
	}
}
