package testutil

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
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

// Output is what one run of a tool (or of an ovis verb in process)
// printed and returned.
type Output struct {
	Stdout, Stderr string
	Code           int
}

var (
	prefixRE  = regexp.MustCompile(`(?m)^(qemu-img|ovis): `)
	tryRE     = regexp.MustCompile(`(?m)^Try '(qemu-img|ovis) --help' for more information\n`)
	encryptRE = regexp.MustCompile(`(?m)^  encrypt.*\n`)
)

// NormStderr makes the error output of qemu-img and ovis comparable:
// "qemu-img: " and "ovis: " prefixes become "X: ", the pointer to --help
// goes, and the output ends in exactly one newline (qemu-img forgets it
// after some hints).
func NormStderr(s string) string {
	s = prefixRE.ReplaceAllString(tryRE.ReplaceAllString(s, ""), "X: ")
	if s = strings.TrimRight(s, "\n"); s != "" {
		s += "\n"
	}
	return s
}

// SameOutput fails the test unless o, what ovis printed and returned,
// is q, what qemu-img did: the same stdout (but for QEMU's encryption
// options in -o help, which ovis does not support and so does not
// list), the same stderr after NormStderr, the same exit code.
func SameOutput(t testing.TB, what string, q, o Output) {
	t.Helper()
	if qo := encryptRE.ReplaceAllString(q.Stdout, ""); qo != o.Stdout {
		t.Errorf("%s: stdout differs\nqemu-img: %q\n    ovis: %q", what, q.Stdout, o.Stdout)
	}
	if qe, oe := NormStderr(q.Stderr), NormStderr(o.Stderr); qe != oe {
		t.Errorf("%s: stderr differs\nqemu-img: %q\n    ovis: %q", what, qe, oe)
	}
	if q.Code != o.Code {
		t.Errorf("%s: exit %d, qemu-img exits %d", what, o.Code, q.Code)
	}
}

// CopySparse copies the file from into the file to, holes and all (cp
// --sparse=always).
func CopySparse(t testing.TB, from, to string) {
	t.Helper()
	if out, err := exec.Command("cp", "--sparse=always", from, to).CombinedOutput(); err != nil {
		t.Fatalf("testutil: cp %s: %v\n%s", from, err, out)
	}
}

// CopyFile copies the file from into the file to, whose holes it fills.
func CopyFile(t testing.TB, from, to string) {
	t.Helper()
	b, err := os.ReadFile(from)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(to, b, 0o644); err != nil {
		t.Fatal(err)
	}
}

// MustRunIn runs the program name with args in dir as RunIn does and
// fails the test unless it exits 0 without printing "failed" (qemu-io's
// word for a failed command, after which it still exits 0).
func MustRunIn(t testing.TB, dir, name string, args ...string) {
	t.Helper()
	if o, e, c := RunIn(t, dir, name, args...); c != 0 || strings.Contains(o+e, "failed") {
		t.Fatalf("%s %s: exit %d\n%s%s", name, strings.Join(args, " "), c, o, e)
	}
}

// FullTables is set by OVIS_FULL=1 (bench/full-tables.sh): the larger
// tables of cases then run every row, where the suite runs a sample.
var FullTables = os.Getenv("OVIS_FULL") == "1"

// Sampled reports whether the row of a table at the indexes idx (one per
// dimension, the last the smallest, of size k) runs. Unless FullTables,
// it keeps the rows whose indexes sum to 0 mod k: a Latin square, so for
// a table of three dimensions every pair of values of any two still runs
// together when the other two dimensions have at least k values each,
// and for two dimensions every value of either runs.
func Sampled(k int, idx ...int) bool {
	if FullTables {
		return true
	}
	sum := 0
	for _, i := range idx {
		sum += i
	}
	return sum%k == 0
}
