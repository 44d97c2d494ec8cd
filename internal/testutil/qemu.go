// Package testutil runs QEMU's own tools (qemu-img, qemu-io) as the oracle
// for ovis's tests, and compares ovis devices with the raw images QEMU
// produces.
//
// The tools are never optional: when one is missing the test fails and
// says to run scripts/test.sh, which installs qemu-utils. Nothing here
// skips.
//
// Every helper takes the test's testing.TB, marks itself as a helper and
// fails the test on error, so call sites stay one line long. Helpers are
// safe to call from parallel tests.
package testutil

import (
	"encoding/json"
	"os/exec"
	"strings"
	"testing"
)

// tool returns the path of a QEMU tool, failing the test when it is not
// installed.
func tool(t testing.TB, name string) string {
	t.Helper()
	p, err := exec.LookPath(name)
	if err != nil {
		t.Fatalf("testutil: %s is not installed (%v); run scripts/test.sh, which installs it", name, err)
	}
	return p
}

// run runs a QEMU tool in the test's folder and returns its output and
// exit code. It fails the test only when the tool cannot be started.
func run(t testing.TB, name string, args []string) (stdout, stderr string, code int) {
	t.Helper()
	return RunIn(t, "", name, args...)
}

// QemuImg runs qemu-img with args and returns its standard output. It fails
// the test, quoting standard error, when qemu-img exits non-zero.
func QemuImg(t testing.TB, args ...string) string {
	t.Helper()
	out, stderr, code := run(t, "qemu-img", args)
	if code != 0 {
		t.Fatalf("qemu-img %s: exit %d\nstderr: %s\nstdout: %s", strings.Join(args, " "), code, stderr, out)
	}
	return out
}

// QemuImgExit runs qemu-img with args and returns its standard output and
// standard error together, and its exit code, for callers that expect
// failure or read the code (check, compare).
func QemuImgExit(t testing.TB, args ...string) (out string, code int) {
	t.Helper()
	stdout, stderr, code := run(t, "qemu-img", args)
	return stdout + stderr, code
}

// QemuIO runs `qemu-io -f format -c cmd ... file` and returns its standard
// output. It fails the test when qemu-io exits non-zero or reports a failed
// command (qemu-io 7.2 exits 1 then; the text check covers older ones).
func QemuIO(t testing.TB, file, format string, cmds ...string) string {
	t.Helper()
	args := qemuIOArgs(file, format, cmds)
	out, stderr, code := run(t, "qemu-io", args)
	if code != 0 || strings.Contains(out+stderr, "failed") {
		t.Fatalf("qemu-io %s: exit %d\nstderr: %s\nstdout: %s", strings.Join(args, " "), code, stderr, out)
	}
	return out
}

// qemuIOArgs is the command line `qemu-io -f format -c cmd ... file`
// without the program name.
func qemuIOArgs(file, format string, cmds []string) []string {
	args := []string{"-f", format}
	for _, c := range cmds {
		args = append(args, "-c", c)
	}
	return append(args, file)
}

// QemuIOExit is QemuIO for command lists that are expected to end the
// process abnormally (`sigraise 9` to leave a dirty image behind): it
// returns the combined output and the exit code instead of judging them.
func QemuIOExit(t testing.TB, file, format string, cmds ...string) (out string, code int) {
	t.Helper()
	args := qemuIOArgs(file, format, cmds)
	stdout, stderr, code := run(t, "qemu-io", args)
	return stdout + stderr, code
}

// CheckImage runs `qemu-img check --output=json` on the image at path and
// fails the test, quoting the report, on any corruption, leak or check
// error. It returns the decoded report. QEMU leaves counters that are
// zero out of the JSON. It checks with -U: a test may check an image that
// an engine in the test process still holds (after a flush, or left open
// as by a crash), which QEMU's image locks would otherwise refuse.
func CheckImage(t testing.TB, path string) map[string]any {
	t.Helper()
	stdout, stderr, code := run(t, "qemu-img", []string{"check", "-U", "--output=json", path})
	var rep map[string]any
	if err := json.Unmarshal([]byte(stdout), &rep); err != nil {
		t.Fatalf("qemu-img check %s: exit %d, undecodable report (%v)\nstderr: %s\nstdout: %s", path, code, err, stderr, stdout)
	}
	bad := code != 0
	for _, k := range []string{"corruptions", "leaks", "check-errors", "corruptions-fixed", "leaks-fixed"} {
		if v, ok := rep[k].(float64); ok && v != 0 {
			bad = true
		}
	}
	if bad {
		t.Errorf("qemu-img check %s: exit %d (1 check failed, 2 corrupt, 3 leaks)\n%s%s", path, code, stdout, stderr)
	}
	return rep
}

// ImageInfo returns the decoded `qemu-img info --output=json` of the image
// at path.
func ImageInfo(t testing.TB, path string) map[string]any {
	t.Helper()
	out := QemuImg(t, "info", "--output=json", path)
	var info map[string]any
	if err := json.Unmarshal([]byte(out), &info); err != nil {
		t.Fatalf("qemu-img info %s: %v\n%s", path, err, out)
	}
	return info
}

// VirtualSize returns the virtual size qemu-img reports for the image at
// path.
func VirtualSize(t testing.TB, path string) int64 {
	t.Helper()
	v, ok := ImageInfo(t, path)["virtual-size"].(float64)
	if !ok {
		t.Fatalf("qemu-img info %s: no virtual-size", path)
	}
	return int64(v)
}

// MapEntry is one entry of `qemu-img map --output=json`. Depth counts
// layers below the top image (0 is the image itself); Present is false
// for a hole in every layer.
type MapEntry struct {
	Start   int64  `json:"start"`
	Length  int64  `json:"length"`
	Depth   int    `json:"depth"`
	Present *bool  `json:"present"`
	Zero    bool   `json:"zero"`
	Data    bool   `json:"data"`
	Offset  *int64 `json:"offset"`
}

// Map returns the decoded `qemu-img map --output=json` of the image at
// path.
func Map(t testing.TB, path string) []MapEntry {
	t.Helper()
	out := QemuImg(t, "map", "--output=json", path)
	var m []MapEntry
	if err := json.Unmarshal([]byte(out), &m); err != nil {
		t.Fatalf("qemu-img map %s: %v\n%s", path, err, out)
	}
	return m
}
