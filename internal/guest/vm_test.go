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

// TestGuestFail: a failing command in the script surfaces as an error
// with the guest's message, not as a hang.
func TestGuestFail(t *testing.T) {
	v := bootRaw(t, "false\n", 1<<20)
	err := v.Wait(context.Background())
	if err == nil || !strings.Contains(err.Error(), "script exited") {
		t.Fatalf("Wait after a failing script: %v", err)
	}
}
