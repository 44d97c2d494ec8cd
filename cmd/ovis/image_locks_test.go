package main

import (
	"bytes"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ovis-storage/ovis/internal/testutil"
)

// ioHolder is a qemu-io that keeps an image open (as a running VM does)
// and takes commands on its stdin.
type ioHolder struct {
	cmd   *exec.Cmd
	stdin io.WriteCloser
	out   bytes.Buffer
	done  chan struct{}
}

// holdImage opens path in a qemu-io with args (-r, -U) and returns once
// it holds its locks.
func holdImage(t *testing.T, path, format string, args ...string) *ioHolder {
	t.Helper()
	before := len(testutil.LockedBytes(t, path))
	h := &ioHolder{done: make(chan struct{})}
	h.cmd = exec.Command("qemu-io", append(append([]string{"-f", format}, args...), path)...)
	h.cmd.Stdout, h.cmd.Stderr = &h.out, &h.out
	var err error
	if h.stdin, err = h.cmd.StdinPipe(); err != nil {
		t.Fatal(err)
	}
	if err := h.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { h.cmd.Wait(); close(h.done) }()
	t.Cleanup(func() {
		h.stdin.Close()
		select {
		case <-h.done:
		case <-time.After(10 * time.Second):
			h.cmd.Process.Kill()
			<-h.done
		}
	})
	deadline := time.Now().Add(20 * time.Second)
	for len(testutil.LockedBytes(t, path)) == before {
		select {
		case <-h.done:
			t.Fatalf("qemu-io %v exited: %s", h.cmd.Args, h.out.String())
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("qemu-io %v holds no lock after 20s", h.cmd.Args)
		}
		time.Sleep(10 * time.Millisecond)
	}
	return h
}

// finish sends cmds and quit, and returns what the holder printed.
func (h *ioHolder) finish(t *testing.T, cmds ...string) string {
	t.Helper()
	io.WriteString(h.stdin, strings.Join(append(cmds, "quit"), "\n")+"\n")
	h.stdin.Close()
	select {
	case <-h.done:
	case <-time.After(20 * time.Second):
		t.Fatalf("qemu-io did not quit: %s", h.out.String())
	}
	return h.out.String()
}

// TestReproLocksHeldImage (issue 14, case 7): a verb that creates or
// rewrites an image refuses one another process holds, as qemu-img does
// (same message, same exit code), and leaves it byte for byte as it was:
// the holder still reads its data. A holder reading with -U does not stop
// qemu-img, nor ovis; a raw image's writer shares writes with a raw
// creator. Where qemu-img itself truncates the file before it notices the
// holder (a qcow2 created over a raw image in use), ovis reports the same
// error without touching the file.
func TestReproLocksHeldImage(t *testing.T) {
	t.Parallel()
	verbs := []struct {
		target string // t.qcow2 or t.raw, the held image
		args   []string
	}{
		{"t.qcow2", []string{"create", "-f", "qcow2", "t.qcow2", "1M"}},
		{"t.qcow2", []string{"create", "-f", "raw", "t.qcow2", "1M"}},
		{"t.qcow2", []string{"create", "-f", "qcow2", "-o", "preallocation=metadata", "t.qcow2", "1M"}},
		{"t.qcow2", []string{"convert", "-O", "qcow2", "src.qcow2", "t.qcow2"}},
		{"t.qcow2", []string{"convert", "-O", "raw", "src.qcow2", "t.qcow2"}},
		{"t.qcow2", []string{"convert", "-n", "-O", "qcow2", "src.qcow2", "t.qcow2"}},
		{"t.qcow2", []string{"dd", "-O", "qcow2", "if=src.qcow2", "of=t.qcow2"}},
		{"t.qcow2", []string{"dd", "-O", "raw", "if=src.qcow2", "of=t.qcow2"}},
		{"t.qcow2", []string{"amend", "-f", "qcow2", "-o", "lazy_refcounts=on", "t.qcow2"}},
		{"t.qcow2", []string{"resize", "t.qcow2", "2M"}},
		{"t.qcow2", []string{"snapshot", "-c", "s1", "t.qcow2"}},
		{"t.qcow2", []string{"bitmap", "--add", "t.qcow2", "b1"}},
		{"t.qcow2", []string{"rebase", "-b", "src.qcow2", "-F", "qcow2", "t.qcow2"}},
		{"t.qcow2", []string{"check", "-r", "all", "t.qcow2"}},
		{"t.raw", []string{"create", "-f", "qcow2", "t.raw", "1M"}},
		{"t.raw", []string{"create", "-f", "raw", "t.raw", "1M"}},
		{"t.raw", []string{"convert", "-O", "qcow2", "src.qcow2", "t.raw"}},
		{"t.raw", []string{"convert", "-O", "raw", "src.qcow2", "t.raw"}},
		{"t.raw", []string{"convert", "-n", "-O", "raw", "src.qcow2", "t.raw"}},
		{"t.raw", []string{"dd", "-O", "qcow2", "if=src.qcow2", "of=t.raw"}},
	}
	holders := []struct {
		name string
		args []string
	}{
		{"rw", nil},
		{"ro", []string{"-r"}},
		{"shared", []string{"-r", "-U"}},
	}
	for _, v := range verbs {
		for _, h := range holders {
			name := strings.Join(v.args, " ") + " held " + h.name
			t.Run(name, func(t *testing.T) {
				format := strings.TrimPrefix(filepath.Ext(v.target), ".")
				run := func(bin string) (result, []byte, string) {
					dir := t.TempDir()
					target := filepath.Join(dir, v.target)
					// The same files for every verb and holder, made once.
					fromFixture(t, "locks-held-"+v.target, func(t *testing.T, dir string) {
						target := filepath.Join(dir, v.target)
						testutil.QemuImg(t, "create", "-q", "-f", "qcow2", filepath.Join(dir, "src.qcow2"), "1M")
						testutil.QemuIO(t, filepath.Join(dir, "src.qcow2"), "qcow2", "write -q -P 0xcd 0 64k")
						testutil.QemuImg(t, "create", "-q", "-f", format, target, "1M")
						testutil.QemuIO(t, target, format, "write -q -P 0xab 0 64k")
						testutil.QemuImg(t, "create", "-q", "-f", "qcow2", "-b", v.target, "-F", format, filepath.Join(dir, "top.qcow2"))
						testutil.QemuIO(t, filepath.Join(dir, "top.qcow2"), "qcow2", "write -q -P 0xef 64k 64k")
					}, dir)
					before, err := os.ReadFile(target)
					if err != nil {
						t.Fatal(err)
					}
					hold := holdImage(t, target, format, h.args...)
					var r result
					if bin == "qemu-img" {
						r = qemuImg(t, dir, v.args...)
					} else {
						r = ovisImg(t, dir, v.args...)
					}
					out := hold.finish(t, "read -P 0xab 0 64k")
					if bin == "qemu-img" {
						// qemu-img may even delete the file (qcow2
						// over a raw image in use): not judged.
						return r, nil, ""
					}
					after, err := os.ReadFile(target)
					if err != nil {
						t.Fatal(err)
					}
					if r.code != 0 && !bytes.Equal(before, after) {
						return r, after, "changed"
					}
					if r.code != 0 && (strings.Contains(out, "Pattern verification failed") || !strings.Contains(out, "read 65536/65536")) {
						return r, after, "holder reads: " + out
					}
					return r, after, ""
				}
				q, _, _ := run("qemu-img")
				o, _, damage := run(ovisBin)
				sameResult(t, name, q, o)
				if damage != "" {
					t.Errorf("ovis failed (exit %d) but the held image was %s", o.code, damage)
				}
			})
		}
	}
}

