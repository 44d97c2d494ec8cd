package img

import (
	"bytes"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/ovis-storage/ovis/image"
	"github.com/ovis-storage/ovis/internal/testutil"
	"github.com/ovis-storage/ovis/qcow2"
)

// TestEnvsSideBySide runs info on several Envs at once in one process,
// with different settings, against an image this process holds open for
// writing: each must see only its own -U and --untrusted, print only to
// its own writers, and say what qemu-img says with the same options.
func TestEnvsSideBySide(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "a.qcow2")
	testutil.QemuImg(t, "create", "-f", "qcow2", path, "1M")
	shared := testutil.QemuImg(t, "info", "-U", path)
	// qemu-img, while the image is free, to have the output of a trusted
	// info with a probed format.
	probed := testutil.QemuImg(t, "info", path)
	if shared != probed {
		t.Fatalf("qemu-img info -U and info differ on a free image:\n%s\n%s", shared, probed)
	}

	// A writer in this process, as a VM would be in another.
	w, err := image.Open(path, "qcow2", image.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	// qemu-img without -U fails on the writer's lock; ovis's message
	// must be the same.
	lockOut, code := testutil.QemuImgExit(t, "info", path)
	if code == 0 {
		t.Fatalf("qemu-img info of a locked image succeeded:\n%s", lockOut)
	}
	lockMsg := strings.TrimSpace(strings.TrimPrefix(lockOut, "qemu-img: "))

	tests := []struct {
		name    string
		env     func(stdout, stderr *bytes.Buffer) *Env
		format  string
		wantOut string // "" for a failure
		wantErr func(error) bool
	}{
		{"force-share", func(o, e *bytes.Buffer) *Env { return &Env{Stdout: o, Stderr: e, ForceShare: true} }, "", shared, nil},
		{"locked", func(o, e *bytes.Buffer) *Env { return &Env{Stdout: o, Stderr: e} }, "", "",
			func(err error) bool { return err.Error() == lockMsg }},
		{"untrusted-probe", func(o, e *bytes.Buffer) *Env { return &Env{Stdout: o, Stderr: e, ForceShare: true, Untrusted: true} }, "", "",
			func(err error) bool { return errors.Is(err, qcow2.ErrProbeUntrusted) }},
		{"untrusted-named", func(o, e *bytes.Buffer) *Env { return &Env{Stdout: o, Stderr: e, ForceShare: true, Untrusted: true} }, "qcow2", shared, nil},
	}
	const rounds = 4
	type result struct {
		out, errOut string
		err         error
	}
	results := make([][]result, len(tests))
	var wg sync.WaitGroup
	for i, tt := range tests {
		results[i] = make([]result, rounds)
		for r := range rounds {
			wg.Go(func() {
				var o, e bytes.Buffer
				err := tt.env(&o, &e).Info(InfoConfig{Filename: path, Format: tt.format})
				results[i][r] = result{o.String(), e.String(), err}
			})
		}
	}
	wg.Wait()
	for i, tt := range tests {
		for r, res := range results[i] {
			where := fmt.Sprintf("%s, round %d", tt.name, r)
			if res.errOut != "" {
				t.Errorf("%s: stderr %q, want nothing", where, res.errOut)
			}
			if tt.wantErr == nil {
				if res.err != nil || res.out != tt.wantOut {
					t.Errorf("%s: err %v, output\n%s\nwant qemu-img's\n%s", where, res.err, res.out, tt.wantOut)
				}
				continue
			}
			if res.err == nil || !tt.wantErr(res.err) || res.out != "" {
				t.Errorf("%s: err %v, output %q; want the expected failure (qemu-img: %q) and no output", where, res.err, res.out, lockMsg)
			}
		}
	}
}

// TestEnvImageOptsPerEnv: an option list recorded in one Env names the
// image in that Env's errors only.
func TestEnvImageOptsPerEnv(t *testing.T) {
	missing := filepath.Join(t.TempDir(), "missing.qcow2")
	spec := "driver=qcow2,file.filename=" + missing
	var a, b Env
	file, format, err := a.UseImageOpts(spec)
	if err != nil || file != missing || format != "qcow2" {
		t.Fatalf("UseImageOpts(%q) = %q, %q, %v", spec, file, format, err)
	}
	errA := a.Info(InfoConfig{Filename: file, Format: format})
	errB := b.Info(InfoConfig{Filename: file, Format: format})
	if errA == nil || !strings.HasPrefix(errA.Error(), "Could not open '"+spec+"': ") {
		t.Errorf("with the option list: %v, want the list named", errA)
	}
	if errB == nil || !strings.HasPrefix(errB.Error(), "Could not open '"+missing+"': ") {
		t.Errorf("without it: %v, want the file named", errB)
	}
}
