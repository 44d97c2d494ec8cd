package main

import (
	"fmt"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"testing"

	"github.com/ovis-storage/ovis/internal/testutil"
)

// ovisBin is the ovis binary TestMain builds once for every test.
var ovisBin string

func TestMain(m *testing.M) {
	if _, err := exec.LookPath("qemu-img"); err != nil {
		fmt.Fprintln(os.Stderr, "cmd/ovis tests compare with qemu-img, which is not installed; run scripts/test.sh, which installs qemu-utils")
		os.Exit(1)
	}
	dir, err := os.MkdirTemp("", "ovis-bin-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	// Under -race the binary is built with the race detector too, so that
	// the parallel copy of convert runs under it.
	var flags []string
	if raceEnabled {
		flags = append(flags, "-race")
		// The race runtime sleeps a second before every exit
		// (atexit_sleep_ms) for late reports; the tests run the binary
		// thousands of times. Races it finds still fail: exit code 66
		// and a report on stderr.
		os.Setenv("GORACE", strings.TrimSpace(os.Getenv("GORACE")+" atexit_sleep_ms=0"))
	}
	ovisBin, err = testutil.BuildBinary("github.com/ovis-storage/ovis/cmd/ovis", dir, flags...)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.RemoveAll(dir)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// result is what one run of a tool printed and returned.
type result struct {
	stdout, stderr string
	code           int
}

// ovis runs `ovis args...` in dir.
func ovis(t testing.TB, dir string, args ...string) result {
	t.Helper()
	o, e, c := testutil.RunIn(t, dir, ovisBin, args...)
	return result{o, e, c}
}

// qemuImg runs `qemu-img args...` in dir.
func qemuImg(t testing.TB, dir string, args ...string) result {
	t.Helper()
	o, e, c := testutil.RunIn(t, dir, "qemu-img", args...)
	return result{o, e, c}
}

// ovisImg runs `ovis img args...` in dir.
func ovisImg(t testing.TB, dir string, args ...string) result {
	t.Helper()
	return ovis(t, dir, append([]string{"img"}, args...)...)
}

// mustOvisImg runs `ovis img args...` in dir and fails the test unless it
// exits 0.
func mustOvisImg(t testing.TB, dir string, args ...string) result {
	t.Helper()
	r := ovisImg(t, dir, args...)
	if r.code != 0 {
		t.Fatalf("ovis img %s: exit %d\nstderr: %s\nstdout: %s", strings.Join(args, " "), r.code, r.stderr, r.stdout)
	}
	return r
}

var (
	prefixRE = regexp.MustCompile(`(?m)^(qemu-img|ovis): `)
	tryRE    = regexp.MustCompile(`(?m)^Try '(qemu-img|ovis) --help' for more information\n`)
)

// normStderr makes the two tools' error output comparable: "qemu-img: " and
// "ovis: " prefixes become "X: ", the pointer to --help goes, and the
// output ends in exactly one newline (qemu-img forgets it after some
// hints).
func normStderr(s string) string {
	s = prefixRE.ReplaceAllString(tryRE.ReplaceAllString(s, ""), "X: ")
	if s = strings.TrimRight(s, "\n"); s != "" {
		s += "\n"
	}
	return s
}

// encryptRE matches QEMU's encryption options in -o help, which ovis does
// not support and so does not list.
var encryptRE = regexp.MustCompile(`(?m)^  encrypt.*\n`)

// sameResult fails the test unless two runs printed the same (after
// normStderr) and exited alike.
func sameResult(t *testing.T, what string, q, o result) {
	t.Helper()
	if qo := encryptRE.ReplaceAllString(q.stdout, ""); qo != o.stdout {
		t.Errorf("%s: stdout differs\nqemu-img: %q\n    ovis: %q", what, q.stdout, o.stdout)
	}
	if qe, oe := normStderr(q.stderr), normStderr(o.stderr); qe != oe {
		t.Errorf("%s: stderr differs\nqemu-img: %q\n    ovis: %q", what, qe, oe)
	}
	if q.code != o.code {
		t.Errorf("%s: exit %d, qemu-img exits %d", what, o.code, q.code)
	}
}

// raceEnabled is set by race_test.go when the tests run with -race.
var raceEnabled bool
