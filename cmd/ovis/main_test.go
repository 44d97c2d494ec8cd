package main

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
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
	// scripts/test.sh builds the two binaries once, from this tree, for
	// the several go tests it runs of this package; each would otherwise
	// link its own pair.
	if ovisBin = os.Getenv("OVIS_TEST_BIN"); ovisBin == "" {
		if ovisBin, err = testutil.BuildBinary(pkg, dir); err != nil {
			fail(err)
		}
	}
	serverBin = ovisBin
	if raceEnabled {
		// The race runtime sleeps a second before every exit
		// (atexit_sleep_ms) for late reports. Races it finds still
		// fail: exit code 66 and a report on stderr.
		os.Setenv("GORACE", strings.TrimSpace(os.Getenv("GORACE")+" atexit_sleep_ms=0"))
		if serverBin = os.Getenv("OVIS_TEST_RACE_BIN"); serverBin == "" {
			race := filepath.Join(dir, "race")
			if err := os.Mkdir(race, 0o755); err != nil {
				fail(err)
			}
			if serverBin, err = testutil.BuildBinary(pkg, race, "-race"); err != nil {
				fail(err)
			}
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

// normStderr is testutil.NormStderr: "qemu-img: " and "ovis: " become
// "X: ", the pointer to --help goes, one final newline.
func normStderr(s string) string { return testutil.NormStderr(s) }

// sameResult fails the test unless two runs printed the same (after
// normStderr) and exited alike (testutil.SameOutput).
func sameResult(t *testing.T, what string, q, o result) {
	t.Helper()
	testutil.SameOutput(t, what, testutil.Output{Stdout: q.stdout, Stderr: q.stderr, Code: q.code},
		testutil.Output{Stdout: o.stdout, Stderr: o.stderr, Code: o.code})
}

// raceEnabled is set by race_test.go when the tests run with -race.
var raceEnabled bool

// sampled is testutil.Sampled: whether a row of a larger table runs in
// the suite (all of them with OVIS_FULL=1).
func sampled(k int, idx ...int) bool { return testutil.Sampled(k, idx...) }
