package testutil

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
)

// BuildBinary builds the Go main package pkg (an import path such as
// "github.com/ovis-storage/ovis/cmd/ovis") into dir with the extra go build
// flags (such as -race) and returns the binary's path. It is meant for
// TestMain, which has no testing.TB: build once, run the binary from every
// test. The error quotes the compiler's output.
func BuildBinary(pkg, dir string, flags ...string) (string, error) {
	bin := filepath.Join(dir, filepath.Base(pkg))
	args := append([]string{"build", "-o", bin}, flags...)
	cmd := exec.Command("go", append(args, pkg)...)
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("testutil: go build %s: %v\n%s", pkg, err, out)
	}
	return bin, nil
}

// RunIn runs the program name (a path, or a QEMU tool looked up in PATH
// with the same "run scripts/test.sh" failure as QemuImg) with args in the
// folder dir ("" for the test's own), with no standard input, and returns
// its standard output, standard error and exit code. It fails the test
// only when the program cannot be started.
func RunIn(t testing.TB, dir, name string, args ...string) (stdout, stderr string, code int) {
	t.Helper()
	path := name
	if !strings.Contains(name, "/") {
		path = tool(t, name)
	}
	cmd := exec.Command(path, args...)
	cmd.Dir = dir
	cmd.Stdin = nil
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	var exit *exec.ExitError
	switch {
	case err == nil:
	case errors.As(err, &exit):
		code = exit.ExitCode()
	default:
		t.Fatalf("testutil: %s %s: %v", name, strings.Join(args, " "), err)
	}
	return out.String(), errb.String(), code
}

// AllocatedBytes returns how much disk space the file at path takes
// (st_blocks * 512, qemu-img info's actual-size).
func AllocatedBytes(t testing.TB, path string) int64 {
	t.Helper()
	st, err := os.Stat(path)
	if err != nil {
		t.Fatalf("testutil: %v", err)
	}
	sys, ok := st.Sys().(*syscall.Stat_t)
	if !ok {
		t.Fatalf("testutil: no block count for %s", path)
	}
	return sys.Blocks * 512
}
