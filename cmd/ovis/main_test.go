package main

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/ovis-storage/ovis/internal/testutil"
)

// ovisBin is the ovis binary TestMain builds once for every test, and
// serverBin the one the tests run as a long-lived server (`ovis node`,
// `ovis up`, the NBD server of the nbd tests).
//
// Under -race only serverBin has the race detector: the servers are where
// the concurrency is, and they start a few hundred times. The tests run
// ovisBin tens of thousands of times, mostly as a short img verb next to
// qemu-img, and the race runtime costs each run about 0.2 s of CPU (a
// quarter of the package's time); the code those runs exercise is tested
// in process under -race in its own packages (qcow2, convert, image, nbd).
var ovisBin, serverBin string

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
	fail := func(err error) {
		fmt.Fprintln(os.Stderr, err)
		os.RemoveAll(dir)
		os.Exit(1)
	}
	fixtureRoot = filepath.Join(dir, "fixtures")
	if err := os.Mkdir(fixtureRoot, 0o755); err != nil {
		fail(err)
	}
	const pkg = "github.com/ovis-storage/ovis/cmd/ovis"
	if ovisBin, err = testutil.BuildBinary(pkg, dir); err != nil {
		fail(err)
	}
	serverBin = ovisBin
	if raceEnabled {
		// The race runtime sleeps a second before every exit
		// (atexit_sleep_ms) for late reports. Races it finds still
		// fail: exit code 66 and a report on stderr.
		os.Setenv("GORACE", strings.TrimSpace(os.Getenv("GORACE")+" atexit_sleep_ms=0"))
		race := filepath.Join(dir, "race")
		if err := os.Mkdir(race, 0o755); err != nil {
			fail(err)
		}
		if serverBin, err = testutil.BuildBinary(pkg, race, "-race"); err != nil {
			fail(err)
		}
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

// fullTables is set by OVIS_FULL=1 (bench/full-tables.sh): the larger
// tables of cases then run every row, where the suite runs a sample.
var fullTables = os.Getenv("OVIS_FULL") == "1"

// sampled reports whether the row of a table at the indexes idx (one per
// dimension, the last the smallest, of size k) runs. Unless fullTables,
// it keeps the rows whose indexes sum to 0 mod k: a Latin square, so for
// a table of three dimensions every pair of values of any two still runs
// together when the other two dimensions have at least k values each,
// and for two dimensions every value of either runs.
func sampled(k int, idx ...int) bool {
	if fullTables {
		return true
	}
	sum := 0
	for _, i := range idx {
		sum += i
	}
	return sum%k == 0
}