// TestReproLocksHeldDataFile: a qcow2 image created with the external data
// file of an image another process has open is refused as qemu-img refuses
// it ('Failed to get "resize" lock' naming the data file), before the data
// file is truncated, and leaves no new image behind.
func TestReproLocksHeldDataFile(t *testing.T) {
	for _, args := range [][]string{
		{"create", "-f", "qcow2", "-o", "data_file=DF", "n.qcow2", "1M"},
		{"convert", "-O", "qcow2", "-o", "data_file=DF", "src.qcow2", "n.qcow2"},
	} {
		for _, h := range []struct {
			name string
			args []string
		}{{"rw", nil}, {"ro", []string{"-r"}}, {"shared", []string{"-r", "-U"}}} {
			name := strings.Join(args, " ") + " held " + h.name
			t.Run(name, func(t *testing.T) {
				run := func(bin string) (result, bool, bool) {
					dir := t.TempDir()
					testutil.QemuImg(t, "create", "-q", "-f", "qcow2", filepath.Join(dir, "src.qcow2"), "1M")
					// An absolute data file name: QEMU opens a relative one
					// from its working directory.
					df := filepath.Join(dir, "d.raw")
					testutil.QemuImg(t, "create", "-q", "-f", "qcow2", "-o", "data_file="+df, filepath.Join(dir, "x.qcow2"), "1M")
					testutil.QemuIO(t, filepath.Join(dir, "x.qcow2"), "qcow2", "write -q -P 0xab 0 64k")
					before, err := os.ReadFile(df)
					if err != nil {
						t.Fatal(err)
					}
					holdImage(t, filepath.Join(dir, "x.qcow2"), "qcow2", h.args...)
					argv := slices.Clone(args)
					for i, a := range argv {
						argv[i] = strings.ReplaceAll(a, "DF", df)
					}
					var r result
					if bin == "qemu-img" {
						r = qemuImg(t, dir, argv...)
					} else {
						r = ovisImg(t, dir, argv...)
					}
					r.stdout = strings.ReplaceAll(r.stdout, df, "DF")
					r.stderr = strings.ReplaceAll(r.stderr, df, "DF")
					after, err := os.ReadFile(df)
					if err != nil {
						t.Fatal(err)
					}
					_, err = os.Stat(filepath.Join(dir, "n.qcow2"))
					return r, bytes.Equal(before, after), err == nil
				}
				q, _, qNew := run("qemu-img")
				o, same, oNew := run(ovisBin)
				sameResult(t, name, q, o)
				if o.code != 0 && !same {
					t.Errorf("ovis failed but changed the held data file")
				}
				if qNew != oNew {
					t.Errorf("n.qcow2 exists after qemu-img: %v, after ovis: %v", qNew, oNew)
				}
			})
		}
	}
}
