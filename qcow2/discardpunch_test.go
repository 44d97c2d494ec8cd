package qcow2

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/ovis-storage/ovis/internal/testutil"
)

// qemuNBDRequests serves path with qemu-nbd --discard=unmap and sends it
// the qemu-io commands over NBD; qemu-nbd exits once the client leaves.
func qemuNBDRequests(t *testing.T, path string, cmds ...string) {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "sock")
	srv := exec.Command("qemu-nbd", "-f", "qcow2", "--discard=unmap", "-k", sock, path)
	var errb strings.Builder
	srv.Stderr = &errb
	if err := srv.Start(); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 100; i++ {
		if _, err := os.Stat(sock); err == nil {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	args := []string{"-f", "raw"}
	for _, c := range cmds {
		args = append(args, "-c", c)
	}
	args = append(args, "nbd+unix:///?socket="+sock)
	out, stderr, code := testutil.RunIn(t, "", "qemu-io", args...)
	if code != 0 || strings.Contains(out+stderr, "failed") {
		_ = srv.Process.Kill()
		t.Fatalf("qemu-io over qemu-nbd: exit %d %s%s", code, out, stderr)
	}
	done := make(chan error, 1)
	go func() { done <- srv.Wait() }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("qemu-nbd: %v: %s", err, errb.String())
		}
	case <-time.After(10 * time.Second):
		_ = srv.Process.Kill()
		t.Fatal("qemu-nbd did not exit after its client")
	}
}

// TestDiscardPunchLikeQemuNBD: with pass-discard-request (qemu-nbd
// --discard=unmap), the host clusters that a TRIM or an unmapping zero
// write frees are punched in the file, as qemu-nbd punches them; the map
// and the file's allocated blocks match qemu-nbd's on a twin. A cluster a
// snapshot still references keeps its space.
func TestDiscardPunchLikeQemuNBD(t *testing.T) {
	cases := []struct {
		compat  string
		backing bool
		extL2   bool
		snap    bool
	}{
		{"1.1", false, false, false},
		{"1.1", true, false, false},
		{"0.10", false, false, false},
		{"0.10", true, false, false},
		{"1.1", false, true, false},
		{"1.1", true, true, false},
		{"1.1", false, false, true},
	}
	for _, tc := range cases {
		name := fmt.Sprintf("compat=%s,backing=%v,extL2=%v,snap=%v", tc.compat, tc.backing, tc.extL2, tc.snap)
		t.Run(name, func(t *testing.T) {
			dir := t.TempDir()
			base := filepath.Join(dir, "base.qcow2")
			opts := "compat=" + tc.compat
			if tc.extL2 {
				opts += ",extended_l2=on"
			}
			args := []string{"create", "-q", "-f", "qcow2", "-o", opts}
			if tc.backing {
				raw := filepath.Join(dir, "backing.raw")
				testutil.QemuImg(t, "create", "-q", "-f", "raw", raw, "4M")
				testutil.QemuIO(t, raw, "raw", "write -q -P 7 0 4M")
				args = append(args, "-b", raw, "-F", "raw")
			}
			testutil.QemuImg(t, append(args, base, "4M")...)
			testutil.QemuIO(t, base, "qcow2", "write -q -P 1 0 4M")
			if tc.snap {
				testutil.QemuImg(t, "snapshot", "-c", "s1", base)
			}
			b, err := os.ReadFile(base)
			if err != nil {
				t.Fatal(err)
			}
			ours, theirs := filepath.Join(dir, "ours.qcow2"), filepath.Join(dir, "theirs.qcow2")
			for _, p := range []string{ours, theirs} {
				if err := os.WriteFile(p, b, 0o644); err != nil {
					t.Fatal(err)
				}
			}
			before := testutil.AllocatedBytes(t, ours)

			qemuNBDRequests(t, theirs, "discard 0 1M", "write -z -u 1M 512k", "discard 3M 64k")

			img, err := Open(ours, Options{})
			if err != nil {
				t.Fatal(err)
			}
			img.SetPassDiscardRequest(true)
			if err := img.Discard(ctx, 0, 1<<20, 0); err != nil {
				t.Fatal(err)
			}
			if err := img.WriteZeroes(ctx, 1<<20, 512<<10, 0); err != nil {
				t.Fatal(err)
			}
			if err := img.Discard(ctx, 3<<20, 64<<10, 0); err != nil {
				t.Fatal(err)
			}
			if err := img.Close(); err != nil {
				t.Fatal(err)
			}

			if got, want := testutil.Map(t, ours), testutil.Map(t, theirs); !reflect.DeepEqual(got, want) {
				t.Errorf("map:\n got %+v\nwant %+v", got, want)
			}
			got, want := testutil.AllocatedBytes(t, ours), testutil.AllocatedBytes(t, theirs)
			if d := got - want; d > 4096 || d < -4096 {
				t.Errorf("allocated bytes: ovis %d, qemu-nbd %d (before %d)", got, want, before)
			}
			// A v2 image over a backing file ignores discards (QEMU's
			// ENOTSUP), and writes the zeros.
			if ignored := tc.compat == "0.10" && tc.backing; !tc.snap && !ignored && want >= before {
				t.Errorf("qemu-nbd freed nothing (%d before, %d after): the case tests nothing", before, want)
			}
			testutil.CheckImage(t, ours)
		})
	}
}

// TestDiscardNoPunchByDefault: without pass-discard-request (qemu-nbd's
// default --discard=ignore, qemu-img), freed clusters keep their space.
func TestDiscardNoPunchByDefault(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "a.qcow2")
	testutil.QemuImg(t, "create", "-q", "-f", "qcow2", p, "4M")
	testutil.QemuIO(t, p, "qcow2", "write -q -P 1 0 4M")
	before := testutil.AllocatedBytes(t, p)
	img, err := Open(p, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if err := img.Discard(ctx, 0, 2<<20, 0); err != nil {
		t.Fatal(err)
	}
	if err := img.Close(); err != nil {
		t.Fatal(err)
	}
	if after := testutil.AllocatedBytes(t, p); after != before {
		t.Errorf("allocated bytes changed from %d to %d without pass-discard-request", before, after)
	}
}
