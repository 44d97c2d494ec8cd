package img

import (
	"bytes"
	"context"
	"testing"

	"github.com/ovis-storage/ovis/internal/testutil"
)

// The verbs' tests against qemu-img run the verb in process, on an Env
// of their own, where cmd/ovis's tests run `ovis img` as a subprocess:
// what it prints and the exit status the command would end with are
// compared with what qemu-img printed and returned (testutil.SameOutput).
// Only the command line stays with cmd/ovis's tests: flags, and which
// Config they make.

// runVerb runs verb on a new Env as `ovis img` does and returns what it
// printed on stdout and stderr and the exit status (Exit) the command
// would end with.
func runVerb(verb func(ctx context.Context, e *Env) error) testutil.Output {
	var out, errb bytes.Buffer
	e := &Env{Stdout: &out, Stderr: &errb}
	code := 0
	if err := verb(context.Background(), e); err != nil {
		code = Exit(&errb, err)
	}
	return testutil.Output{Stdout: out.String(), Stderr: errb.String(), Code: code}
}

// qemuImg runs qemu-img with args in dir ("" for the test's own).
func qemuImg(t *testing.T, dir string, args ...string) testutil.Output {
	t.Helper()
	o, e, c := testutil.RunIn(t, dir, "qemu-img", args...)
	return testutil.Output{Stdout: o, Stderr: e, Code: c}
}

// raceEnabled is set by race_test.go when the tests run with -race.
var raceEnabled bool
